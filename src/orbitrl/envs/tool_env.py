"""The ``tools`` environment: each model turn either calls tools or answers.

``reset(row)`` gives the row's prompt. ``step(turn)``: the tool calls in the turn are run
and their results, made safe (``CallSyntax.sanitize``), are the observation; a turn
without a call is the final answer (done; the run's verifier scores it as in single-turn
training). Counters in ``info``: ``tool_calls``, ``tool_errors`` (a call that did not
parse, an unknown tool, a tool that raised) and ``answer_hits`` (a tool result equal to the
row's answer: the tool was used the right way).
"""

from __future__ import annotations

from orbitrl.envs.base import Environment, StepResult
from orbitrl.envs.toolcall import CallSyntax
from orbitrl.envs.tools import ToolError, build_tools

_TOOLS_CACHE: dict = {}  # (tool names, sandbox section) -> tools: one sandbox per run


def syntax_of(env_cfg) -> CallSyntax:
    return CallSyntax(env_cfg.tool_call_start, env_cfg.tool_call_end, env_cfg.tool_call_format,
                      (list(env_cfg.tools) or [""])[0])


def tools_of(env_cfg, run_cfg=None) -> dict:
    sandbox = run_cfg.reward.sandbox if run_cfg is not None else None
    key = (tuple(env_cfg.tools), id(sandbox))
    if key not in _TOOLS_CACHE:
        _TOOLS_CACHE[key] = build_tools(list(env_cfg.tools), sandbox)
    return _TOOLS_CACHE[key]


class ToolEnv(Environment):
    """Tool calling over ``env.tools`` with the call syntax of ``env.tool_call_*``."""

    def __init__(self, env_cfg, run_cfg=None):
        self.syntax, self.tools = syntax_of(env_cfg), tools_of(env_cfg, run_cfg)
        self.max_chars = env_cfg.max_output_chars
        self.prompt_field = run_cfg.data.prompt_field if run_cfg is not None else "prompt"
        self.answer_field = run_cfg.data.answer_field if run_cfg is not None else "answer"
        self.row: dict = {}

    def reset(self, row: dict) -> str:
        self.row = row
        return str(row[self.prompt_field])

    def step(self, action: str) -> StepResult:
        calls = self.syntax.parse(action)
        if not calls:
            return StepResult(None, 0.0, True, {"tool_calls": 0})
        results, errors, hits = [], 0, 0
        answer = str(self.row.get(self.answer_field, "")).strip()
        for call in calls:
            out, ok = self._run(call)
            errors += not ok
            text = self.syntax.sanitize(out, self.max_chars)
            hits += ok and answer != "" and text.strip() == answer
            results.append(text)
        return StepResult("\n".join(results), 0.0, False,
                          {"tool_calls": len(calls), "tool_errors": errors,
                           "answer_hits": hits})

    def _run(self, call) -> tuple[object, bool]:
        if call.error:
            return f"error: {call.error}", False
        fn = self.tools.get(call.name)
        if fn is None:
            return f"error: unknown tool {call.name!r}", False
        try:
            return fn(call.arguments), True
        except ToolError as e:
            return f"error: {e}", False
        except Exception as e:  # noqa: BLE001 - a failing user tool is the model's problem
            return f"error: {type(e).__name__}: {e}", False
