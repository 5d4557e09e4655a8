"""Assert tests judged outside the candidate's process.

An ``{"assert": "assert add(2, 3) == 5"}`` test used to be appended to the program and
passed when the process exited 0, so a program that ended itself with status 0 (or hooked
exit, exceptions or tracing, or re-ran the interpreter with asserts compiled out) scored
1.0. Now the test is split in the parent:

- **probes**: the sub-expressions that call or name the candidate's code (``add(2, 3)``),
  with their inputs. Only these enter the sandbox; the harness there runs the program,
  evaluates each probe, and writes the values back as plain data (None, bool, int, float,
  str, list, tuple, dict, set; exact types, so an object with an always-true ``__eq__`` or
  an ``int`` subclass is refused).
- **the verdict**: the rest of the assert (``== 5``) never enters the sandbox; the parent
  evaluates it over the returned values with a small set of builtins.

The expected values are therefore never readable from inside, and the candidate's exit
status, hooks and output cannot make a wrong value right: the only way to pass is to
return the right value. A probe may not use a name the test itself binds (a comprehension
or lambda variable): that would send the relation to be checked into the sandbox, where the
candidate could read it and answer True; such a test is a one-line error.
"""

from __future__ import annotations

import ast
import builtins
import json
import math
from dataclasses import dataclass
from typing import Any

from orbitrl.errors import OrbitError

# names a test may use outside the candidate's code (evaluated in the parent)
_SAFE_BUILTINS = ("abs", "all", "any", "bool", "dict", "divmod", "enumerate", "filter",
                  "float", "frozenset", "int", "isinstance", "len", "list", "map", "max",
                  "min", "pow", "range", "reversed", "round", "set", "sorted", "str", "sum",
                  "tuple", "zip")
SAFE = {name: getattr(builtins, name) for name in _SAFE_BUILTINS} | {"math": math}

# the record the harness writes after the program's own output: b"\n" RECORD json b"\n"
RECORD = b"\n\x1eorbitrl-probes "


@dataclass(frozen=True)
class AssertTest:
    """A parsed assert test: what runs inside (``probes``) and the check outside."""

    source: str
    probes: tuple[str, ...]
    checks: tuple[ast.Expression, ...]  # each over names __p0, __p1, ...


def parse_assert(source: str, where: str) -> AssertTest:
    """Split an assert snippet into probes and checks.

    Raises:
        OrbitError: naming ``where``: not Python, not only assert statements, a probe over a
            name the test binds, or an assert with no candidate code in it.
    """
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        raise OrbitError(f"{where}: not valid Python ({e.msg}, line {e.lineno})") from None
    if not tree.body or not all(isinstance(s, ast.Assert) for s in tree.body):
        raise OrbitError(f"{where}: expected only assert statements, e.g. "
                         f"'assert add(2, 3) == 5'")
    probes: list[str] = []
    checks = []
    for stmt in tree.body:
        cut = _Cut(probes, where)
        expr = cut.visit(stmt.test)
        if cut.found == 0:
            raise OrbitError(f"{where}: {ast.unparse(stmt.test)!r} does not call the "
                             f"program's code")
        checks.append(ast.fix_missing_locations(ast.Expression(expr)))
    return AssertTest(source, tuple(probes), tuple(checks))


class _Cut(ast.NodeTransformer):
    """Replace each maximal sub-expression that reaches the candidate's names by __pK."""

    def __init__(self, probes: list[str], where: str):
        self.probes, self.where, self.found = probes, where, 0
        self.bound: set[str] = set()  # names the test itself binds (comprehensions, lambdas)

    def _cut(self, node: ast.AST) -> ast.AST:
        inner = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        if inner & self.bound:
            raise OrbitError(f"{self.where}: {ast.unparse(node)!r} uses a variable of the "
                             f"test; write one assert per input")
        self.found += 1
        self.probes.append(ast.unparse(node))
        return ast.copy_location(ast.Name(f"__p{len(self.probes) - 1}", ast.Load()), node)

    def _reaches(self, node: ast.AST) -> bool:
        return any(isinstance(n, ast.Name) and n.id not in SAFE and n.id not in self.bound
                   for n in ast.walk(node))

    def visit_Name(self, node: ast.Name):
        if node.id in SAFE or node.id in self.bound:
            return node
        return self._cut(node)

    def visit_Call(self, node: ast.Call):
        if self._reaches(node.func):  # the candidate's function, method or class
            return self._cut(node)
        return self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id not in SAFE \
                and node.value.id not in self.bound:
            return self._cut(node)
        return self.generic_visit(node)

    def _binding(self, node, targets):
        names = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        saved = set(self.bound)
        self.bound |= names
        try:
            return self.generic_visit(node)
        finally:
            self.bound = saved

    def visit_ListComp(self, node):
        return self._binding(node, [g.target for g in node.generators])

    visit_SetComp = visit_GeneratorExp = visit_DictComp = visit_ListComp

    def visit_Lambda(self, node):
        return self._binding(node, [ast.Name(a.arg) for a in
                                    node.args.args + node.args.kwonlyargs])


def read_values(stdout: bytes) -> tuple[list[tuple[str, Any]] | None, str]:
    """The harness's record in a run's stdout as (status, value) per probe, status "ok" or
    "error" (the value is then the reason); (None, reason) when there is no well-formed
    record. The record is the last one the run wrote: a missing or malformed one means the
    program ended before its values were read, or printed over them."""
    at = stdout.rfind(RECORD)
    if at < 0:
        return None, "no values returned (the program ended before the test ran)"
    try:
        raw = json.loads(stdout[at + len(RECORD):].split(b"\n", 1)[0])
        out = []
        for status, payload in raw:
            if status not in ("ok", "error"):
                raise ValueError(status)
            out.append((status, decode(payload) if status == "ok" else str(payload)))
    except Exception as e:  # anything the program printed is its own failure only
        return None, f"malformed values ({type(e).__name__})"
    return out, ""


def judge_record(test: AssertTest, stdout: bytes) -> tuple[bool, str]:
    """(passed, reason) from the harness's record in a run's stdout (see read_values)."""
    record, why = read_values(stdout)
    if record is None:
        return False, why
    values = []
    for status, payload in record:
        if status != "ok":
            return False, f"the program's code raised or returned {payload}"[:160]
        values.append(payload)
    if len(values) != len(test.probes):
        return False, f"{len(values)} values for {len(test.probes)} probes"
    env = {f"__p{k}": v for k, v in enumerate(values)}
    for check in test.checks:
        try:
            ok = eval(compile(check, "<test>", "eval"), {"__builtins__": SAFE}, dict(env))
        except Exception as e:  # the values do not fit the check (a str where a list is)
            return False, f"{ast.unparse(check.body)}: {type(e).__name__}"[:160]
        if not ok:  # (plain data: its truth cannot be overridden)
            got = ", ".join(f"{p} = {v!r}" for p, v in zip(test.probes, values))
            return False, f"failed: {test.source.strip()} (got {got})"[:160]
    return True, ""


def decode(x: Any) -> Any:
    """Inverse of the harness's encoding: tuples, sets and dicts are tagged objects."""
    if isinstance(x, list):
        return [decode(v) for v in x]
    if isinstance(x, dict):
        (tag, body), = x.items()
        if tag == "t":
            return tuple(decode(v) for v in body)
        if tag == "s":
            return set(decode(v) for v in body)
        if tag == "f":
            return frozenset(decode(v) for v in body)
        if tag == "d":
            return {decode(k): decode(v) for k, v in body}
        raise KeyError(tag)
    return x


# runs inside the sandbox after the program (exact types only; see the module docstring)
HARNESS_PROBES = r"""
def _plain(v, depth=0):
    t = type(v)
    if depth > 64:
        raise TypeError("nested too deep")
    if v is None or t is bool or t is int or t is float or t is str:
        return v
    if t is list:
        return [_plain(x, depth + 1) for x in v]
    if t is tuple:
        return {"t": [_plain(x, depth + 1) for x in v]}
    if t is set or t is frozenset:
        return {"s" if t is set else "f": [_plain(x, depth + 1) for x in v]}
    if t is dict:
        return {"d": [[_plain(k, depth + 1), _plain(x, depth + 1)] for k, x in v.items()]}
    raise TypeError("a " + t.__name__ + ", not plain data")
_out = []
for _p in _probes:
    try:
        _out.append(["ok", _plain(eval(compile(_p, "<test>", "eval"), g))])
    except BaseException as _e:
        _out.append(["error", type(_e).__name__ + ": " + str(_e)[:80]])
sys.stdout.flush()
os.write(1, RECORD + _json.dumps(_out).encode() + b"\n")
"""
