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
