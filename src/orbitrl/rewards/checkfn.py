"""Check functions (HumanEval's ``def check(candidate): assert candidate(...) == ...``)
judged outside the candidate's process.

A check function is code, not a list of asserts: loops over random inputs, helper functions
from the problem's prompt, tolerances (``abs(candidate(x) - y) < 1e-6``). Appending it to
the program and reading the exit status would let a program that ends itself with status
0, patches ``assert``'s machinery, or returns an object whose ``__eq__`` is always true pass.
So the check is split the way ``probes.py`` splits asserts:

1. **record** (here, once per problem): the check runs in this process with ``candidate``
   bound to the reference solution; each call's arguments (plain data only) are recorded
   in order. These calls are the probes (``has_close_elements([1.0, 2.8], 0.3)``).
2. **run** (sandbox): the candidate's program runs, then the harness evaluates the probes in
   order and writes their values back as plain data of exact types (``probes.py``).
3. **replay** (here): the check runs again, with ``candidate`` answering each call from the
   returned values; its asserts, tolerances and helpers run here, over values that cannot
   override their own comparisons. A call that raised inside raises here.

The check's ``random`` module is a private one seeded per problem, so steps 1 and 3 draw the
same inputs; helpers come from the problem's prompt (trusted), never from the candidate, so
a program that redefines ``poly`` gains nothing. When a wrong value changes the inputs of a
later call (the check's control flow depends on it), the replay stops at that call and the
program runs again with the new call list, at most ``MAX_ROUNDS`` times.

A problem whose check cannot be split (it makes no candidate call, passes a function or an
object where plain data is needed, or fails on the reference solution) is a one-line :class:`OrbitError` naming the problem, at load time.
"""

from __future__ import annotations

import builtins
import math
import random
import types
from dataclasses import dataclass
from typing import Any, Callable

from orbitrl.errors import OrbitError
from orbitrl.rewards.probes import read_values
from orbitrl.rewards.sandbox import Job, Sandbox

MAX_ROUNDS = 3


@dataclass(frozen=True)
class CheckSpec:
    """One problem's check, ready to judge programs.

    name: the problem ("HumanEval/0"); entry: the function under test; setup: trusted code
    the check needs (the prompt: imports, helpers); test: source defining ``check``;
    calls: the probe sources recorded on the reference solution, in call order.
    """

    name: str
    entry: str
    setup: str
    test: str
    calls: tuple[str, ...]


@dataclass
class Verdict:
    """One program's outcome: status ``passed``, ``failed`` (wrong values or a failed
    assert), ``runtime_error``, ``time_limit``, ``memory``, ... (the sandbox run's status),
    ``diverged`` (the calls kept changing) or ``sandbox_error``; reason in one line."""

    passed: bool
    status: str
    reason: str = ""


class CandidateRaised(Exception):
    """What the check sees where the candidate's call raised inside the sandbox."""


class _NotPlain(Exception):
    pass


class _Diverged(BaseException):  # (not an Exception: a check's ``except`` must not eat it)
    def __init__(self, index: int, call: str):
        super().__init__(call)
        self.index, self.call = index, call


def source(v: Any, depth: int = 0) -> str:
    """Python source that evaluates to the plain value ``v`` (exact types: None, bool, int,
    float, str, list, tuple, dict, set, frozenset); raises _NotPlain for anything else."""
    t = type(v)
    if depth > 64:
        raise _NotPlain("nested too deep")
    if v is None or t in (bool, int, str):
        return repr(v)
    if t is float:
        return repr(v) if math.isfinite(v) else f"float({str(v)!r})"
    if t in (list, tuple, set, frozenset):
        items = [source(x, depth + 1) for x in v]
        if t is list:
            return "[" + ", ".join(items) + "]"
        if t is tuple:
            return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
        return f"{t.__name__}([" + ", ".join(items) + "])"
    if t is dict:
        return "{" + ", ".join(f"{source(k, depth + 1)}: {source(x, depth + 1)}"
                               for k, x in v.items()) + "}"
    raise _NotPlain(f"a {t.__name__}")


def _call_source(entry: str, args: tuple, kwargs: dict) -> str:
    parts = [source(a) for a in args] + [f"{k}={source(v)}" for k, v in kwargs.items()]
    return f"{entry}({', '.join(parts)})"


def _private_random(seed: int) -> types.ModuleType:
    """A ``random`` module whose module-level functions draw from their own generator."""
    mod = types.ModuleType("random")
    mod.__dict__.update({k: v for k, v in vars(random).items() if not k.startswith("__")})
    gen = random.Random(seed)
    for k, v in vars(random).items():
        if getattr(v, "__self__", None) is random._inst:  # random.randint and the like
            setattr(mod, k, getattr(gen, k))
    return mod


def _namespace(spec_name: str, setup: str, test: str, entry: str, seed: int) -> dict:
    """Globals holding the setup's helpers and ``check``; ``import random`` gives a private
    seeded module. The entry point's name is dropped here: the caller binds it to the same
    callable as ``candidate`` (a check may name it: HumanEval/33 compares the two), never
    to the prompt's body-less stub."""
    rand = _private_random(seed)

    def importer(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "random" and level == 0:
            return rand
        return builtins.__import__(name, globals, locals, fromlist, level)

    g: dict = {"__name__": "__check__", "__builtins__": {**vars(builtins),
                                                         "__import__": importer}}
    exec(compile(setup, f"<{spec_name} prompt>", "exec"), g)
    g.pop(entry, None)
    exec(compile(test, f"<{spec_name} test>", "exec"), g)
    if not callable(g.get("check")):
        raise OrbitError(f"{spec_name}: the test defines no check(candidate) function")
    return g


def _run_check(name: str, setup: str, test: str, entry: str, candidate) -> None:
    g = _namespace(name, setup, test, entry, _seed(name))
    g[entry] = candidate
    g["check"](candidate)


def _seed(name: str) -> int:
    return sum((i + 1) * ord(c) for i, c in enumerate(name))


def record_calls(name: str, entry: str, setup: str, test: str, reference: str) -> CheckSpec:
    """Run ``check`` on the reference solution here and record its calls.

    Args:
        name: the problem, for messages; entry: the function's name; setup: the prompt;
        test: the check's source; reference: the reference body (appended to the prompt).

    Raises:
        OrbitError: one line naming the problem when its check cannot be split.
    """
    ref_g: dict = {"__name__": "__reference__"}
    try:
        exec(compile(setup + reference, f"<{name} reference>", "exec"), ref_g)
        fn = ref_g[entry]
    except Exception as e:
        raise OrbitError(f"{name}: the reference solution does not load ({e})") from None
    calls: list[str] = []

    def recorder(*args, **kwargs):
        try:
            calls.append(_call_source(entry, args, kwargs))
        except _NotPlain as e:
            raise OrbitError(f"{name}: a call passes {e}, not plain data; its check "
                             f"cannot be judged outside the program") from None
        return fn(*args, **kwargs)

    try:
        _run_check(name, setup, test, entry, recorder)
    except OrbitError:
        raise
    except Exception as e:
        raise OrbitError(f"{name}: the check fails on the reference solution "
                         f"({type(e).__name__}: {str(e)[:80]})") from None
    if not calls:
        raise OrbitError(f"{name}: the check never calls the candidate")
    return CheckSpec(name, entry, setup, test, tuple(calls))


def replay(spec: CheckSpec, calls: tuple[str, ...],
           record: list[tuple[str, Any]]) -> tuple[Verdict | None, tuple[str, ...] | None]:
    """Run ``check`` here over the values the sandbox returned for ``calls``.

    Returns:
        (verdict, None), or (None, new calls) when the check asked for a call that was not
        run (its inputs depend on an earlier value): the program runs again with those.
    """
    made = [0]

    def answer(*args, **kwargs):
        k = made[0]
        made[0] += 1
        try:
            call = _call_source(spec.entry, args, kwargs)
        except _NotPlain as e:  # a value the program returned, passed back in
            raise CandidateRaised(f"the check passed {e} to the program") from None
        if k >= len(calls) or k >= len(record) or calls[k] != call:
            raise _Diverged(k, call)
        status, value = record[k]
        if status != "ok":
            raise CandidateRaised(f"{call[:60]} raised or returned {value}")
        return value

    try:
        _run_check(spec.name, spec.setup, spec.test, spec.entry, answer)
    except _Diverged as d:
        return None, calls[:d.index] + (d.call,) + calls[d.index + 1:]
    except CandidateRaised as e:
        return Verdict(False, "failed", str(e)[:160]), None
    except AssertionError:
        return Verdict(False, "failed", f"an assert failed after {made[0]} calls"), None
    except Exception as e:  # the values do not fit the check (a str where a number is)
        return Verdict(False, "failed", f"{type(e).__name__}: {str(e)[:100]}"), None
    return Verdict(True, "passed"), None


def judge_programs(sandbox: Sandbox, items: list[tuple[CheckSpec, str]],
                   deadline_s: float | None = None,
                   on_done: Callable[[int], None] | None = None) -> list[Verdict]:
    """Judge (spec, program) pairs: every program runs in ``sandbox`` with its probes, the
    checks replay here (see the module docstring).

    Args:
        deadline_s: per round of runs (default: enough for every run at its time limit).
        on_done: called with the number of programs judged after each round (progress).
    """
    out: list[Verdict | None] = [None] * len(items)
    pending = {i: spec.calls for i, (spec, _) in enumerate(items)}
    for _ in range(MAX_ROUNDS):
        if not pending:
            break
        order = sorted(pending)
        jobs = [Job(items[i][1], b"", pending[i]) for i in order]
        budget = deadline_s or (60.0 + sandbox.cfg.time_limit_s * len(jobs)
                                / max(1, sandbox.workers) * 2)
        results = sandbox.run_many(jobs, deadline_s=budget)
        again = {}
        for i, res in zip(order, results):
            verdict, calls = _judge_one(items[i][0], pending[i], res)
            if verdict is None:
                again[i] = calls
            else:
                out[i] = verdict
        if on_done is not None:
            on_done(len(order) - len(again))
        pending = again
    for i in pending:
        out[i] = Verdict(False, "diverged", f"{items[i][0].name}: the check's calls kept "
                         f"changing with the program's values ({MAX_ROUNDS} runs)")
    return out  # type: ignore[return-value]


def _judge_one(spec: CheckSpec, calls: tuple[str, ...], res) -> tuple[Verdict | None, Any]:
    if res.status == "sandbox_error":
        return Verdict(False, "sandbox_error", res.reason[:160]), None
    record, why = read_values(res.stdout)
    if record is None:
        status = res.status if res.status != "ok" else "runtime_error"
        return Verdict(False, status, (res.reason or why)[:160]), None
    return replay(spec, calls, record)
