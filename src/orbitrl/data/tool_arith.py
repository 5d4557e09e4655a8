"""The built-in tool task: ``347*58=`` -> ``20126``, three-digit by two-digit products
that the built-in model cannot compute in one go but can with a calculator.

A solved trajectory, in the plain call syntax the built-in tokenizer can spell (it has no
braces for JSON)::

    347*58=[347*58](20126)20126<eos>
           ^ model  ^ env  ^ model

The model writes the call ``[347*58]`` (the turn stops at ``]``), the ``tools``
environment appends the calculator's result as ``(20126)``, and the model's final turn
copies it; ``exact_match`` scores the final turn. ``TOOL_ENV`` holds the ``env`` settings
this syntax needs (examples/tool_arith.yaml uses the same).

Problems are drawn once with a fixed seed and cut into disjoint splits (held-out problems
are never seen by the warm start or by RL). The ``sft`` split is the warm start: each
tool trace as its two model turns, ``prompt -> call`` and ``prompt + call + result ->
answer``, so supervised learning, like RL, never trains on the environment's tokens.
The split is large (4,000 problems) so that the warm start learns to copy operands and
results rather than memorise problems: copying is the skill here, and it is learnt
abruptly, at a step that depends on the seed (docs/envs.md: the same schedule ends
anywhere from 0% to 85% held-out). A warm start stopped on the way leaves RL a model that
calls the tool but miscopies, and the reward tells it which copies were right.
"""

from __future__ import annotations

import random

SPLITS = {"heldout": (0, 300), "sft": (300, 4300), "rl": (4300, 24000)}
TOOL_ENV = {"name": "tools", "tools": ["calculator"], "tool_call_start": "[",
            "tool_call_end": "]", "tool_call_format": "plain", "tool_results": "plain",
            "result_template": "({result})", "max_turns": 3, "turn_max_tokens": 12,
            "max_output_chars": 12}


def _problems() -> list[tuple[int, int]]:
    rng = random.Random(4321)
    seen, out = set(), []
    while len(out) < SPLITS["rl"][1]:
        p = (rng.randrange(100, 1000), rng.randrange(10, 100))
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def tool_rows(split: str, limit: int | None = None, traces: bool = True) -> list[dict]:
    """Rows ``{"prompt": "347*58=", "answer": "20126"}`` of a split; the ``sft`` split as
    warm-start pairs (two per problem, see the module docstring) unless ``traces`` is off
    (the chat warm start lays out its own: rl/trajectory.py ``chat_tool_pairs``)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")
    lo, hi = SPLITS[split]
    probs = _problems()[lo:hi][:limit or None]
    rows = [{"prompt": f"{a}*{b}=", "answer": str(a * b)} for a, b in probs]
    if split != "sft" or not traces:
        return rows
    pairs = []
    for r in rows:
        call = "[" + r["prompt"][:-1] + "]"
        pairs.append({"prompt": r["prompt"], "answer": call})
        pairs.append({"prompt": r["prompt"] + call + f"({r['answer']})", "answer": r["answer"]})
    return pairs
