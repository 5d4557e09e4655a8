"""Routing replay on the trainer's side: the engine's expert choices laid out like the packed
batch, and the periodic measurement of what replay saves.

A mixture's rollout records, per sample, the experts each token ran (``Sample.routing``
[S, prompt + completion, k], from the engine). The trainer's forwards replay them
(``rl.batch.score`` passes ``PackedBatch.routing`` to the model), so a near-tied router that a
weight update or a rounding difference would flip cannot move a sampled token's logprob by
a whole expert's contribution. Every ``moe.replay_check_every`` steps one extra no-grad
forward without replay measures the gap replay removed (``logprob_mismatch_max_noreplay``)
and how many (token, layer) choices flipped (``routing_flip_frac``).
"""

from __future__ import annotations

import torch

from orbitrl.model.moe import Routing, wants_routing
from orbitrl.rl.batch import PackedBatch, score
from orbitrl.rl.types import Sample


def pack_routing(batch: PackedBatch, samples: list[Sample]) -> torch.Tensor | None:
    """The samples' recorded experts in ``batch``'s layout: [S, R * L, k], -1 where no record
    covers a token (padding, a prefix-cache hit, the last sampled token). A token is found by
    (sequence, position): its own sample's record, or for a prompt shared by a group (a
    sequence id >= B), the record of any sample laid out after it (they share that prefill).
    None when a sample has no record (a dense model, replay switched off)."""
    if not samples or any(s.routing is None for s in samples):
        return None
    B = len(samples)
    sid = batch.seq_ids.reshape(-1).cpu()
    pos = batch.positions.reshape(-1).cpu()
    par = sid if batch.parent_ids is None else batch.parent_ids.reshape(-1).cpu()
    owner = sid.clone()
    rep = torch.full((int(sid.max()) + 1 + B,), -1, dtype=torch.long)
    member = (sid >= 0) & (sid < B) & (par != sid)  # completions reading a shared prompt
    rep[par[member]] = sid[member]
    shared = sid >= B
    owner[shared] = rep[sid[shared]]
    lens = torch.tensor([s.routing.shape[1] for s in samples])
    offs = torch.cumsum(lens, 0) - lens
    recs = torch.cat([s.routing for s in samples], dim=1)  # [S, sum of lengths, k]
    safe = owner.clamp(min=0)
    ok = (owner >= 0) & (pos < lens[safe])
    out = torch.full((recs.shape[0], sid.numel(), recs.shape[2]), -1, dtype=recs.dtype)
    out[:, ok] = recs[:, (offs[safe] + pos)[ok]]
    return out.to(batch.input_ids.device)


def attach_routing(model, parts: list[PackedBatch], groups: list[list[Sample]]) -> None:
    """Set each packed micro-batch's ``routing`` from its samples when ``model`` replays."""
    if not wants_routing(model):
        return
    for p, g in zip(parts, groups):
        p.routing = pack_routing(p, g)


@torch.no_grad()
def replay_check(model, parts: list[PackedBatch], temperature: float, step: int,
                 every: int) -> dict:
    """On every ``every``-th step of a replaying mixture: the rollout/trainer logprob gap
    without replay (``logprob_mismatch_max_noreplay``, ``..._mean_noreplay``) and the
    fraction of recorded (layer, token) expert sets the free router changes
    (``routing_flip_frac``); {} otherwise. One extra no-grad forward of the batch."""
    if every <= 0 or step % every or not wants_routing(model) \
            or any(p.routing is None for p in parts):
        return {}
    gaps, flips, known = [], 0.0, 0.0
    for p in parts:
        free = Routing(record=True)
        logp = score(model, p, temperature, routing=free)
        gaps.append((logp - p.rollout_logp).abs()[p.mask.bool()])
        rec = p.routing.long()
        got = free.chosen_tensor().sort(-1).values
        have = (rec >= 0).all(-1)
        flips += float(((got != rec.sort(-1).values).any(-1) & have).sum())
        known += float(have.sum())
    gap = torch.cat(gaps)
    return {"logprob_mismatch_max_noreplay": float(gap.max()) if gap.numel() else 0.0,
            "logprob_mismatch_mean_noreplay": float(gap.mean()) if gap.numel() else 0.0,
            "routing_flip_frac": flips / max(known, 1.0)}
