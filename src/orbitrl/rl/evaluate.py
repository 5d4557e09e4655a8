"""Held-out accuracy with greedy decoding through the rollout engine (the path the RL loop
samples with). One path for every caller: the trainer (before and after training), the
``orbitrl eval`` command and scripts all go through :class:`Evaluator`, which encodes
prompts as training encodes them (``data.chat_template``) and scores completions through
the reward runner (a failing verifier is an error scored 0, as in training)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

def reward_fields(row: dict, prompt_field: str, answer_field: str) -> dict:
    """Dataset fields handed to a reward: all but the prompt, with the answer under
    ``answer`` whatever its column is called."""
    out = {k: v for k, v in row.items() if k != prompt_field and k not in ("prompt",
                                                                          "completion")}
    if answer_field in row:
        out["answer"] = row[answer_field]
    return out


class Evaluator:
    """Greedy held-out accuracy through the run's own engine and prompt encoding (what the
    RL loop samples with), each rank scoring its share of the rows.

    Args:
        engine: the rollout engine; ``encode``: prompt text -> ids as training encodes it.
        data: the ``data`` config section (prompt and answer fields).
        max_tokens: completion length cap; timeout_s: a named reward's time limit.
        weights: a context manager for the weights generation runs on (sharded runs).
        coll: the Collective (rows split over ranks, the sum reduced; one process: None).
    """

    def __init__(self, engine, encode: Callable, data, max_tokens: int, timeout_s=None,
                 weights=nullcontext, coll=None, trajectories=None):
        from orbitrl.distributed.collective import Collective

        self.engine, self.encode, self.data = engine, encode, data
        self.trajectories = trajectories  # multi-turn: Rollouts.trajectories
        self.max_tokens, self.timeout_s, self.weights = max_tokens, timeout_s, weights
        self.coll = coll or Collective()

    def accuracy(self, rows: list[dict], reward, version: int = 0) -> float:
        """Mean reward of greedy completions over ``rows`` (every rank's)."""
        return self.run(rows, reward, version)[0]

    def run(self, rows: list[dict], reward, version: int = 0) -> tuple[float, list[dict]]:
        """(mean reward over every rank's ``rows``, this rank's per-row records).

        Args:
            reward: a RewardRunner, a registered reward's name or a reward callable.
            version: the policy version recorded on the samples.
        """
        from orbitrl.engine import SamplingParams
        from orbitrl.rl.rollout import generate

        d = self.data
        total = len(rows)
        a, b = self.coll.share(total)  # each rank scores its share, the sum is reduced
        rows = rows[a:b]
        prompts = [] if self.trajectories else [self.encode(r[d.prompt_field]) for r in rows]
        params = SamplingParams(n=1, max_tokens=self.max_tokens, temperature=0.0)
        with self.weights():
            if self.trajectories is not None:  # the final turn's text is the answer
                got = {s.group - a: s for s in self.trajectories(rows, params, version, 0, a)[0]}
                samples = [got.get(i) or _Dropped() for i in range(len(rows))]
            else:
                samples = generate(self.engine, prompts, rows, params, version, 0, first=a)
        res = self._runner(reward)([r[d.prompt_field] for r in rows], [s.text for s in samples],
                                   [reward_fields(r, d.prompt_field, d.answer_field)
                                    for r in rows])
        failed = {e.index: e.reason for e in res.errors}
        for i, s in enumerate(samples):
            if isinstance(s, _Dropped):
                failed.setdefault(i, "trajectory dropped (environment error or time limit)")
        records = [{"prompt": r[d.prompt_field], "completion": s.text, "answer":
                    r.get(d.answer_field), "score": x,
                    **({"turns": s.info["turns"], "tool_calls": s.info.get("tool_calls", 0),
                        "tool_errors": s.info.get("tool_errors", 0),
                        "tool_correct": s.info.get("answer_hits", 0) > 0,
                        "trajectory": _transcript(s)} if s.info.get("turns") else {}),
                    **({"error": failed[i]} if i in failed else {})}
                   for i, (r, s, x) in enumerate(zip(rows, samples, res.rewards))]
        return float(self.coll.all_sum(float(sum(res.rewards))) / max(1, total)), records

    def _runner(self, reward):
        from orbitrl.rewards import RewardRunner, RewardSource, get_reward

        if isinstance(reward, RewardRunner):
            return reward
        name = reward if isinstance(reward, str) else getattr(reward, "__name__", "reward")
        return RewardRunner([RewardSource(get_reward(reward), name=name)],
                            timeout_s=self.timeout_s)


class _Dropped:
    """A held-out row whose trajectory was dropped: an empty answer, scored 0."""
    text, info = "", {}


def tool_summary(records: list[dict]) -> dict | None:
    """Multi-turn records' tool use: the fraction of trajectories that called a tool, that
    called it correctly (a tool returned the row's answer), that called it and answered
    right, and the tool errors; None for single-turn records."""
    if not any("turns" in r for r in records):
        return None
    n = max(1, len(records))
    used = [r for r in records if r.get("tool_calls", 0)]
    return {"tool_use_rate": len(used) / n,
            "tool_correct_rate": sum(bool(r.get("tool_correct")) for r in records) / n,
            "tool_solved_rate": sum(r["score"] for r in used) / n,
            "solved_without_tool": sum(r["score"] for r in records
                                       if not r.get("tool_calls", 0)) / n,
            "tool_errors": sum(r.get("tool_errors", 0) for r in records),
            "turns_mean": sum(r.get("turns", 0) for r in records) / n}


def _transcript(sample) -> str:
    """A trajectory's turns as one string (model and environment text in order)."""
    return "".join(t for _, t in sample.info.get("log", []))


def accuracy(model, tokenizer, rows: list[dict], reward_fn, prompt_field: str = "prompt",
             answer_field: str = "answer", max_tokens: int = 8,
             chat_template: bool = False) -> tuple[float, list[dict]]:
    """Mean reward of greedy completions of a model outside a run (scripts); returns
    (accuracy, per-row records)."""
    from types import SimpleNamespace

    from orbitrl.engine import Engine
    from orbitrl.model.tokenizer import encode_prompt

    data = SimpleNamespace(prompt_field=prompt_field, answer_field=answer_field)
    ev = Evaluator(Engine(model, tokenizer), lambda t: encode_prompt(tokenizer, t, chat_template),
                   data, max_tokens)
    return ev.run(rows, reward_fn)
