"""Tools a model can call: ``calculator`` (safe arithmetic), ``python`` (a program in the
sandbox of rewards/sandbox.py), and user tools by "pkg.module:func" import path.

A tool is ``fn(arguments) -> str | bytes``: ``arguments`` is the call's dict (json calls)
or its text (plain calls). Raising is allowed: the caller turns it into an error result
and counts it. Each tool carries a JSON schema (``SCHEMAS``) for chat templates that list
the tools to the model.
"""

from __future__ import annotations

import ast
import json
import operator
import threading

from orbitrl.errors import OrbitError
from orbitrl.plugins import load_object
from orbitrl.rewards.sandbox import Job, Sandbox

MAX_DIGITS = 4000  # a calculator result longer than this is an error, not a huge string
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
        ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class ToolError(Exception):
    """A tool refused its input (the message goes back to the model)."""


def _arg(arguments, key: str) -> str:
    if isinstance(arguments, dict):
        if key not in arguments:
            raise ToolError(f"missing argument {key!r}")
        return str(arguments[key])
    return str(arguments)


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (abs(b) > 64 or abs(a) > 10 ** 6):
            raise ToolError("exponent too large")
        out = _OPS[type(node.op)](a, b)
        if isinstance(out, int) and out.bit_length() > MAX_DIGITS * 3.33:
            raise ToolError("result too large")
        return out
    raise ToolError(f"unsupported expression ({type(node).__name__})")


def calculator(arguments) -> str:
    """Evaluate +, -, *, /, //, %, ** over numbers and parentheses (an AST walk: no names,
    calls or attributes, so no Python is executed). Integers stay exact."""
    expr = _arg(arguments, "expression").strip()
    if not expr or len(expr) > 256:
        raise ToolError("expression must be 1-256 characters")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        raise ToolError("not an arithmetic expression") from None
    try:
        value = _eval(tree)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    if isinstance(value, float):
        return repr(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)
    return str(value)


class PythonTool:
    """Run the call's ``code`` in the sandbox (rewards/sandbox.py) under its limits; the
    result is the program's stdout, or its status and the last lines of stderr."""

    def __init__(self, sandbox_cfg=None):
        self.cfg, self._box, self._lock = sandbox_cfg, None, threading.Lock()

    def box(self):
        with self._lock:
            if self._box is None:
                self._box = Sandbox(self.cfg)
            return self._box

    def __call__(self, arguments) -> bytes | str:
        res = self.box().run(Job(_arg(arguments, "code")))
        if res.status == "ok":
            return res.stdout
        tail = res.stderr[-400:].decode("utf-8", errors="replace").strip()
        return f"error ({res.status}): {res.reason}\n{tail}".strip()


SCHEMAS = {
    "calculator": {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression exactly.",
        "parameters": {"type": "object", "properties": {"expression": {
            "type": "string", "description": "e.g. 347*58+12"}}, "required": ["expression"]}}},
    "python": {"type": "function", "function": {
        "name": "python", "description": "Run a Python program; returns what it prints.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                       "required": ["code"]}}},
}


def build_tools(names: list[str], sandbox_cfg=None) -> dict:
    """name -> callable for the configured ``env.tools`` (built-ins or import paths; an
    import path's tool is called by its attribute name)."""
    out = {}
    for name in names:
        if name == "calculator":
            out[name] = calculator
        elif name == "python":
            out[name] = PythonTool(sandbox_cfg)
        elif ":" in str(name):
            fn = load_object(name, "tool")
            out[name.rpartition(":")[2].rpartition(".")[2]] = fn
        else:
            raise OrbitError(f"config key 'env.tools': unknown tool {name!r} (built-in: "
                             "calculator, python; or an import path 'pkg.module:func')")
    return out


def tool_schemas(tools: dict) -> list[dict]:
    """Schemas for chat templates: the built-ins' own, a user tool's ``schema`` attribute
    or a minimal one from its name and docstring."""
    out = []
    for name, fn in tools.items():
        s = SCHEMAS.get(name) or getattr(fn, "schema", None) or {
            "type": "function", "function": {"name": name, "description": (
                (fn.__doc__ or name).strip().split("\n")[0]),
                "parameters": {"type": "object", "properties": {}}}}
        out.append(s)
    return out


def describe_tools(schemas: list[dict], start: str, end: str, fmt: str) -> str:
    """A system message that tells a model its tools and how to call them, for chat
    templates that do not render ``tools`` (``env.tools_prompt: system``): one line per tool
    (name, description, arguments) and an example call in the run's syntax."""
    lines = ["You can use these tools:"]
    for s in schemas:
        f = s.get("function", s)
        args = ", ".join(f"{k} ({v.get('type', 'string')})" for k, v in
                         f.get("parameters", {}).get("properties", {}).items())
        lines.append(f"- {f['name']}: {f.get('description', '').strip()}"
                     + (f" Arguments: {args}." if args else ""))
    f = schemas[0].get("function", schemas[0])
    arg = next(iter(f.get("parameters", {}).get("properties", {})), None)
    if fmt == "json":
        call = json.dumps({"name": f["name"], "arguments": {arg: "..."} if arg else {}})
    else:
        call = f"{f['name']}: ..."
    lines.append(f"To call a tool, write {start}{call}{end} and stop; its result comes back "
                 f"in the next message. Then give the final answer.")
    return "\n".join(lines)
