"""Stability guards: a gradient-norm heartbeat and a last-good snapshot of trainable state.

A step whose global gradient norm exceeds ``factor`` times the running mean of recent good
norms (after a short warm-up), or whose loss/gradients are not finite, is skipped. The check
runs after backward and before anything is applied (adapters: before ``opt.step``; the fused
full-parameter path with two passes: between them), so the weights and optimizer moments stay
the last good state and nothing has to be restored; the step's gradients are dropped. The
fused path with one pass (the full-mode default) can only ask after each tensor with the
norm so far and stop there: the tensors updated before the stop keep their
(grouped-normalized) update, and no snapshot of the full weights is kept to undo it (see
``orbitrl.train.optim``). Per-layer running statistics are kept so the layer that spiked can
be named in the metrics.
``Snapshot`` keeps the adapters as of the last applied step, to measure each update's size.
"""

from __future__ import annotations

import math

import torch

from orbitrl.model.dtensor import local


class GradNormGuard:
    def __init__(self, factor: float = 5.0, warmup: int = 5, beta: float = 0.9):
        self.factor, self.warmup, self.beta = factor, warmup, beta
        self.mean: float | None = None
        self.count = 0
        self.layer_mean: dict[str, float] = {}
        self.skipped_spike = 0
        self.skipped_nonfinite = 0

    def ok(self, norm: float) -> bool:
        """Whether a step with this global gradient norm may be applied."""
        if not math.isfinite(norm):
            self.skipped_nonfinite += 1
            return False
        if self.count >= self.warmup and self.mean is not None and \
                norm > self.factor * self.mean:
            self.skipped_spike += 1
            return False
        return True

    def accept(self, norm: float, layer_norms: dict[str, float] | None = None):
        """Fold an applied step's norms into the running statistics."""
        self.mean = norm if self.mean is None else self.beta * self.mean + (1 - self.beta) * norm
        self.count += 1
        for k, v in (layer_norms or {}).items():
            m = self.layer_mean.get(k)
            self.layer_mean[k] = v if m is None else self.beta * m + (1 - self.beta) * v

    def worst_layer(self, layer_norms: dict[str, float]) -> tuple[str, float]:
        """The layer whose norm is furthest above its own running mean (name, ratio)."""
        best, ratio = "", 0.0
        for k, v in layer_norms.items():
            r = v / max(self.layer_mean.get(k, v), 1e-12)
            if r > ratio:
                best, ratio = k, r
        return best, ratio

    def state_dict(self):
        return dict(mean=self.mean, count=self.count, layer_mean=self.layer_mean,
                    skipped_spike=self.skipped_spike, skipped_nonfinite=self.skipped_nonfinite)

    def load_state_dict(self, sd):
        self.__dict__.update(sd)


def layer_grad_norms(named_params, reduce=None) -> dict[str, float]:
    """Gradient norm per decoder layer (``model.layers.N``) and for the rest.

    ``reduce``: an in-place sum over ranks, when the gradients are sharded (each rank then
    sums the squares of its shards and the per-layer sums are reduced in one call)."""
    keys, sums = [], []
    for name, p in named_params:
        if p.grad is None:
            continue
        parts = name.split(".")
        keys.append(".".join(parts[:3]) if name.startswith("model.layers.") else parts[0])
        sums.append(local(p.grad).detach().float().pow(2).sum())
    acc: dict[str, float] = {}
    # one host sync for all parameters; summed per layer in the same order as one by one
    for key, v in zip(keys, torch.stack(sums).tolist() if sums else []):
        acc[key] = acc.get(key, 0.0) + v
    if reduce is not None and acc:
        keys = sorted(acc)
        vec = reduce(torch.tensor([acc[k] for k in keys], dtype=torch.float64))
        acc = dict(zip(keys, vec.tolist()))
    return {k: math.sqrt(v) for k, v in acc.items()}


class Snapshot:
    """Copy of a list of tensors (the trainable adapters) as of the last applied step."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.saved = [p.detach().clone() for p in params]

    def save(self):
        for s, p in zip(self.saved, self.params):
            s.copy_(p.detach())

    @torch.no_grad()
    def update_size(self, reduce=None) -> dict:
        """Norm of the change since the last save, absolute and relative to the weights
        (``reduce``: an in-place sum over ranks when the tensors are shards)."""
        n = len(self.saved)
        per = torch.stack([(local(p).detach() - local(s)).float().pow(2).sum()
                           for s, p in zip(self.saved, self.params)]
                          + [local(s).float().pow(2).sum() for s in self.saved]).tolist() \
            if n else []
        # one host sync; each total summed in float64 in the same order as one by one
        sq = torch.tensor([sum(per[:n]), sum(per[n:])], dtype=torch.float64)
        if reduce is not None:
            sq = reduce(sq)
        d, w = math.sqrt(sq[0]), math.sqrt(sq[1])
        return {"update_norm": d, "update_rel": d / max(w, 1e-12)}
