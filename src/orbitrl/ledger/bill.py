"""The per-device memory bill of one RL step: terms by role, phase and tier.

A term is keyed ``"role:item"`` so the planner can total it per role (actor, critic,
reference, reward, rollout_kv, activations, comm_buffers). Everything here is per device,
in bytes, for the busiest device (shards are rounded up). Device terms are split by phase
(rollout, score, train) because colocated phases do not overlap in time: the KV pool is
released before training, activations of training do not exist while decoding. Host terms
hold for the whole step.

Layouts: training shards model state ZeRO-3 style over ``devices`` (tensor parallel ``tp``
inside a node, data parallel ``devices / tp`` across), gathering one layer at a time plus
``prefetch_depth`` layers ahead. Generation runs the same one copy re-laid out as one
tp x pp instance over the pool, weights resident (no per-token gathers). A frozen adapter
base may instead be replicated (``replicate_base``): each tp group holds a whole copy split
only by tp, nothing is gathered, and each tp group generates on its own.

Rollout KV: ``kv_blocks`` (whole blocks, summed over the cluster) when the planner has sized
the pool; otherwise the workload's reserve (its fixed ``rollout_seqs``, or the elastic
minimum of ``min_rollout_seqs`` max-length sequences per device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from orbitrl.ledger.memory import (PARAM_BYTES, StateBytes, Strategy, Workload, activation_bytes,
                                   forward_bytes, kv_block_bytes, logits_bytes, state_bytes)
from orbitrl.ledger.models import ModelShape, from_config

PHASES = ("rollout", "score", "train")
ROLES = ("actor", "critic", "reference", "reward", "rollout_kv", "activations", "comm_buffers")


@dataclass(frozen=True)
class RoleOptions:
    """Which roles exist and where the frozen ones live.

    Args:
        reference: ``host`` (quantized, pulled layer by layer), ``device`` (sharded, resident)
            or ``none`` (no KL term). With the adapter strategy the reference is the base
            with adapters switched off: no bytes of its own.
        ref_dtype: storage of a separate reference (int8 by default).
        reward_params: parameters of a reward model; 0 for rule-based verifiers.
        reward_dtype, reward_tier: its storage and tier (``device`` or ``host``).
        critic: PPO's value model, the policy's shape, trained like the policy.
        offload: 0 none, 1 master weights and optimizer moments on the host, 2 also every
            weight shard (cold layers on the host, prefetched into the gather buffers).
    """

    reference: str = "host"
    ref_dtype: str = "int8"
    reward_params: int = 0
    reward_dtype: str = "bf16"
    reward_tier: str = "device"
    critic: bool = False
    offload: int = 0


def _shard(nbytes: float, n: int) -> int:
    return int(math.ceil(nbytes / n))


def _frozen_terms(role: str, params: int, dtype: str, tier: str, layers: int, n: int, tp: int,
                  depth: int, phases: dict, host: dict, whole: int | None = None) -> None:
    """A frozen model used for scoring: resident shard on device, or on the host with layers pulled."""
    if params <= 0 or tier == "none":
        return
    whole = whole if whole is not None else params * PARAM_BYTES[dtype]
    layer = whole / layers
    if tier == "device":
        for p in PHASES:
            phases[p][f"{role}:weights"] = _shard(whole, n)
        if n // tp > 1:
            phases["score"][f"{role}:gather"] = int((depth + 1) * layer / tp)
    else:
        host[f"{role}:weights"] = _shard(whole, n)
        phases["score"][f"{role}:layers"] = int((max(depth, 1) + 1) * layer / tp)


def phase_terms(shape: ModelShape, strategy: Strategy, work: Workload, devices: int = 1,
                prefetch_depth: int = 0, tp: int = 1, roles: RoleOptions | None = None,
                with_host: bool = False, replicate_base: bool = False,
                kv_blocks: int | None = None) -> dict:
    """Per-device bytes ``{phase: {"role:item": B}}`` (and ``"host"`` when ``with_host``).

    ``replicate_base`` (adapter strategy, no weight offload): the frozen base is held per tp
    group (``1/tp`` of it on each device) and never gathered. ``kv_blocks``: the KV pool in
    whole blocks over the cluster (default: the workload's reserve, see the module doc).
    """
    roles = roles or RoleOptions()
    n = devices
    phases: dict[str, dict[str, int]] = {p: {} for p in PHASES}
    host: dict[str, int] = {}
    st = state_bytes(shape, strategy)
    layer_w = shape.gathered_layer_params * strategy.bytes_per_param()
    replicated = replicate_base and strategy.kind == "adapter" and roles.offload < 2
    # dp == 1: tp shards stay resident, nothing gathered; a replicated base is never gathered
    gathers = (n // tp > 1 and not replicated) or roles.offload >= 2
    adapter = shape.adapter_params(strategy.adapter_rank) if strategy.kind == "adapter" else 0

    # actor (and critic, the same bill) model state
    actors = ["actor"] + (["critic"] if roles.critic else [])
    for role in actors:
        cst = st
        if role == "critic" and strategy.kind == "adapter":  # own adapter + value head, shared base
            a = shape.adapter_params(strategy.adapter_rank)
            cst = StateBytes(weights=2 * a, grads=2 * a, master=4 * a, optimizer=8 * a, layer_grad=0)
        w, opt = cst.weights, cst.master + cst.optimizer
        for p in PHASES:
            if roles.offload >= 2:
                host[f"{role}:weights"] = _shard(w, n)
            elif replicated and role == "actor":  # base per tp group, adapters sharded
                phases[p][f"{role}:weights"] = _shard(w - 2 * adapter, tp) + _shard(2 * adapter, n)
            else:
                phases[p][f"{role}:weights"] = _shard(w, n)
            if roles.offload >= 1:
                host[f"{role}:optimizer"] = _shard(opt, n)
            elif opt:
                phases[p][f"{role}:optimizer"] = _shard(opt, n)
        if cst.grads:
            phases["train"][f"{role}:grads"] = _shard(cst.grads, n)
        if cst.layer_grad:
            phases["train"][f"{role}:layer_grad"] = int(cst.layer_grad / tp)
        if gathers:
            buf = int((prefetch_depth + 1) * layer_w / tp)
            phases["train"]["comm_buffers:gather"] = buf * len(actors)
            phases["score"]["comm_buffers:gather"] = buf * len(actors)

    # frozen roles
    ref_tier = "none" if strategy.kind == "adapter" else roles.reference
    _frozen_terms("reference", shape.total_params, roles.ref_dtype, ref_tier, shape.num_layers,
                  n, tp, prefetch_depth, phases, host,
                  whole=strategy.frozen_bytes(shape, roles.ref_dtype))
    _frozen_terms("reward", roles.reward_params, roles.reward_dtype, roles.reward_tier,
                  shape.num_layers, n, tp, prefetch_depth, phases, host)

    # rollout: KV pool, decode activations and logits for this device's slots
    per_seq = work.blocks_per_seq
    blocks = kv_blocks if kv_blocks is not None else work.kv_reserve_seqs(n) * per_seq
    concurrent = max(1, min(blocks // per_seq, work.kv_need_seqs()))
    seqs = math.ceil(concurrent / n)
    phases["rollout"]["rollout_kv:blocks"] = _shard(
        blocks * kv_block_bytes(shape, work.kv_dtype, work.block_size), n)
    phases["rollout"]["activations:decode"] = forward_bytes(shape, seqs, 1, work.act_bytes)
    phases["rollout"]["activations:logits"] = logits_bytes(shape, seqs, seqs, grad=False)
    if gathers and roles.offload >= 2:
        phases["rollout"]["comm_buffers:gather"] = int((prefetch_depth + 1) * layer_w / tp)

    # score and train: activations of one micro batch
    tokens = work.micro_positions
    phases["score"]["activations:forward"] = forward_bytes(shape, tokens, tp, work.act_bytes)
    phases["score"]["activations:logits"] = logits_bytes(shape, tokens, work.logit_chunk, False)
    phases["train"]["activations:saved"] = activation_bytes(shape, tokens, work.recompute, tp,
                                                           work.act_bytes, work.fp64_attention)
    # a layer's backward holds the gradients of its activations beside what is saved:
    # about one layer's set (SmolLM2, 350 positions: a forward + backward peaked 545 MiB
    # over the weights against 500 saved + 23 of logits tiles)
    phases["train"]["activations:backward"] = forward_bytes(shape, tokens, tp, work.act_bytes)
    phases["train"]["activations:logits"] = logits_bytes(shape, tokens, work.logit_chunk, True)
    if with_host:
        phases["host"] = host
    return phases


def role_totals(terms: dict) -> dict[str, dict[str, int]]:
    """``{role: {"device": B, "host": B, "disk": B}}`` per device.

    ``device`` is the role's footprint in its own largest phase (roles peak in different
    phases, so these do not add up to the device peak); ``host`` holds for the whole step.
    """
    out = {r: {"device": 0, "host": 0, "disk": 0} for r in ROLES}
    for r in ROLES:
        out[r]["device"] = max(sum(b for k, b in terms[p].items() if k.split(":")[0] == r)
                               for p in PHASES)
    for key, b in terms.get("host", {}).items():
        out[key.split(":")[0]]["host"] += b
    return out


def predict_peak(model, strategy: Strategy | str, workload: Workload | None = None,
                 devices: int = 1, prefetch_depth: int = 0, kv_blocks: int | None = None) -> dict:
    """Per-phase peak bytes on one device: what the runtime compares to its measured peak.

    Args:
        model: a :class:`ModelShape` or a Hugging Face ``config.json`` dict.
        strategy: a :class:`Strategy` or its kind (``adamw``, ``stateless``, ``adapter``).
            For an int4 base pass the group the runtime quantized with (``int4_group``).
        workload: the batch shape: ``rollout_seqs`` counts sequences decoding at once on this
            device set (left ``None``, the KV term is the elastic minimum,
            ``min_rollout_seqs`` per device), ``micro_batch`` the sequences per
            forward/backward (0 counts as 1).
        devices: devices the state is sharded over (1 for a single-process CPU run).
        prefetch_depth: layers gathered ahead (0: nothing gathered on one device).
        kv_blocks: the KV pool the engine actually allocated, in whole blocks of
            ``workload.block_size`` tokens (overrides the count from ``rollout_seqs``).
    Returns:
        ``{"rollout": B, "score": B, "train": B, "peak": B, "terms": {phase: {term: B}}}``.
    """
    shape = model if isinstance(model, ModelShape) else from_config(model)
    strat = strategy if isinstance(strategy, Strategy) else Strategy(strategy)
    terms = phase_terms(shape, strat, workload or Workload(), devices=devices,
                        prefetch_depth=prefetch_depth, kv_blocks=kv_blocks)
    out = {phase: sum(t.values()) for phase, t in terms.items()}
    out["peak"] = max(out.values())
    out["terms"] = terms
    return out
