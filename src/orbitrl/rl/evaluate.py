"""Evaluation through the rollout engine (the path the RL loop samples with). One path for
every caller: the trainer (before and after training), ``orbitrl eval`` (``--run``, a data
file, ``--task humaneval | gsm8k``) and scripts all go through :class:`Evaluator`, the one
place that encodes evaluation prompts (as training does: ``data.chat_template``) and
generates from them: batched, n samples per prompt sharing the prompt's KV blocks, with a
progress bar. Greedy accuracy is scored through the reward runner (a failing verifier is an
error scored 0, as in training); the suite's tasks judge the completions themselves."""

from __future__ import annotations

import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

from orbitrl.distributed.collective import Collective
from orbitrl.engine import Engine, Request, SamplingParams
from orbitrl.errors import OrbitError
from orbitrl.model.tokenizer import encode_prompt
from orbitrl.rewards import RewardRunner, RewardSource, get_reward


def reward_fields(row: dict, prompt_field: str, answer_field: str) -> dict:
    """Dataset fields handed to a reward: all but the prompt, with the answer under
    ``answer`` whatever its column is called."""
    out = {k: v for k, v in row.items() if k != prompt_field and k not in ("prompt",
                                                                          "completion")}
    if answer_field in row:
        out["answer"] = row[answer_field]
    return out


@dataclass
class Judged:
    """accuracy: the strict grader's over the rows judged; reward: the mean training reward
    of the same completions; n: rows judged (every rank's); records: this rank's rows."""
    accuracy: float
    reward: float
    n: int
    records: list


class Evaluator:
    """Prompt encoding and generation for every evaluation, through the run's own engine
    (what the RL loop samples with); greedy accuracy with each rank scoring its share.

    Args:
        engine: the rollout engine, or a function (longest sequence in tokens) -> engine
            called at the first generation (a KV pool sized for the prompts encoded so far).
        encode: prompt text -> ids as training encodes it.
        data: the ``data`` config section (prompt and answer fields; ``run`` only).
        max_tokens: completion length cap; timeout_s: a named reward's time limit.
        weights: a context manager for the weights generation runs on (sharded runs).
        coll: the Collective (rows split over ranks, the sum reduced; one process: None).
        context: the model's context in tokens; when given, a prompt longer than the context
            minus ``max_tokens`` is cut from the left and counted in ``truncated``.
    """

    def __init__(self, engine, encode: Callable, data, max_tokens: int, timeout_s=None,
                 weights=nullcontext, coll=None, context: int | None = None,
                 trajectories=None):
        self._engine, self.encode, self.data = engine, encode, data
        self.trajectories = trajectories  # multi-turn: Rollouts.trajectories
        self.max_tokens, self.timeout_s, self.weights = max_tokens, timeout_s, weights
        self.coll = coll or Collective()
        self.context, self.truncated, self._longest = context, 0, 0

    @property
    def engine(self):
        if callable(self._engine) and not hasattr(self._engine, "generate"):
            self._engine = self._engine(self._longest + self.max_tokens + 16)
        return self._engine

    def encode_prompts(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each prompt (``encode``), cut from the left to leave ``max_tokens``
        of the context when ``context`` is set (cut prompts are printed and counted)."""
        prompts = [self.encode(t) for t in texts]
        if self.context is not None:
            room = self.context - self.max_tokens
            if room < 1:
                raise OrbitError(f"--max-tokens {self.max_tokens}: the model's context is "
                                 f"{self.context} tokens, leaving no room for a prompt")
            cut = sum(len(p) > room for p in prompts)
            if cut:
                print(f"{cut} of {len(prompts)} prompts cut from the left to {room} tokens "
                      f"(context {self.context}, {self.max_tokens} for the completion)",
                      file=sys.stderr)
            self.truncated += cut
            prompts = [p[-room:] for p in prompts]
        self._longest = max([self._longest] + [len(p) for p in prompts])
        return prompts

    def complete(self, prompts: list[list[int]], params: list, progress: bool = False,
                 label: str = "") -> list[list[str]]:
        """Completion texts per prompt (``params[i].n`` each) in one engine batch: the n
        samples of a prompt, and requests with the same prompt, share its KV blocks.

        Args:
            prompts: token ids (``encode_prompts``); params: one SamplingParams each.
            progress: print ``label`` and show a bar over samples (rate and ETA).
        Raises:
            OrbitError: a request the engine rejected (naming the prompt's index).
        """
        if progress:
            print(f"{label}: {len(prompts)} requests, {sum(p.n for p in params)} samples",
                  file=sys.stderr, flush=True)
        try:
            with self.weights():
                outs = self.engine.generate([Request(prompt_ids=p) for p in prompts], params,
                                            progress=progress)
        finally:
            self.engine.release_packed()  # a run's engine holds them for a rollout only
        texts = []
        for o in outs:
            if o.error is not None:
                raise OrbitError(f"prompt {o.index}: rejected by the engine: {o.error}")
            texts.append([s.text or "" for s in o.samples])
        return texts

    def accuracy(self, rows: list[dict], reward, version: int = 0) -> float:
        """Mean reward of greedy completions over ``rows`` (every rank's)."""
        return self.run(rows, reward, version)[0]

    def run(self, rows: list[dict], reward, version: int = 0) -> tuple[float, list[dict]]:
        """(mean reward over every rank's ``rows``, this rank's per-row records).

        Args:
            reward: a RewardRunner, a registered reward's name or a reward callable.
            version: the policy version (kept for callers; greedy decoding ignores it).
        """
        j = self.judge(rows, reward, version=version)
        return j.reward, j.records

    def judge(self, rows: list[dict], reward, grader=None, max_seconds: float = 0.0,
              version: int = 0) -> "Judged":
        """Greedy completions of ``rows``, each scored by the training ``reward`` and judged
        by ``grader`` (``fn(prompt, completion, answer) -> bool``, rewards/graders.py; None:
        correct = the reward is 1).

        Args:
            max_seconds: > 0: rows go in chunks of CHUNK_ROWS and no chunk starts after
                this many seconds (the first always runs); ``Judged.n`` counts those judged.
        """
        chunks = [rows] if max_seconds <= 0 else \
            [rows[i:i + self.CHUNK_ROWS] for i in range(0, len(rows), self.CHUNK_ROWS)]
        t0 = time.perf_counter()
        out = Judged(0.0, 0.0, 0, [])
        rsum = csum = 0.0
        for i, chunk in enumerate(chunks):
            if i and self.coll.any(time.perf_counter() - t0 > max_seconds):
                break
            r, c, records = self._judge(chunk, reward, grader, version)
            rsum, csum, out.n = rsum + r, csum + c, out.n + len(chunk)
            out.records += records
        out.reward, out.accuracy = rsum / max(1, out.n), csum / max(1, out.n)
        return out

    CHUNK_ROWS = 16

    def _judge(self, rows, reward, grader, version):
        """(reward sum, correct sum) over every rank's share of ``rows``, and this rank's
        records."""
        d = self.data
        total = len(rows)
        a, b = self.coll.share(total)  # each rank scores its share, the sum is reduced
        rows = rows[a:b]
        greedy = SamplingParams(n=1, max_tokens=self.max_tokens, temperature=0.0)
        samples = None
        if self.trajectories is not None:  # the final turn's text is the answer
            with self.weights():
                got = {s.group - a: s
                       for s in self.trajectories(rows, greedy, version, 0, a)[0]}
            samples = [got.get(i) or _Dropped() for i in range(len(rows))]
            texts = [s.text for s in samples]
        else:
            prompts = self.encode_prompts([r[d.prompt_field] for r in rows])
            texts = [t[0] for t in self.complete(prompts, [greedy] * len(prompts))]
        runner = self._runner(reward)
        res = runner([r[d.prompt_field] for r in rows], texts,
                     [reward_fields(r, d.prompt_field, d.answer_field) for r in rows])
        failed = {e.index: e.reason for e in res.errors}
        for i, s in enumerate(samples or []):
            if isinstance(s, _Dropped):
                failed.setdefault(i, "trajectory dropped (environment error or time limit)")
        infos = [s.info for s in samples] if samples else [{}] * len(rows)
        # the strict grader judges the reply, as the rewards do (reward.strip_thinking)
        replies = [runner.reply(t) for t in texts]
        correct = [bool(x == 1.0) if grader is None else
                   bool(grader(r[d.prompt_field], t, r.get(d.answer_field)))
                   for r, t, x in zip(rows, replies, res.rewards)]
        records = [{"prompt": r[d.prompt_field], "completion": t, "answer":
                    r.get(d.answer_field), "score": x, "correct": ok,
                    **({"turns": info["turns"], "tool_calls": info.get("tool_calls", 0),
                        "tool_errors": info.get("tool_errors", 0),
                        "tool_correct": info.get("answer_hits", 0) > 0,
                        "trajectory": _transcript(samples[i])} if info.get("turns") else {}),
                    **({"error": failed[i]} if i in failed else {})}
                   for i, (r, t, x, info, ok) in enumerate(zip(rows, texts, res.rewards,
                                                                infos, correct))]
        return (float(self.coll.all_sum(float(sum(res.rewards)))),
                float(self.coll.all_sum(float(sum(correct)))), records)

    def _runner(self, reward):
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
    data = SimpleNamespace(prompt_field=prompt_field, answer_field=answer_field)
    ev = Evaluator(Engine(model, tokenizer), lambda t: encode_prompt(tokenizer, t, chat_template),
                   data, max_tokens)
    return ev.run(rows, reward_fn)
