"""One orbitrl run as the ledger sees it: the one translation from a ``Config`` to the
ledger's inputs (``RunSpec.from_config``), and what the runtime asks of the ledger with it:
the per-phase prediction written beside the measured peak (:func:`runtime_prediction`) and
the KV pool the engine allocates from the memory training leaves (:func:`kv_pool_for_run`).

The planner (``plan.py``) prices hypothetical clusters from the same ``bill.phase_terms``;
this module adds what only a real orbitrl process holds (its KV pool resident in every
phase, the fused update's workspace per tensor, dequantization workspaces, tiers, FSDP2's
per-rank layout).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from orbitrl.errors import OrbitError
from orbitrl.ledger.bill import RoleOptions, phase_terms
from orbitrl.ledger.kv import blocks_for_tokens
from orbitrl.ledger.memory import (DEQUANT_WORKSPACE, EXACT_ROWS, LOGIT_VOCAB_CHUNK,
                                   PARAM_BYTES, Strategy,
                                   Workload, activation_bytes, cap_micro_positions,
                                   largest_projection_params,
                                   largest_tensor_params, projection_params, row_bucket,
                                   state_bytes)
from orbitrl.ledger.models import ModelShape, from_config


def engine_kv_dtype(kv_dtype: str) -> str | None:
    """``rollout.kv_dtype`` (or ``--kv-dtype``) as the engine and the ledger take it: "fp8",
    or None for the model's own dtype."""
    return "fp8" if kv_dtype == "fp8" else None


@dataclass(frozen=True)
class RunSpec:
    """A run's strategy, this rank's workload and its layout, as the ledger prices them.

    ``compute``: the dtype weights and activations compute in; ``optimizer``: the fused
    update's kind (read in full mode); ``tiers``: layers prefetched with ``train.tiers`` (0:
    resident); ``pulled``: the full-mode reference copied in layer by layer; ``devices``:
    ranks the weights are sharded over; ``kv_dtype``: the engine's KV dtype (None: the
    model's); ``dequant_cache``: bytes the frozen projections may take kept dequantized
    (``model.dequant_cache_mb``)."""
    strategy: Strategy
    workload: Workload
    roles: RoleOptions
    compute: str
    optimizer: str
    kv_dtype: str | None
    tiers: int
    pulled: bool
    devices: int
    device: str
    dequant_cache: int = 0
    workers: int = 1  # micro-batches scored and trained side by side (train.workers)
    micro_batch_tokens: int = 0  # train.micro_batch_tokens, or the auto choice at 0
    offload_activations: bool = False  # train.offload_activations: saved layer inputs on the host
    clip: str = "global"  # train.clip resolved (the fused update's copies: update_copies)

    @classmethod
    def from_config(cls, cfg, prompt_len: int, devices: int = 1, device: str = "cpu",
                    recompute: bool = False, shape: ModelShape | None = None,
                    workers: int = 1, positions: int = 0) -> "RunSpec":
        """Strategy from ``train.mode`` / ``train.optimizer`` / ``model.base_dtype`` /
        ``lora.rank``, weights and activations in ``model.dtype``, the workload from
        ``rollout`` and ``train.micro_batch_tokens`` (``prompt_len``: the longest prompt of
        the task, in tokens; this rank's share of the samples; 0 tokens: the
        :func:`auto_micro_batch_tokens` of ``shape`` with ``workers`` micro-batches live at
        once), tiers and the reference's placement as ``rl/policy.py`` sets them.
        ``positions``: the positions of the micro-batches live at once (every worker's), as
        a step laid them out (0: every reply at the cap)."""
        t, r = cfg.train, cfg.rollout
        recompute = recompute or forced_recompute(t)  # what rl/policy.py sets
        compute = "fp32" if cfg.model.dtype == "fp32" else "bf16"
        opt = t.optimizer if t.optimizer != "auto" else "adalomo"  # (read in full mode only)
        if t.mode == "adapter":
            # (auto unresolved, e.g. orbitrl plan: priced as the format torchrun runs use)
            fmt = "nf4" if cfg.model.base_dtype == "auto" else cfg.model.base_dtype
            base = {"fp32": compute, "bf16": "bf16"}.get(fmt, fmt)
            strat = Strategy("adapter", base_dtype=base, adapter_rank=cfg.lora.rank,
                             dense_dtype=compute)
        else:
            strat = Strategy("adamw" if opt == "adamw" else "stateless", weight_dtype=compute,
                             grad_dtype=compute, dense_dtype=compute)
        kv_dtype = engine_kv_dtype(r.kv_dtype)
        seq_len = prompt_len + r.max_tokens
        n = max(1, int(devices))
        samples = math.ceil(r.n * r.prompts_per_step / n)  # this rank's share of the step
        fp64 = fp64_attention(cfg, device)
        mb_tokens = t.micro_batch_tokens or auto_micro_batch_tokens(
            shape, strat, compute, recompute, fp64, workers, n)
        per_worker = math.ceil(samples / max(1, workers))
        # a micro-batch's positions: the step's own when given, else every reply at the cap
        # laid out as the trainer lays it (a GRPO group's prompt once where it shares it, rows
        # padded, the micro-batch filled to mb_tokens positions: rl/batch.py micro_batches)
        micro_tokens = math.ceil(positions / max(1, workers)) if positions else \
            cap_micro_positions(prompt_len, r.max_tokens, r.n, per_worker, mb_tokens)
        work = Workload(prompt_len=prompt_len, completion_len=r.max_tokens,
                        # rl/parallel.py split_parts: at least one micro-batch per worker
                        micro_batch=max(1, min(per_worker, mb_tokens // seq_len)),
                        samples_per_step=samples, block_size=r.block_size,
                        kv_dtype=kv_dtype or compute, recompute=recompute,
                        act_bytes=int(PARAM_BYTES[compute]), fp64_attention=fp64,
                        group_size=r.n, micro_tokens=micro_tokens)
        tiers = t.tiers if n == 1 and t.mode == "full" else 0
        pulled = t.mode == "full" and n == 1 and (device == "cuda" or tiers > 0)
        roles = RoleOptions(reference="host" if t.mode == "full" and reference_needed(cfg)
                            else "none",
                            offload=2 if tiers else 0,
                            critic=cfg.algo.name == "ppo" and cfg.critic.kind == "model")
        return cls(strat, work, roles, compute, opt, kv_dtype, tiers, pulled, n, device,
                   cfg.model.dequant_cache_mb << 20, max(1, workers), int(mb_tokens),
                   bool(t.offload_activations), resolved_clip(t))


def fp64_attention(cfg, device: str) -> bool:
    """fp32 attention computed in fp64 (``model.attention_fp64``, CPUs only): its saved
    q, k, v are fp64."""
    return bool(getattr(cfg.model, "attention_fp64", False)) and cfg.model.dtype == "fp32" \
        and device != "cuda"


AUTO_MICRO_BATCH_CAP = 4096  # tokens: auto never cuts coarser than the earlier fixed default
ACTIVATION_FLOOR = 256 << 20  # bytes a micro-batch may always save, whatever the weights


def auto_micro_batch_tokens(shape: ModelShape | None, strategy: Strategy, compute: str,
                            recompute: bool, fp64: bool, workers: int = 1,
                            devices: int = 1) -> int:
    """``train.micro_batch_tokens: 0``: the tokens per micro-batch whose saved activations
    stay within the bytes of the weights this rank holds (at least ACTIVATION_FLOOR), shared
    by the ``workers`` micro-batches live at once, at most AUTO_MICRO_BATCH_CAP. Adapter mode
    only: in full mode every micro-batch is an optimizer step of its own (the cap there).

    Why this budget: a step's peak is weights + saved activations + the rest, and beyond a
    few hundred tokens per micro-batch a CPU's or GPU's GEMMs gain little from more rows, so
    cutting the batch finer costs little time (a Python loop per micro-batch) and keeps the
    activations from dominating the bill (SmolLM2-135M, 32 samples of 56 tokens in one
    micro-batch: 2.5 GB saved against 0.5 GB of weights). Without ``shape`` (no model at
    hand): the cap."""
    if shape is None or strategy.kind != "adapter":
        # full mode's fused update steps once per micro-batch (lr / k each, train/optim.py):
        # cut into ~11 micro-batches, SmolLM2's stateless full mode fell from 0.21 held-out to
        # 0.07 in 600 s where one micro-batch per worker learns; until accumulation that
        # keeps the step's dynamics is measured, full mode keeps the coarse cut
        return AUTO_MICRO_BATCH_CAP
    if strategy.kind == "adapter":
        weights = projection_params(shape) * strategy.bytes_per_param() + \
            (shape.total_params - projection_params(shape)) * PARAM_BYTES[compute]
    else:
        weights = shape.total_params * strategy.bytes_per_param() / max(1, devices)
    per_token = activation_bytes(shape, 1, recompute, 1, int(PARAM_BYTES[compute]),
                                 fp64_attention=fp64)
    budget = max(int(weights), ACTIVATION_FLOOR) // max(1, workers)
    return int(max(1, min(AUTO_MICRO_BATCH_CAP, budget // max(1, per_token))))


BASE_SHARE = 0.25  # model.base_dtype auto: the predicted peak may take this much of the memory free


def choose_base_dtype(cfg, hf_config: dict, prompt_len: int, device: str,
                      available: int) -> str:
    """``model.base_dtype: auto`` for adapter mode: the widest frozen-base format, of the
    compute dtype (fp32 on CPUs, bf16 on GPUs), int8, nf4mix and nf4, whose predicted peak
    (:func:`runtime_prediction` for this run's shapes) stays within BASE_SHARE of the
    ``available`` bytes, else nf4. A quantized base costs quality (SmolLM2-135M under NF4:
    0.09 held-out against 0.22 in fp32 before training, and it learned less in the same
    time), so it is used when memory asks for it, not by default. Full mode trains its own
    weights in the compute dtype: the compute dtype."""
    wide = "fp32" if cfg.model.dtype == "fp32" else "bf16"
    if cfg.train.mode != "adapter":
        return wide
    for fmt in (wide, "int8", "nf4mix", "nf4"):
        trial = copy.deepcopy(cfg)
        trial.model.base_dtype = fmt
        if runtime_prediction(trial, hf_config, prompt_len, device=device)["peak"] \
                <= BASE_SHARE * available:
            return fmt
    return "nf4"


def reference_needed(cfg) -> bool:
    """Whether a run computes reference logprobs at all: a KL term in the loss or in the
    reward (``algo.kl_coef > 0`` or ``algo.kl_in_reward``). Without one, full mode loads no
    int8 reference copy (rl/policy.py) and the ledger prices none."""
    return cfg.algo.kl_coef > 0 or bool(cfg.algo.kl_in_reward)


def forced_recompute(train) -> bool:
    """Recomputation the ``train`` keys demand whatever the ledger prices:
    ``train.recompute: true``, or ``train.tiers`` / ``train.offload_activations``, which
    work on the layer inputs recomputation keeps."""
    return train.recompute is True or train.tiers > 0 or bool(train.offload_activations)


def resolve_recompute(cfg, hf_config: dict, prompt_len: int, device: str = "cpu",
                      devices: int = 1) -> bool:
    """``train.recompute`` as the run applies it: :func:`forced_recompute`, else false as
    set; ``auto``: adapter mode off (``auto_micro_batch_tokens`` cuts the batch instead:
    finer micro-batches cost little), full mode on when one micro-batch's saved activations
    (``samples x (prompt_len + max_tokens)`` tokens up to the micro-batch cap) would exceed
    the bytes of the weights this rank holds (at least ACTIVATION_FLOOR). Full mode cannot
    cut the batch finer without changing the step (its fused update steps per micro-batch),
    and recomputing costs one forward of the batch, about what dropping the separate
    old-logprob pass saves (``Scorer.old_from_update``). SmolLM2-135M, 32 samples x 63
    tokens: 3.5 GB saved without recompute against 0.54 GB of weights: on."""
    t = cfg.train
    if forced_recompute(t) or t.recompute is False:
        return forced_recompute(t)
    if t.mode != "full":  # auto
        return False
    shape = from_config(hf_config)
    spec = RunSpec.from_config(cfg, prompt_len, devices, device, False, shape)
    work = spec.workload
    saved = activation_bytes(shape, work.micro_tokens, False, 1, int(PARAM_BYTES[spec.compute]),
                             fp64_attention=work.fp64_attention)
    weights = shape.total_params * spec.strategy.bytes_per_param() / spec.devices
    return saved > max(int(weights), ACTIVATION_FLOOR)


def micro_batch_tokens(cfg, hf_config: dict, device: str = "cpu", recompute: bool = False,
                       workers: int = 1, devices: int = 1) -> int:
    """The tokens per micro-batch a run cuts its batch into (rl/score.py): the key, or at 0
    the :func:`auto_micro_batch_tokens` the prediction prices."""
    if cfg.train.micro_batch_tokens:
        return int(cfg.train.micro_batch_tokens)
    return RunSpec.from_config(cfg, 0, devices, device, recompute, from_config(hf_config),
                               workers).micro_batch_tokens


# what oneDNN keeps per product shape it has run, a weight's shape at one row count: its
# cached primitive and the kernels behind it, never given back (measured: 64 row counts
# of four SmolLM2 weight shapes, +159.7 MiB; +149.7 MiB with AVX2 only)
ONEDNN_PRIMITIVE_BYTES = int(0.62 * 2**20)
# row counts a step's prefill chunks and training micro-batches add beside a rollout's
# decode rows: their rows are padded to model/gemm.py row_bucket's counts, and a step's
# fall within a few of them (SmolLM2 example, three steps: 2-3 per weight shape)
ONEDNN_STEP_BUCKETS = 4


def routed_shapes(shape: ModelShape, adapter_rank: int = 0) -> int:
    """Distinct weight shapes the packed rollouts and the trainer multiply on oneDNN
    (model/gemm.py, engine/packed.py: packed or over the plain weight): a decoder layer's
    projections (q, k and v, o, gate and up, down) and the head, and with adapters (all
    linear layers) LoRA's A (one per input width) and B (one per output width)."""
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    h, inter = shape.hidden, shape.intermediate
    outs_ins = {(q, h), (kv, h), (h, q), (inter, h), (h, inter)}
    n = len(outs_ins | {(shape.vocab, h)})
    if adapter_rank:
        n += len({i for _, i in outs_ins}) + len({o for o, _ in outs_ins})
    return n


def onednn_state_bytes(shape: ModelShape, adapter_rank: int, rows: int) -> int:
    """What oneDNN holds once a run's packed rollouts and routed training GEMMs have run:
    every routed weight shape at every decode row count of a rollout (its ``rows`` sequences
    finish one by one, so each count from ``rows`` down to 1 appears; counts past 64 are
    bucketed) and at a few padded row counts of prefill and training (where the head
    runs in vocabulary tiles, their shapes too). A bound the run
    approaches as its steps go on (the SmolLM2 example, 16 rows, 9 shapes before its head
    ran on oneDNN: 171 products after the held-out evaluation and the first rollout, 207
    after three steps, 180 priced; the evaluation's own row counts are not)."""
    decode = min(rows, EXACT_ROWS) + len({row_bucket(m) for m in range(EXACT_ROWS + 1,
                                                                       rows + 1)})
    # the trainer multiplies a vocabulary past one logprob tile tile by tile
    # (train/logprobs.py): one more shape, two when the last tile is narrower
    v, h = shape.vocab, shape.hidden
    tiles = len({(LOGIT_VOCAB_CHUNK, h), (v % LOGIT_VOCAB_CHUNK or LOGIT_VOCAB_CHUNK, h)}) \
        if v > LOGIT_VOCAB_CHUNK else 0
    return ONEDNN_PRIMITIVE_BYTES * (routed_shapes(shape, adapter_rank) * (
        decode + ONEDNN_STEP_BUCKETS) + tiles * ONEDNN_STEP_BUCKETS)


def runtime_prediction(cfg, hf_config: dict, prompt_len: int, kv_blocks: int | None = None,
                       device: str = "cpu", recompute: bool = False, devices: int = 1,
                       workers: int = 1, packed_bytes: int = 0,
                       packing_workspace: int = 0, positions: int = 0) -> dict:
    """The ledger's per-phase peak bytes for one orbitrl run (``orbitrl.config.Config``) on
    one device (one rank of ``devices``), its KV pool as the engine allocated it.

    On a CPU device the host tier is the same memory, so host terms (the full-parameter
    mode's int8 reference) are added to every phase. ``devices > 1``: one rank of a
    torchrun run, see :func:`sharded_runtime_terms`.

    Tiers (``rl/policy.py``), on one process: the full-mode reference on a CUDA device, or
    any reference with ``train.tiers``, holds its embeddings, final norm and head on the
    device and pulls its int8 layers one at a time with ``k`` prefetched (``train.tiers``
    or 2): ``1 + k`` layers in scoring. ``train.tiers: k`` keeps the policy's layers in
    host memory (the ledger's weight offload) with ``1 + k`` layers on the device in
    generation and scoring; in training ``k`` while the head updates, ``2 + k`` during a
    layer's backward (one whose updates are still landing); tiers imply recompute.

    ``packed_bytes``: the rollout engine's oneDNN-packed weight copies
    (``rollout.packed_weights``, engine/packed.py), made for each rollout and freed after
    it, with ``packing_workspace`` (the largest unit's staging while it is packed): a
    rollout-phase term, and :func:`onednn_state_bytes` in every phase.

    ``positions``: the scoring and training activations priced for micro-batches that hold
    this many positions at once over the ``workers`` (a step's own layout, ``rl/batch.py
    positions``) instead of every reply at the cap: the prediction at a step's shape
    (``observe/memory.py``).

    Returns:
        ``{"rollout": B, "score": B, "train": B, "peak": B, "terms": {phase: {term: B}}}``.
    """
    shape = from_config(hf_config)
    spec = RunSpec.from_config(cfg, prompt_len, devices, device, recompute, shape, workers,
                               positions)
    terms = phase_terms(shape, spec.strategy, spec.workload, kv_blocks=kv_blocks,
                        roles=spec.roles, with_host=True,
                        prefetch_depth=(spec.tiers or 2) if spec.pulled else 0)
    host = terms.pop("host")
    _runtime_terms(terms, host, shape, spec)
    if spec.roles.critic:
        critic_terms(terms, shape, cfg, spec.compute, spec.devices)
    if packed_bytes:
        # the copies, and the largest unit's contiguous fp32 staging while it is reordered
        # (a column-major head or a concatenated q/k/v group: engine/packed.py)
        terms["rollout"]["actor:packed_copy"] = int(packed_bytes + packing_workspace)
        strat = spec.strategy
        state = onednn_state_bytes(shape, strat.adapter_rank if strat.kind == "adapter"
                                   else 0, spec.workload.samples_per_step)
        for ph in terms.values():  # oneDNN's state, kept from the first rollout on
            ph["actor:packed_runtime"] = state
    if spec.devices > 1:
        sharded_runtime_terms(terms, shape, spec.strategy, spec.devices,
                              PARAM_BYTES[spec.compute],
                              base_sharded=cfg.train.mode == "full"
                              or cfg.model.base_dtype == "fp32",
                              prefetch_depth=cfg.dist.prefetch_layers,
                              overlap=device == "cuda",
                              copies=update_copies(spec.optimizer, spec.clip,
                                                  spec.strategy.grad_dtype),
                              rollout_gathered=cfg.dist.rollout_weights == "gathered")
    if device != "cuda":
        for ph in terms.values():
            ph.update({f"host:{k}": b for k, b in host.items()})
    out = {phase: sum(tm.values()) for phase, tm in terms.items()}
    out["peak"] = max(out.values())
    out["terms"] = terms
    return out


def _runtime_terms(terms: dict, host: dict, shape: ModelShape, spec: RunSpec):
    """What one orbitrl process holds beyond the planner's terms, in place: tiers, the
    pulled reference's fixed weights, the resident KV pool, the fused update's workspace,
    dequantization workspaces."""
    strat, tiers, opt, compute = spec.strategy, spec.tiers, spec.optimizer, spec.compute
    if tiers:
        # training's peak is the larger of two moments: the head's fused update (the largest
        # workspace, below) while the last k layers are still hot from the forward, and a
        # layer's backward (2 + k layers hot, a projection-sized workspace)
        lw = shape.gathered_layer_params * strat.bytes_per_param()
        copies = update_copies(opt, spec.clip, strat.grad_dtype)
        ws = copies * largest_tensor_params(shape) * PARAM_BYTES[strat.grad_dtype]
        ws_layer = copies * largest_projection_params(shape) \
            * PARAM_BYTES[strat.grad_dtype]
        terms["train"]["comm_buffers:gather"] = int(
            max(tiers * lw + ws, (tiers + 2) * lw + ws_layer) - ws)
    if spec.pulled and spec.device == "cuda":  # the non-layer weights moved to the device
        fixed = int((shape.total_params - shape.num_layers * shape.layer_params) \
            * PARAM_BYTES[compute])
        host["reference:weights"] -= fixed
        for ph in terms.values():
            ph["reference:fixed"] = fixed
            if tiers:
                ph["actor:fixed"] = fixed
        if tiers:
            host["actor:weights"] -= fixed
    if spec.offload_activations and spec.device == "cuda" and spec.workload.recompute:
        # model/decoder.py ActivationOffload: every recomputed layer's saved input lives in
        # pinned host memory between forward and backward; the device keeps the layer being
        # recomputed (its full set, in activations:saved) and one input in flight
        work = spec.workload
        moved = work.act_bytes * work.micro_positions * shape.hidden * (shape.num_layers - 1)
        terms["train"]["activations:saved"] -= moved
        host["activations:offloaded"] = moved * spec.workers
    # side-by-side workers (rl/parallel.py) hold one micro-batch's activations each
    for ph, keys in (("score", ("activations:forward", "activations:logits")),
                     ("train", ("activations:saved", "activations:backward",
                                "activations:logits"))):
        for k in keys:
            if k in terms[ph]:
                terms[ph][k] *= spec.workers
    # orbitrl's engine allocates its KV pool once and keeps it: resident in every phase
    kv = terms["rollout"]["rollout_kv:blocks"]
    terms["score"]["rollout_kv:blocks"] = terms["train"]["rollout_kv:blocks"] = kv
    if strat.kind == "stateless":
        # one process, the update fused into backward per parameter (not per gathered
        # layer): the largest trained tensor's gradient plus the update's temporaries of its
        # size (train/optim.py: SGD one clipped copy; AdaLomo a clipped copy where it clips
        # globally, and g^2 or the update u, one at a time). A tied embedding is that
        # tensor's last gradient (the embedding's backward ends the pass): its head gradient
        # is held through the backward beside the saved activations; the embedding's own
        # gradient is then added to it out of place (autograd's accumulation: the two and
        # their sum, three of its size) and the update runs, after the activations are
        # freed (SmolLM2 full mode: 335 MiB above what the step holds at the end of the
        # train phase, three times its 110 MiB embedding)
        terms["train"].pop("actor:layer_grad", None)
        big = largest_tensor_params(shape) * PARAM_BYTES[strat.grad_dtype]
        update = update_copies(opt, spec.clip, strat.grad_dtype) * big
        if shape.tie_embeddings and shape.vocab * shape.hidden >= largest_tensor_params(shape):
            live = sum(terms["train"].get(f"activations:{k}", 0)
                       for k in ("saved", "backward", "logits"))
            update = max(big, max(3 * big, update) - live)
        terms["train"]["actor:update_workspace"] = int(update)
    # a frozen projection is dequantized to the compute dtype per call (forward, and again in
    # backward): the workspace of the largest projection is live on top of everything else,
    # unless all of them fit model.dequant_cache_mb in the compute dtype: then each is kept
    # dequantized after its first use (model.quant.cache_dequantized), in every phase
    proj = largest_projection_params(shape)
    kept = projection_params(shape) * PARAM_BYTES[compute]
    if strat.kind == "adapter" and strat.base_dtype != compute and kept <= spec.dequant_cache:
        for ph in terms.values():
            ph["weights:dequant_cache"] = int(kept)
    elif strat.kind == "adapter" and strat.base_dtype != compute:
        for ph in terms.values():
            ph["activations:dequant"] = int(proj * DEQUANT_WORKSPACE[strat.base_dtype])
    elif strat.kind != "adapter":  # the int8 reference scores with the same kernel
        terms["score"]["activations:dequant"] = int(proj * DEQUANT_WORKSPACE["int8"])


def critic_terms(terms: dict, shape: ModelShape, cfg, compute: str, devices: int = 1):
    """PPO's value network (``critic.kind: model``, rl/critic.py) as orbitrl builds it, in
    place of the bill's critic (the actor's strategy): fp32 adapters with their AdamW
    moments and gradients, over the policy's base when it shares it (one process, the same
    directory and format) or over a base of its own; or every weight (no output layer
    unless tied) with its optimizer's state. Its forward and backward run after the actor's
    (their activations are the actor's, freed by then): its gradients are the train phase's
    only addition."""
    c = cfg.critic
    mode = cfg.train.mode if c.mode == "auto" else c.mode
    for ph in terms.values():
        for k in [k for k in ph if k.startswith("critic:")]:
            del ph[k]
    if mode == "adapter":
        a = shape.adapter_params(cfg.lora.rank)
        fmt = cfg.model.base_dtype if c.base_dtype == "auto" else c.base_dtype
        fmt = "nf4" if fmt == "auto" else fmt
        shared = (cfg.train.mode == "adapter" and not c.path and devices == 1
                  and c.base_dtype in ("auto", cfg.model.base_dtype))
        base = 0 if shared else Strategy("adapter", base_dtype={"fp32": compute}.get(
            fmt, fmt)).frozen_bytes(shape)
        weights, opt, grads = base + 4 * a, 8 * a, 4 * a
    else:
        name = "adalomo" if c.optimizer == "auto" else c.optimizer
        st = state_bytes(shape, Strategy("adamw" if name == "adamw" else "stateless",
                                         weight_dtype=compute, grad_dtype=compute))
        head = 0 if shape.tie_embeddings else shape.vocab * shape.hidden * PARAM_BYTES[compute]
        weights, opt = int(st.weights - head), st.master + st.optimizer
        grads = st.grads or update_copies(name) * largest_tensor_params(shape) \
            * PARAM_BYTES[compute]
    for ph in terms.values():
        ph["critic:weights"] = int(weights)
        if opt:
            ph["critic:optimizer"] = int(opt)
    terms["train"]["critic:grads"] = int(grads)


def kv_pool_for_run(cfg, hf_config: dict, prompt_len: int, block_bytes: int, *,
                    available: int, resident: int, device: str = "cpu",
                    devices: int = 1) -> dict:
    """Size the engine's KV pool from the memory training leaves (``rollout.kv_budget_mb: 0``).

    ``available``: bytes free now; ``resident``: bytes of the run already loaded (weights,
    reference), which the prediction counts too. The pool gets what is left after training's
    predicted peak without a pool and ``rollout.min_available_mb``, capped at what one
    step's rollout can use (every sample at full length, no prefix sharing) and floored at
    one GRPO group at full length (below that a step cannot run: an error).

    Returns ``{"blocks", "cap", "floor", "train_need", "left"}`` (bytes and block counts).
    """
    r = cfg.rollout
    pred = runtime_prediction(cfg, hf_config, prompt_len, kv_blocks=0, device=device,
                              devices=devices)
    need = pred["peak"]
    left = available + resident - int(r.min_available_mb * 2**20) - need
    per_seq = blocks_for_tokens(prompt_len + r.max_tokens, r.block_size)
    cap = r.prompts_per_step * r.n * per_seq
    floor = r.n * per_seq
    blocks = min(cap, max(0, left) // block_bytes)
    if blocks < floor:
        raise OrbitError(
            f"rollout.kv_budget_mb: 0 (auto) leaves {max(0, left) / 2**20:.0f} MiB for the KV "
            f"pool after training's predicted {need / 2**20:.0f} MiB and rollout.min_available_mb "
            f"{r.min_available_mb:.0f}; one group of {r.n} samples needs "
            f"{floor * block_bytes / 2**20:.1f} MiB (lower rollout.min_available_mb, "
            "rollout.n or rollout.max_tokens)")
    return {"blocks": int(blocks), "cap": int(cap), "floor": int(floor), "train_need": int(need),
            "left": int(left)}


def update_copies(optimizer: str, clip: str = "global", grad_dtype: str = "fp32") -> int:
    """Tensors the size of the one being updated, alive at once inside a fused update
    (train/optim.py): its gradient plus one scaled fp32 copy (SGD: the clipped or decayed
    step), plus g^2 or the update u (AdaLomo). AdaLomo's grouped clip never scales an fp32
    gradient (its coefficient is 1, so ``g.float()`` is ``g``): the gradient and g^2 or u,
    two (measured: a 30M-parameter full run's train phase 15 MiB under the three-copy
    price, its largest tensor 12 MiB)."""
    if optimizer != "adalomo":
        return 2
    return 2 if clip == "grouped" and grad_dtype == "fp32" else 3


def resolved_clip(train) -> str:
    """``train.clip`` as ``train/optim.py build_optimizer`` resolves it: auto is grouped for
    AdaLomo (the full-mode default), global otherwise."""
    opt = train.optimizer if train.optimizer != "auto" else \
        ("adamw" if train.mode == "adapter" else "adalomo")
    return train.clip if train.clip != "auto" else ("grouped" if opt == "adalomo" else "global")


def sharded_runtime_terms(terms: dict, shape: ModelShape, strategy: Strategy, n: int,
                          dense_bytes: float, base_sharded: bool, prefetch_depth: int = 1,
                          overlap: bool = False, copies: int = 2,
                          rollout_gathered: bool = False) -> dict:
    """Turn one process's runtime terms into one rank's of ``n`` under orbitrl's FSDP2
    layout (``orbitrl.distributed.fsdp``), in place; returns ``terms``.

    - ``actor:weights``: every *parameter* is split over the ranks: the whole model in full
      mode; in adapter mode the adapters, embeddings and norms, and the frozen projections
      only when they are plain parameters (``base_sharded``: an fp32 base); a bf16 or
      quantized base lives in buffers and stays whole on every rank.
    - ``comm_buffers:gather``: ``prefetch_depth + 1`` decoder layers' sharded parameters
      gathered whole at once (the computing layer and the prefetched ones), in every phase
      (generation and scoring gather per layer too, in lockstep).
    - ``comm_buffers:gather_staging``: the all-gather in flight: FSDP2 copies this rank's
      shard of the layer into an input buffer (``1/n`` of a layer) and gathers into one
      flat output buffer (a whole layer) before copying it out into the parameters.
    - ``comm_buffers:root``: the root group (embeddings, head, final norm) gathered whole
      from a phase's first forward to its end.
    - ``actor:layer_grad`` (training): a layer's whole gradient plus the reduce-scatter's
      input copy of it. The reduce-scatter runs after the layer is resharded; on a backend
      whose collectives run one at a time (gloo on the host, ``overlap`` False) it never
      coexists with an all-gather in flight, so only what it adds beyond the gather's
      moment, ``prefetch_depth`` gathered layers plus the two gradient copies, is counted;
      with ``overlap`` (NCCL streams) all of it is.
    - stateless full mode, ``actor:update_workspace``: the fused update's temporaries
      (``copies``) on this rank's shard of the largest tensor.
    - ``rollout_gathered`` (``dist.rollout_weights: gathered``): generation holds every
      sharded parameter whole, gathered one layer at a time at the phase's start.
    - AdamW moments and persistent gradients: split over the ranks.
    The KV pool, activations (already of this rank's share of samples) and the host-resident
    int8 reference (replicated) are unchanged.
    """
    root = shape.embed_params + shape.hidden
    if strategy.kind == "adapter":
        a = shape.adapter_params(strategy.adapter_rank)
        proj = projection_params(shape)
        proj_b = proj * strategy.bytes_per_param()
        dense = (shape.total_params - proj) * dense_bytes
        per_layer = (a / shape.num_layers) * dense_bytes + 2 * shape.hidden * dense_bytes
        if base_sharded:
            whole = proj_b + dense + 2 * a
            weights = math.ceil(whole / n)
            per_layer += (shape.layer_params - 2 * shape.hidden) * dense_bytes
        else:
            whole = dense + 2 * a
            weights = int(proj_b) + math.ceil(whole / n)
    else:
        whole = shape.total_params * strategy.bytes_per_param()
        weights = math.ceil(whole / n)
        per_layer = shape.gathered_layer_params * strategy.bytes_per_param()
    gb = PARAM_BYTES[strategy.grad_dtype]
    staging = int(per_layer * (1 + 1 / n))
    for ph in terms.values():
        if "actor:weights" in ph:
            ph["actor:weights"] = weights
        if "actor:optimizer" in ph:
            ph["actor:optimizer"] = math.ceil(ph["actor:optimizer"] / n)
        ph["comm_buffers:gather"] = int((prefetch_depth + 1) * per_layer)
        ph["comm_buffers:gather_staging"] = staging
        ph["comm_buffers:root"] = int(root * dense_bytes)
    if rollout_gathered:
        terms["rollout"]["comm_buffers:gather"] = int(whole)  # root included
        terms["rollout"]["comm_buffers:root"] = 0
    train = terms["train"]
    if "actor:grads" in train:
        train["actor:grads"] = math.ceil(train["actor:grads"] / n)
    if strategy.kind == "stateless":
        grads = int(2 * max(shape.gathered_layer_params, root) * gb)
        if not overlap:  # beyond the all-gather moment (prefetch + 1 layers + staging)
            grads = max(0, int(prefetch_depth * per_layer) + grads
                        - train["comm_buffers:gather"] - staging)
        train["actor:layer_grad"] = grads
        train["actor:update_workspace"] = int(
            copies * math.ceil(largest_tensor_params(shape) / n) * gb)
    return terms
