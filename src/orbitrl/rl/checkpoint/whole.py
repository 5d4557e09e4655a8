"""The whole-state format (one process): ``state.pt`` holds every tensor and scalar."""

from __future__ import annotations

import torch

from orbitrl.model.lora import lora_modules
from orbitrl.rl.checkpoint.state import restore_scalars, scalar_state, to_cpu


def capture(tr, extra: dict) -> dict:
    """Everything needed to continue the run bit for bit, copied to host memory."""
    state = {
        **scalar_state(tr, extra),
        "trainable": [p.detach() for p in tr.policy.trainable],
        "optimizer": tr.opt.state_dict(),
        "anchors": tr.anchors.state_dict(),
    }
    pending = tr.source.pending_snapshots()  # the adapter snapshots the next rollouts
    if pending:  # sample from (rollout.overlap)

        mods = list(lora_modules(tr.model).values())
        state["overlap_snapshots"] = {k: (v, [view[id(m)] for m in mods])
                                      for k, (v, view) in pending.items()}
    return to_cpu(state)


def restore(tr, state: dict):
    with torch.no_grad():
        for p, s in zip(tr.policy.trainable, state["trainable"]):
            p.copy_(s.to(p.device))
    tr.opt.load_state_dict(state["optimizer"])
    restore_scalars(tr, state)
    tr.anchors.load_state_dict(state["anchors"])
    if tr.snapshot is not None:
        tr.snapshot.save()
    if state.get("overlap_snapshots"):
        mods = list(lora_modules(tr.model).values())
        dev = tr.policy.trainable[0].device
        tr.source.resume_snapshots = {
            k: (v, {id(m): tuple(t.to(dev) for t in ab) for m, ab in zip(mods, views)})
            for k, (v, views) in state["overlap_snapshots"].items()}
