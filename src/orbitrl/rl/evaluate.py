"""Held-out accuracy with greedy decoding.

``greedy_complete`` is a plain reference decoder (full recompute per token, packed rows)
used when no engine is passed; the RL loop passes its engine so that evaluation samples
through the same path as rollout.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from orbitrl.model.decoder import Decoder


@torch.no_grad()
def greedy_complete(model: Decoder, prompts: list[list[int]], max_tokens: int,
                    eos_id: Optional[int]) -> list[list[int]]:
    """Greedy completions (token ids, eos excluded) for tokenised prompts."""
    outs: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    for _ in range(max_tokens):
        if not live:
            break
        seqs = [prompts[i] + outs[i] for i in live]
        ids, pos, sid = Decoder.packed_inputs(seqs, device=model.device)
        hidden = model(ids, positions=pos, seq_ids=sid, return_hidden=True)[0]
        ends = torch.tensor([len(s) for s in seqs], device=ids.device).cumsum(0) - 1
        nxt = model.lm_head(hidden[ends]).argmax(-1).tolist()
        still = []
        for i, t in zip(live, nxt):
            if eos_id is not None and t == eos_id:
                continue
            outs[i].append(t)
            still.append(i)
        live = still
    return outs


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
             batch_size: int = 256) -> tuple[float, list[dict]]:
    """Mean reward of greedy completions; returns (accuracy, per-row records)."""
    complete = complete or (lambda ps: greedy_complete(model, ps, max_tokens,
                                                       tokenizer.eos_token_id))
    records = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        prompts = [tokenizer(r[prompt_field], add_special_tokens=False)["input_ids"]
                   for r in chunk]
        for r, c in zip(chunk, complete(prompts)):
            text = tokenizer.decode(c, skip_special_tokens=True)
            score = float(reward_fn(r[prompt_field], text,
                                    **reward_fields(r, prompt_field, answer_field)))
            records.append({"prompt": r[prompt_field], "completion": text,
                            "answer": r.get(answer_field), "score": score})
    acc = sum(r["score"] for r in records) / max(1, len(records))
    return acc, records
