"""Evaluation tasks: what to prompt, where a completion stops, how it is scored.

A task turns rows into prompts and scores completions in one batch (so HumanEval's
programs share one sandbox pool). ``score`` returns one :class:`Verdict` per completion;
a row that cannot be judged (its checker cannot be split) is listed in ``errors`` with a
one-line reason and every completion of it fails: it is counted, never passed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from orbitrl.data import humaneval
from orbitrl.data.gsm8k import load_gsm8k
from orbitrl.errors import OrbitError
from orbitrl.rewards.checkfn import Verdict, judge_programs, record_calls
from orbitrl.rewards.code import extract_program
from orbitrl.rewards.sandbox import Sandbox
from orbitrl.rewards.verifiers import math_answer

GSM8K_SAMPLE = Path(__file__).resolve().parents[1] / "builtin" / "tasks" / "gsm8k_sample.jsonl"


@dataclass
class Task:
    """name; rows: one dict per problem with ``id`` and ``prompt``; stop: stop strings;
    score: (row indices, completions, progress) -> verdicts, ``progress(count)`` called as
    completions are judged; errors: row id -> why it cannot be
    judged; max_tokens: the default completion cap."""

    name: str
    rows: list[dict]
    stop: tuple[str, ...]
    score: Callable[[list[int], list[str], Callable[[int], None]], list[Verdict]]
    max_tokens: int
    errors: dict[str, str] = field(default_factory=dict)


# chat: the answer's code block ends at its closing fence (prose after it is not code), or
# where a top-level statement after the function starts (the model's own usage example or
# asserts, which the original evaluation cuts too). Not "\ndef ": the block opens with one.
CHAT_STOP = ("\n```\n", "\nif __name__", "\nprint(", "\nassert ")
INSTRUCT = ("Complete the following Python function. Reply with the whole function in one "
            "```python code block.\n\n```python\n{prompt}```")


def humaneval_task(sandbox_cfg=None, limit: int = 0, chat: bool = False) -> Task:
    """HumanEval: the program is the prompt plus the completion (a continuation of the
    function), or with ``chat`` (an instruct model under its chat template, asked by
    ``INSTRUCT``) the prompt plus the code block of its answer; each problem's check runs
    here over the values its calls returned in the sandbox (rewards/checkfn.py)."""
    problems = humaneval.load_problems()[:limit or None]
    specs, errors = [], {}
    for p in problems:
        try:
            specs.append(record_calls(p["task_id"], p["entry_point"], p["prompt"], p["test"],
                                      p["canonical_solution"]))
        except OrbitError as e:
            specs.append(None)
            errors[p["task_id"]] = str(e)
    rows = [{"id": p["task_id"], "prompt": INSTRUCT.format(prompt=p["prompt"]) if chat
             else p["prompt"]} for p in problems]
    box: list = []

    def score(index: list[int], completions: list[str], progress) -> list[Verdict]:
        if not box:
            box.append(Sandbox(sandbox_cfg))
        out: list[Verdict | None] = [None] * len(index)
        items, where = [], []
        for j, (i, text) in enumerate(zip(index, completions)):
            if specs[i] is None:
                out[j] = Verdict(False, "unjudgeable", errors[rows[i]["id"]])
            else:
                code = "\n" + extract_program(text) if chat else text
                items.append((specs[i], problems[i]["prompt"] + code))
                where.append(j)
        progress(len(index) - len(items))
        step = 8 * box[0].workers  # a chunk at a time, so the bar moves
        for at in range(0, len(items), step):
            verdicts = judge_programs(box[0], items[at:at + step])
            for j, v in zip(where[at:at + step], verdicts):
                out[j] = v
            progress(len(verdicts))
        return out  # type: ignore[return-value]

    return Task("humaneval", rows, CHAT_STOP if chat else humaneval.STOP, score, 384, errors)


def gsm8k_task(path: str | Path | None = None, limit: int = 0) -> Task:
    """A GSM8K-format file (default: the shipped sample): the prompt is
    ``Question: ...\\nAnswer:``; the completion is right when math-verify finds its answer
    equal to the number after ``####`` in the row's answer."""
    data = load_gsm8k(path or GSM8K_SAMPLE)[:limit or None]
    rows = [{"id": r["id"], "prompt": f"Question: {r['question']}\nAnswer:",
             "answer": r["answer"]} for r in data]

    def score(index: list[int], completions: list[str], progress) -> list[Verdict]:
        out = []
        for i, text in zip(index, completions):
            ok = math_answer(rows[i]["prompt"], text, answer=rows[i]["answer"]) == 1.0
            out.append(Verdict(ok, "passed" if ok else "failed",
                               "" if ok else f"expected {rows[i]['answer']}"))
            progress(1)
        return out

    return Task("gsm8k", rows, ("\nQuestion:",), score, 256)


def make_task(spec: str, sandbox_cfg=None, limit: int = 0, chat: bool = False) -> Task | None:
    """The task a ``--task`` value names (``humaneval``, ``gsm8k``, ``gsm8k:FILE``), or None
    when it is not one of these (a built-in training task). ``chat``: prompts go under the
    model's chat template (``--chat-template``)."""
    if spec == "humaneval":
        return humaneval_task(sandbox_cfg, limit, chat)
    if spec == "gsm8k" or spec.startswith("gsm8k:"):
        path = spec.split(":", 1)[1] if ":" in spec else None
        if path == "":
            raise OrbitError("--task gsm8k:FILE: give the file after the colon")
        return gsm8k_task(path, limit)
    return None
