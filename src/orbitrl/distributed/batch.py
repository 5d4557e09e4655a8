"""Statistics over the global batch when each rank holds only its own rows.

GRPO and RLOO normalise within a group, and a group never leaves its rank, so their
advantages are computed locally. PPO's and REINFORCE++'s whitening (and the KL-in-reward
penalty's batch mean) are batch-wide: :func:`on_global_batch` gathers every rank's rows,
runs the one-process function over all of them, and keeps this rank's rows, so the result
is the one a single process computes for the same batch.
"""

from __future__ import annotations

import torch

from orbitrl.distributed.env import Dist


def _pad_to(t: torch.Tensor, width: int) -> torch.Tensor:
    if t.dim() < 2 or t.shape[1] == width:
        return t
    out = t.new_zeros((t.shape[0], width) + tuple(t.shape[2:]))
    out[:, :t.shape[1]] = t
    return out


def on_global_batch(dist: Dist, fn, *tensors):
    """``fn(*tensors)`` over every rank's rows; returns this rank's rows of its output(s).

    Args:
        tensors: each [B_r] or [B_r, T_r] (rows of this rank, T_r its padded length) or None;
            rows are concatenated in rank order (the global sample order), columns
            zero-padded to the longest rank's.
    Returns:
        What ``fn`` returns (a tensor or a tuple of them), cut to this rank's rows and
        columns [B_r, T_r].
    """
    if not dist.enabled:
        return fn(*tensors)
    dev = next(t.device for t in tensors if t is not None)
    parts = dist.gather_objects([None if t is None else t.detach().cpu() for t in tensors])
    rows = [next(t.shape[0] for t in p if t is not None) for p in parts]
    start = sum(rows[:dist.rank])
    full = []
    for i, t in enumerate(tensors):
        pieces = [p[i] for p in parts if p[i] is not None]  # a rank with no rows may differ
        if t is None:
            full.append(None)
            continue
        width = max(x.shape[1] for x in pieces) if t.dim() >= 2 else 0
        full.append(torch.cat([_pad_to(x, width) for x in pieces]).to(dev))
    out = fn(*full)
    width = next((t.shape[1] for t in tensors if t is not None and t.dim() >= 2), None)

    def mine(x):
        x = x[start:start + rows[dist.rank]]
        return x[:, :width] if x.dim() >= 2 and width is not None else x

    return tuple(mine(x) for x in out) if isinstance(out, tuple) else mine(out)


def join_empty(dist: Dist, n_tensors: int, device) -> None:
    """This rank's part of an :func:`on_global_batch` call when it has no rows (every group
    it drew was dropped): it contributes none and keeps none, so the others' gather
    completes. ``n_tensors``: the tensors the others pass (rewards, [values,] mask, KL)."""
    z = [torch.zeros(0, device=device)] + [torch.zeros(0, 1, device=device)] * (n_tensors - 1)
    on_global_batch(dist, lambda *t: t[0], *z)
