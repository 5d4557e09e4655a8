"""Held-out accuracy with greedy decoding through the rollout engine (the path the RL
loop samples with)."""

from __future__ import annotations

from typing import Callable, Optional

from orbitrl.model.decoder import Decoder
from orbitrl.model.tokenizer import encode_prompt


def reward_fields(row: dict, prompt_field: str, answer_field: str) -> dict:
    """Dataset fields handed to a reward: all but the prompt, with the answer under
    ``answer`` whatever its column is called."""
    out = {k: v for k, v in row.items() if k != prompt_field and k not in ("prompt",
                                                                          "completion")}
    if answer_field in row:
        out["answer"] = row[answer_field]
    return out


def accuracy(model: Decoder, tokenizer, rows: list[dict], reward_fn: Callable,
             prompt_field: str = "prompt", answer_field: str = "answer",
             max_tokens: int = 8, complete: Optional[Callable] = None,
             batch_size: int = 256, chat_template: bool = False) -> tuple[float, list[dict]]:
    """Mean reward of greedy completions; returns (accuracy, per-row records). Prompts are
    encoded as training encodes them (``chat_template`` as ``data.chat_template``)."""
    if complete is None:
        from orbitrl.engine import Engine, Request, SamplingParams

        engine = Engine(model, tokenizer)
        greedy = SamplingParams(n=1, max_tokens=max_tokens, temperature=0.0)

        def complete(prompts):
            outs = engine.generate([Request(prompt_ids=p) for p in prompts], greedy)
            return [[t for t in o.samples[0].token_ids if t not in engine.eos_ids]
                    for o in outs]
    records = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        prompts = [encode_prompt(tokenizer, r[prompt_field], chat_template) for r in chunk]
        for r, c in zip(chunk, complete(prompts)):
            text = tokenizer.decode(c, skip_special_tokens=True)
            score = float(reward_fn(r[prompt_field], text,
                                    **reward_fields(r, prompt_field, answer_field)))
            records.append({"prompt": r[prompt_field], "completion": text,
                            "answer": r.get(answer_field), "score": score})
    acc = sum(r["score"] for r in records) / max(1, len(records))
    return acc, records


class Evaluator:
    """Greedy held-out accuracy through the run's own engine and prompt encoding (what the
    RL loop samples with), each rank scoring its share of the rows.

    Args:
        engine: the rollout engine; ``encode``: prompt text -> ids as training encodes it.
        data: the ``data`` config section (prompt and answer fields).
        max_tokens: completion length cap; timeout_s: a named reward's time limit.
        weights: a context manager for the weights generation runs on (sharded runs).
        coll: the Collective (rows split over ranks, the sum reduced).
    """

    def __init__(self, engine, encode: Callable, data, max_tokens: int, timeout_s, weights,
                 coll):
        self.engine, self.encode, self.data = engine, encode, data
        self.max_tokens, self.timeout_s, self.weights, self.coll = (max_tokens, timeout_s,
                                                                    weights, coll)

    def accuracy(self, rows: list[dict], reward, version: int = 0) -> float:
        """Mean reward of greedy completions over ``rows``; ``reward``: a RewardRunner or
        a registered reward's name."""
        from orbitrl.engine import SamplingParams
        from orbitrl.rewards import RewardRunner, RewardSource, get_reward
        from orbitrl.rl.rollout import generate

        d = self.data
        total = len(rows)
        a, b = self.coll.share(total)  # each rank scores its share, the sum is reduced
        rows = rows[a:b]
        prompts = [self.encode(r[d.prompt_field]) for r in rows]
        params = SamplingParams(n=1, max_tokens=self.max_tokens, temperature=0.0)
        with self.weights():
            samples = generate(self.engine, prompts, rows, params, version, 0, first=a)
        runner = reward if isinstance(reward, RewardRunner) else RewardRunner(
            [RewardSource(get_reward(reward), name=reward)], timeout_s=self.timeout_s)
        res = runner([r[d.prompt_field] for r in rows], [s.text for s in samples],
                     [reward_fields(r, d.prompt_field, d.answer_field) for r in rows])
        return float(self.coll.all_sum(float(sum(res.rewards))) / max(1, total))
