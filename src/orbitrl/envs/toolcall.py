"""Tool calls in a model turn, and tool output made safe to append.

A call sits between two markers: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(the Qwen-style convention, format ``json``), or any other pair with the arguments as plain
text (format ``plain``: ``name:args``, or just ``args`` for the first configured tool; the
built-in model's ``[347*58]``). Only the model's own turn is parsed, never what an
environment appended, and tool output has both markers escaped, so output cannot forge a
call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


@dataclass
class ToolCall:
    name: str
    arguments: object  # dict (json format) or str (plain format)
    error: str = ""    # why the call could not be parsed ("" if it parsed)


class CallSyntax:
    """The markers and argument format of tool calls.

    Args:
        start, end: the markers around one call (``end`` is also the turn's stop string).
        fmt: ``json`` or ``plain``.
        default_tool: the tool a plain call without ``name:`` goes to.
    """

    def __init__(self, start: str, end: str, fmt: str = "json", default_tool: str = ""):
        if not start or not end:
            raise ValueError("tool call markers must be non-empty")
        self.start, self.end, self.fmt, self.default_tool = start, end, fmt, default_tool
        self.regex = re.compile(re.escape(start) + r"(.*?)" + re.escape(end), re.S)

    def parse(self, text: str) -> list[ToolCall]:
        """Every complete call in ``text``, in order (unparseable ones carry ``error``)."""
        return [self._one(m.group(1)) for m in self.regex.finditer(text)]

    def _one(self, body: str) -> ToolCall:
        if self.fmt == "plain":
            name, sep, args = body.partition(":")
            if sep and re.fullmatch(r"[A-Za-z_][\w.]*", name.strip()):
                return ToolCall(name.strip(), args.strip())
            return ToolCall(self.default_tool, body.strip())
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            return ToolCall("", None, f"tool call is not JSON ({e.msg})")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return ToolCall("", None, "tool call JSON needs a string 'name'")
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some templates send arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        return ToolCall(obj["name"], args)

    def sanitize(self, output, max_chars: int) -> str:
        """Tool output as safe text: bytes decoded (invalid UTF-8 replaced), control
        characters other than newline and tab dropped, both call markers escaped, cut to
        ``max_chars`` with a note of how much was cut."""
        if isinstance(output, (bytes, bytearray)):
            output = bytes(output).decode("utf-8", errors="replace")
        text = _CONTROL.sub("", str(output))
        if len(text) > max_chars:
            cut = len(text) - max_chars
            text = text[:max_chars] + f"...({cut} more)"
        return self.escape(text)

    def escape(self, text: str) -> str:
        """Both markers made inert (each first character doubled into a visible form that
        no longer matches), repeated until none is left."""
        for _ in range(8):
            before = text
            for m in (self.start, self.end):
                text = text.replace(m, _inert(m))
            if text == before:
                break
        while self.start in text or self.end in text:  # pathological overlaps
            text = text.replace(self.start, "").replace(self.end, "")
        return text


def _inert(marker: str) -> str:
    """A visibly similar string that is not the marker: '<' and '>' as HTML entities,
    brackets as parentheses, anything else prefixed with a backslash."""
    table = {"<": "&lt;", ">": "&gt;", "[": "(", "]": ")", "{": "(", "}": ")"}
    out = "".join(table.get(c, c) for c in marker)
    return out if out != marker else "\\" + marker
