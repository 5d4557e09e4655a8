"""Weights sharded with FSDP2: one ``fully_shard`` per decoder layer, then the root.

What is sharded (dim 0, ``torch.chunk`` over the ranks) is every *parameter*: the trained
weights in full mode, the LoRA adapters, and a frozen base kept in plain fp32 parameters.
A frozen base stored by :class:`orbitrl.model.quant.FrozenLinear` (bf16, int8, nf4, int4)
lives in module *buffers*, which FSDP2 does not shard: it stays replicated on every rank
(``docs/distributed.md`` says why). The full-parameter mode's int8 reference is a separate
host-resident model and stays replicated too.

Gradients are *summed* over ranks (FSDP2's default is the mean): the loss is normalised by
the global token or sample count, so the summed gradient is exactly the one-process
gradient of the same global batch. gloo has no pre-multiplied sum, so the divide factor 1
is applied with a plain SUM (``set_force_sum_reduction_for_comms``).

Every forward of a sharded model is a collective (each layer is all-gathered), so all ranks
must run the same number of forwards. Training pads the micro-batch count with
:func:`idle_backward`; generation and scoring, whose forward counts depend on the samples,
run inside :func:`lockstep`.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn

from orbitrl.distributed.env import Dist


def fsdp_modules(model: nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule  # start-up: ~1 s import, sharded runs only

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def shard_model(model: nn.Module, dist: Dist, reshard_after_forward: bool = True,
                prefetch_layers: int = 1) -> None:
    """``fully_shard`` each decoder layer, then the root (embeddings, final norm, head).

    Args:
        reshard_after_forward: free each layer's gathered weights after its forward (the
            backward gathers them again); False keeps them until backward ends.
        prefetch_layers: k >= 1 issues the all-gathers of the next k layers (forward) or the
            previous k (backward) while the current one computes, so k layers are in flight
            or gathered beside it (the design's two: ``dist.prefetch_layers: 2``); 0 gathers
            on demand.
    """
    from torch.distributed.device_mesh import (  # start-up: ~1 s import, sharded runs only
        DeviceMesh, init_device_mesh)
    from torch.distributed.fsdp import fully_shard  # start-up: ~1 s import, sharded runs only

    dev = "cuda" if dist.backend == "nccl" else "cpu"
    # a training pool beside rollout ranks shards over its own group only
    mesh = init_device_mesh(dev, (dist.world,)) if dist.group is None else \
        DeviceMesh.from_group(dist.group, dev)
    head = model.lm_head.weight
    if not head.is_contiguous():  # undo Decoder.head_column_major: shards split rows
        head.data = head.data.contiguous()
    layers = list(model.model.layers)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    # the root (embeddings, final norm, head) stays gathered from its forward until the
    # step's phase ends: the engine and the chunked logprobs call ``lm_head`` outside the
    # root's forward
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    for m in fsdp_modules(model):
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)
    if prefetch_layers:
        # layer i asks for i+1 .. i+k (backward: i-1 .. i-k, nearest first); a layer
        # already gathered by an earlier ask is not gathered again
        k = prefetch_layers
        for i, layer in enumerate(layers):
            if i + 1 < len(layers):
                layer.set_modules_to_forward_prefetch(layers[i + 1:i + 1 + k])
            if i > 0:
                layer.set_modules_to_backward_prefetch(layers[max(0, i - k):i][::-1])


def shard_policy(policy, dist: Dist, cfg) -> None:
    """Shard ``policy.model`` in place and point ``policy.trainable`` at the sharded
    parameters (``fully_shard`` replaces each parameter by a DTensor one), in the same order."""
    model = policy.model
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    order = [names[id(p)] for p in policy.trainable]
    shard_model(model, dist, cfg.dist.reshard_after_forward, cfg.dist.prefetch_layers)
    params = dict(model.named_parameters(remove_duplicate=False))
    policy.trainable = [params[n] for n in order]


def reshard(model: nn.Module) -> None:
    """Free gathered weights (the root keeps its own after a forward until told)."""
    for m in fsdp_modules(model):
        m.reshard()


def is_sharded(model: nn.Module) -> bool:
    return bool(fsdp_modules(model))


def _idle_ids(model) -> torch.Tensor:
    return torch.zeros(1, 1, dtype=torch.long, device=model.device)


@torch.no_grad()
def idle_forward(model: nn.Module) -> None:
    """One forward over a single token: this rank's share of a collective forward whose
    own work has run out (its gathers match the other ranks')."""
    model(_idle_ids(model), return_hidden=True)  # (the head is in the root: no collective)


def idle_backward(model: nn.Module) -> torch.Tensor:
    """Forward + backward with a zero loss that touches every trainable parameter (the head
    included), so this rank joins each layer's all-gather and reduce-scatter while adding
    nothing to the summed gradient. Returns the (zero) loss."""
    h = model(_idle_ids(model), return_hidden=True)
    loss = model.lm_head(h).float().sum() * 0.0
    loss.backward()
    return loss


@contextmanager
def lockstep(model: nn.Module, dist: Dist):
    """Run a data-dependent number of forwards (generation, scoring) on every rank.

    Each forward of the sharded model is preceded by a one-number all-reduce: "I still have
    work". A rank whose own work is done keeps answering with idle forwards until every
    rank is done, so all ranks issue the same gathers in the same order. A no-op with one
    process or an unsharded model.
    """
    if not dist.enabled or not is_sharded(model):
        yield
        return
    state = {"idle": False}
    one = torch.ones(1, dtype=torch.float64, device=dist.comm_device)

    def pre(_mod, _args):
        if not state["idle"]:  # a tensor, not a number: no host sync per decode step
            dist.all_sum(one.fill_(1.0))

    # prepend: run before FSDP's own pre-forward (the root's all-gather)
    handle = model.register_forward_pre_hook(pre, prepend=True)
    ok = False
    try:
        yield
        ok = True
    finally:
        state["idle"] = True
        try:
            if ok:  # after an error the other ranks fail on the timeout instead
                while dist.all_sum(0.0) > 0:
                    idle_forward(model)
                reshard(model)
        finally:
            handle.remove()


@contextmanager
def rollout_weights(model: nn.Module, dist: Dist, mode: str = "sharded",
                    reshard_after_forward: bool = True):
    """The weights generation runs on (``dist.rollout_weights``).

    ``sharded``: each forward gathers layer by layer, in :func:`lockstep`; a rank holds its
    shard plus the layers in flight. ``gathered``: every layer is all-gathered once at the
    start and kept until the block ends, so decoding issues no collectives and ranks need
    not keep pace (a rank holds the whole weights for the phase).
    """
    if not dist.enabled or not is_sharded(model) or mode == "sharded":
        with lockstep(model, dist):
            yield
        return
    mods = fsdp_modules(model)
    for m in mods:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        with gathered(model):
            yield
    finally:
        for m in mods:
            m.set_reshard_after_forward(reshard_after_forward and m is not model,
                                        recurse=False)


@contextmanager
def gathered(model: nn.Module):
    """Every parameter whole on every rank for the block (export of a full model)."""
    mods = fsdp_modules(model)
    for m in mods:
        m.unshard()
    try:
        yield model
    finally:
        for m in mods:
            m.reshard()


def sum_grads(params, dist: Dist) -> None:
    """Sum the gradients of replicated (unsharded) parameters over ranks (PPO's value head)."""
    if not dist.enabled:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_sum(p.grad)

