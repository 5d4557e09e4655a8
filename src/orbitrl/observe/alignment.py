"""Rollout-vs-trainer alignment: for the same tokens, do the engine and the trainer see the
same next-token distributions?

The adapter-first setup's claim is that sampling and training run the very same path, so
the logprobs a sample was drawn with are the ones training recomputes. This module turns
two sets of next-token logits over the same positions into the figures that check it:

- ``l1_mean`` / ``l1_max``: the L1 distance between the two next-token distributions,
  sum_v |p_v - q_v| (in [0, 2]; twice the total variation), mean and max over positions;
- ``topk_agreement``: mean over positions of |top-k(p) & top-k(q)| / k;
- ``top1_agreement``: the fraction of positions whose most likely token is the same;
- ``logprob_gap_mean`` / ``logprob_gap_max``: |engine - trainer| logprob of the sampled
  token (what training's importance ratio sees);
- ``logit_max_abs``: the largest absolute logit difference (diagnostic).

Defaults of :class:`AlignmentBounds`: L1 under 0.1 at every position (the article's bound),
top-k agreement at least 0.9, sampled-token gap under 0.1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AlignmentBounds:
    """Limits past which the two paths count as misaligned."""

    max_l1: float = 0.1  # on l1_max: every position's distributions within this L1
    min_topk_agreement: float = 0.9
    max_logprob_gap: float = 0.1  # on logprob_gap_max
    top_k: int = 5


def compare(engine_logits: torch.Tensor, trainer_logits: torch.Tensor,
            engine_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor,
            top_k: int = 5) -> dict[str, float]:
    """The alignment figures (module docstring) over N positions.

    Args:
        engine_logits, trainer_logits: [N, V] next-token logits from each path.
        engine_logprobs, trainer_logprobs: [N] logprob of the sampled token in each path.
    """
    if engine_logits.shape != trainer_logits.shape or engine_logits.dim() != 2:
        raise ValueError(f"logits shapes differ: {tuple(engine_logits.shape)} vs "
                         f"{tuple(trainer_logits.shape)}")
    a, b = engine_logits.double(), trainer_logits.double()
    l1 = (a.softmax(-1) - b.softmax(-1)).abs().sum(-1)  # [N]
    k = min(top_k, a.shape[-1])
    ta, tb = a.topk(k, -1).indices, b.topk(k, -1).indices  # [N, k]
    overlap = (ta[:, :, None] == tb[:, None, :]).any(-1).double().sum(-1) / k
    gap = (engine_logprobs.double() - trainer_logprobs.double()).abs()
    return {"positions": float(a.shape[0]), "l1_mean": l1.mean().item(),
            "l1_max": l1.max().item(), "topk_agreement": overlap.mean().item(),
            "top1_agreement": (ta[:, 0] == tb[:, 0]).double().mean().item(),
            "logprob_gap_mean": gap.mean().item(), "logprob_gap_max": gap.max().item(),
            "logit_max_abs": (a - b).abs().max().item()}


def violations(m: dict[str, float], bounds: AlignmentBounds) -> list[str]:
    """One line per bound the figures break (empty: aligned)."""
    out = []
    if not m["l1_max"] < bounds.max_l1:
        out.append(f"next-token distributions differ: L1 max {m['l1_max']:.3g} (mean "
                   f"{m['l1_mean']:.3g}) is not under {bounds.max_l1:g}")
    if not m["topk_agreement"] >= bounds.min_topk_agreement:
        out.append(f"top-{bounds.top_k} agreement {m['topk_agreement']:.3f} is under "
                   f"{bounds.min_topk_agreement:g}")
    if not m["logprob_gap_max"] < bounds.max_logprob_gap:
        out.append(f"sampled-token logprob gap max {m['logprob_gap_max']:.3g} is not under "
                   f"{bounds.max_logprob_gap:g}")
    return out
