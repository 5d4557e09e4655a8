"""The ``code`` reward: run the completion's Python program against test cases in the
sandbox and score the fraction of tests passed.

Test cases come from the sample's ``tests`` field (else ``answer``): a list, or a JSON
string of a list, of

- ``{"input": "3 4\\n", "output": "7\\n"}``: stdin in, stdout compared after trimming
  trailing whitespace on every line and trailing blank lines;
- ``{"assert": "assert add(3, 4) == 7"}``: the program runs, then the harness evaluates
  the calls into its code (``add(3, 4)``) and reports their values as plain data; the
  comparison (``== 7``) runs here, outside the candidate's process (rewards/probes.py).

The candidate's exit status never means "passed": an assert test passes only on the right
values, a stdin/stdout test only on the right output of a clean run.

Scores are deterministic for deterministic programs: no test depends on timing unless it
runs into a limit, and the hash seed is fixed.

A whole batch of completions runs through one pool (``score_batch``, which the
RewardRunner calls once per step), so tests of different samples run in parallel and the
step waits at most ``reward.sandbox.deadline_s``. Counts by outcome are returned as metrics
(they appear in metrics.jsonl as ``reward_code_<outcome>``). A sample whose run failed in the
sandbox itself (not in the program) is an error, not a 0, so a broken sandbox is visible.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from orbitrl.config import RewardSection, SandboxSection
from orbitrl.errors import OrbitError
from orbitrl.rewards.probes import AssertTest, judge_record, parse_assert
from orbitrl.rewards.registry import register
from orbitrl.rewards.sandbox import Job, RunResult, Sandbox
from orbitrl.rewards.verifiers import cut_at_eos

_PYTHON = ("python", "python3", "py")

# run status -> metrics key (counts of test runs)
OUTCOMES = {"ok": "passed", "wrong": "wrong", "runtime_error": "runtime_errors",
            "time_limit": "time_limits", "memory": "memory_kills",
            "output_limit": "output_limits", "file_limit": "file_limits", "signal": "signals",
            "deadline": "deadline_kills", "sandbox_error": "sandbox_errors"}


@dataclass
class TestCase:
    """One test: stdin/stdout (``input``, ``output``) or an assert snippet (``check``)."""

    input: str = ""
    output: str | None = None
    check: AssertTest | None = None


@dataclass
class BatchScores:
    """What ``score_batch`` returns to the RewardRunner.

    scores: [B] fraction of tests passed, None where the sample is an error; errors: (index,
    kind, reason) per failed sample; details: [B] per-test outcomes ({"status", "reason"});
    metrics: counts over the batch's test runs, plus ``pass_rate``.
    """

    scores: list[float | None]
    errors: list[tuple[int, str, str]] = field(default_factory=list)
    details: list[list[dict]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


def _fences(text: str) -> tuple[list[tuple[str, str]], list[int]]:
    """Fenced blocks as (info string, body) and the offsets of every fence line; an
    unterminated last block runs to the end (a completion cut at max_tokens)."""
    blocks, offsets, body, info, pos = [], [], None, "", 0
    for line in text.splitlines(keepends=True):
        if line.strip().startswith("```"):
            offsets.append(pos)
            if body is None:
                body, info = [], line.strip()[3:].strip().lower()
            else:
                blocks.append((info, "".join(body)))
                body = None
        elif body is not None:
            body.append(line)
        pos += len(line)
    if body is not None:
        blocks.append((info, "".join(body)))
    return blocks, offsets


def extract_program(completion: str, eos_text: str | None = None) -> str:
    """The program in a completion: the first ```python (or ```py) fenced block; else, when
    a lone bare fence closes code (the prompt opened the fence), the text before it; else
    the first fenced block; else the whole text."""
    text = cut_at_eos(completion, eos_text)
    blocks, offsets = _fences(text)
    for info, body in blocks:
        if info in _PYTHON:
            return body
    if len(offsets) % 2 == 1 and text[:offsets[0]].strip():
        first = text[offsets[0]:].split("\n", 1)[0].strip()
        if first == "```":
            return text[:offsets[0]]
    if blocks:
        return blocks[0][1]
    return text


def parse_tests(value: Any, where: str = "tests") -> list[TestCase]:
    """Test cases from a list (or JSON string of a list) of dicts.

    Raises:
        OrbitError: naming ``where`` and the test index, for anything malformed.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise OrbitError(f"{where}: not a JSON list of tests ({e.msg})") from None
    if not isinstance(value, list) or not value:
        raise OrbitError(f"{where}: expected a non-empty list of tests, got "
                         f"{type(value).__name__}")
    out = []
    for i, t in enumerate(value):
        if not isinstance(t, dict):
            raise OrbitError(f"{where}[{i}]: expected an object, got {type(t).__name__}")
        keys = set(t)
        if keys == {"assert"} and isinstance(t["assert"], str) and t["assert"].strip():
            out.append(TestCase(check=parse_assert(t["assert"], f"{where}[{i}]")))
        elif keys == {"input", "output"} and all(isinstance(t[k], str) for k in keys):
            out.append(TestCase(input=t["input"], output=t["output"]))
        else:
            raise OrbitError(f"{where}[{i}]: expected {{'input': str, 'output': str}} or "
                             f"{{'assert': str}}, got keys {sorted(keys)}")
    return out


def _normalize(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).rstrip()


def judge(test: TestCase, res: RunResult) -> tuple[str, str]:
    """(status, reason) of one test: ``ok`` when it passed, ``wrong`` when the program ran
    cleanly but printed something else, else the run's status."""
    if test.check is not None:
        passed, why = judge_record(test.check, res.stdout)
        if passed:  # the values are right, whatever the process did after reporting them
            return "ok", ""
        return (res.status, res.reason) if res.status != "ok" else ("wrong", why)
    if res.status != "ok":
        return res.status, res.reason
    got = _normalize(res.stdout.decode("utf-8", "replace"))
    if got == _normalize(test.output or ""):
        return "ok", ""
    return "wrong", f"expected {_normalize(test.output or '')[:40]!r}, got {got[:40]!r}"


class CodeReward:
    """The ``code`` reward (see the module docstring). The sandbox starts on first use."""

    def __init__(self, cfg: SandboxSection | None = None):
        self.cfg = cfg or SandboxSection()
        self._sandbox: Sandbox | None = None
        self.__name__ = "code"

    def with_config(self, reward: RewardSection) -> "CodeReward":
        """A CodeReward under the run's ``reward.sandbox`` limits; checks the sandbox works
        now, so a machine without one fails before training starts."""
        out = CodeReward(reward.sandbox)
        _ = out.sandbox
        return out

    @property
    def sandbox(self) -> Sandbox:
        if self._sandbox is None:
            self._sandbox = Sandbox(self.cfg)
        return self._sandbox

    def __call__(self, prompt: str, completion: str, **fields: Any) -> float:
        res = self.score_batch([prompt], [completion], [fields])
        if res.errors:
            raise RuntimeError(res.errors[0][2])
        return float(res.scores[0])  # type: ignore[arg-type]

    def score_batch(self, prompts: list[str], completions: list[str],
                    fields: list[dict[str, Any]]) -> BatchScores:
        """Score B samples in one sandbox batch.

        Returns:
            BatchScores; a sample with bad test cases, or whose run failed in the sandbox,
            is an error (its score None) rather than a 0.
        """
        n = len(completions)
        scores: list[float | None] = [None] * n
        errors: list[tuple[int, str, str]] = []
        jobs: list[Job] = []
        plan: list[tuple[int, TestCase]] = []
        for i, (completion, row) in enumerate(zip(completions, fields)):
            raw = row.get("tests", row.get("answer"))
            if raw is None:
                errors.append((i, "exception", "reward 'code' needs the dataset field "
                               "'tests' (or 'answer') holding test cases"))
                continue
            try:
                tests = parse_tests(raw, "reward 'code': field tests")
            except OrbitError as e:
                errors.append((i, "exception", str(e)))
                continue
            program = extract_program(completion, row.get("eos_text"))
            for t in tests:
                jobs.append(Job(program, t.input.encode(),
                                None if t.check is None else t.check.probes))
                plan.append((i, t))
        results = self.sandbox.run_many(jobs) if jobs else []
        counts = {k: 0 for k in OUTCOMES.values()}
        details: list[list[dict]] = [[] for _ in range(n)]
        for (i, t), res in zip(plan, results):
            status, reason = judge(t, res)
            counts[OUTCOMES[status]] += 1
            details[i].append({"status": status, "reason": reason})
        for i, outcomes in enumerate(details):  # (a sample with an error above has none)
            if not outcomes:
                continue
            broken = [o for o in outcomes if o["status"] == "sandbox_error"]
            if broken:
                errors.append((i, "sandbox", broken[0]["reason"][:200]))
            else:
                scores[i] = sum(o["status"] == "ok" for o in outcomes) / len(outcomes)
        metrics = {k: float(v) for k, v in counts.items()}
        metrics["tests"] = float(len(results))
        metrics["pass_rate"] = counts["passed"] / len(results) if results else 0.0
        return BatchScores(scores, sorted(errors), details, metrics)


register("code")(CodeReward())
