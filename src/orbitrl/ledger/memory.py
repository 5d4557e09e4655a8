"""Memory ledger: bytes of model state, activations, logits and KV, per device and per phase.

Units are bytes throughout (GB in docs and CLI means 1e9 bytes, so "16 TB" is 16e12 bytes).
The planner calls these with a cluster's sharding; the runtime calls :func:`predict_peak`
with one device and its batch shape, and writes the prediction next to the measured peak.

Per-parameter bills, by strategy:

- ``adamw``: bf16 weight 2 + bf16 grad 2 + fp32 master 4 + fp32 moments 8 = 16 B;
- ``stateless``: the trained weights only (2 B in bf16); each layer's gradient lives only
  while that layer's backward runs, then the fused update consumes and frees it;
- ``adapter``: the frozen base in ``base_dtype`` plus LoRA adapters at 16 B each (bf16
  weight and grad, fp32 master and AdamW moments).

int4 is priced at ``Strategy.int4_group`` values per bf16 scale: 128 by default
(``formats.PLANNER_INT4_GROUP``, the GPTQ/AWQ/torchao layout); a runtime whose int4 uses
another group (orbitrl's own quantizer defaults to ``formats.INT4_GROUP``) passes it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from orbitrl.ledger.formats import PLANNER_INT4_GROUP, PLANNER_PARAM_BYTES, bytes_per_param
from orbitrl.ledger.kv import blocks_for_tokens, kv_bytes_per_block
from orbitrl.ledger.models import ModelShape, from_config

STRATEGIES = ("adamw", "stateless", "adapter")

# bytes per parameter of each storage format, scales included, as the planner prices them
# (orbitrl.ledger.formats: int4 with a bf16 scale per 128 values, 0.515625 B; nf4 0.516 B).
PARAM_BYTES = PLANNER_PARAM_BYTES

DEFAULT_MIN_ROLLOUT_SEQS = 8  # elastic KV: max-length sequences per device that must fit


def param_bytes(fmt: str, int4_group: int = PLANNER_INT4_GROUP) -> float:
    """Bytes per parameter of ``fmt`` (scales included), int4 at ``int4_group``."""
    if fmt == "int4":
        return bytes_per_param("int4", group=int4_group)
    return PARAM_BYTES[fmt]

ADAPTER_BYTES_PER_PARAM = 16  # bf16 weight + bf16 grad + fp32 master + fp32 m and v


@dataclass(frozen=True)
class Strategy:
    """What trains and in which precision.

    ``weight_dtype``/``grad_dtype`` apply to full-parameter strategies; ``base_dtype`` to the
    frozen base of ``adapter``. ``offload_optimizer`` keeps master weights and moments on the host.
    ``int4_group``: values per bf16 scale of an int4 base (128 by default; pass
    ``formats.INT4_GROUP`` to predict orbitrl's own default int4 layout).
    ``dense_dtype``: storage of the tensors a quantized frozen model leaves unquantized
    (embeddings, lm head, norms, biases); ``None`` prices them like the projections (the
    planner's default); the runtime passes its compute dtype, as its quantizer does.
    """

    kind: str = "stateless"
    base_dtype: str = "bf16"
    adapter_rank: int = 16
    weight_dtype: str = "bf16"
    grad_dtype: str = "bf16"
    offload_optimizer: bool = False
    int4_group: int = PLANNER_INT4_GROUP
    dense_dtype: str | None = None

    def __post_init__(self):
        if self.kind not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.kind!r}; one of {', '.join(STRATEGIES)}")
        for f in ("base_dtype", "weight_dtype", "grad_dtype", "dense_dtype"):
            if f == "dense_dtype" and self.dense_dtype is None:
                continue
            if getattr(self, f) not in PARAM_BYTES:
                raise ValueError(f"unknown {f} {getattr(self, f)!r}")
        if self.int4_group <= 0:
            raise ValueError("int4_group must be positive")

    @property
    def stored_dtype(self) -> str:
        """The format of the policy's (frozen or trained) weights as stored."""
        return self.base_dtype if self.kind == "adapter" else self.weight_dtype

    def bytes_per_param(self, fmt: str | None = None) -> float:
        """Bytes per parameter of ``fmt`` (default: the stored weights) under this strategy."""
        return param_bytes(fmt or self.stored_dtype, self.int4_group)

    def frozen_bytes(self, shape: ModelShape, fmt: str | None = None) -> int:
        """A whole frozen model stored in ``fmt`` (default: the stored weights): decoder
        projections in ``fmt``, the rest (embeddings, norms) in ``dense_dtype`` if set."""
        bpp = self.bytes_per_param(fmt)
        if self.dense_dtype is None:
            return int(shape.total_params * bpp)
        proj = projection_params(shape)
        return int(proj * bpp + (shape.total_params - proj) * PARAM_BYTES[self.dense_dtype])


# Bytes per weight element of the transient workspace of one dequantization to fp32 (the
# compute dtype of CPU runs), read off the kernels orbitrl.model.quant calls:
# - nf4 (torchao NF4Tensor.get_original_weight): the two halves of the codes as int64
#   (8 B per element in all), their code-book values in fp32 (4 B), the halves scaled
#   (4 B), and the interleaved fp32 result (4 B): 20 B;
# - int8 (torchao Int8Tensor.dequantize): the codes cast to fp32 (4 B) and the scaled
#   result (4 B): 8 B;
# - bf16 -> fp32: the cast result, 4 B.
# (Measured on one 1536 x 512 layer with the peak-RSS probe: 15.1 MiB for nf4 = 20.1 B and
# 5.9 MiB for int8 = 7.9 B per element.)
DEQUANT_WORKSPACE = {"nf4": 20, "int8": 8, "bf16": 4, "fp16": 4}


def largest_projection_params(shape: ModelShape) -> int:
    """Elements of the largest decoder-layer projection (what is dequantized per call)."""
    q = shape.num_heads * shape.head_dim
    f = shape.expert_intermediate if shape.is_moe else shape.intermediate
    return shape.hidden * max(f, q, shape.kv_dim)


def largest_tensor_params(shape: ModelShape) -> int:
    """Elements of the model's largest single weight (embedding, a projection, the lm head)."""
    q = shape.num_heads * shape.head_dim
    f = shape.expert_intermediate if shape.is_moe else shape.intermediate
    return max(shape.vocab * shape.hidden, shape.hidden * max(f, 1), shape.hidden * q)


def projection_params(shape: ModelShape) -> int:
    """Parameters of the decoder layers' projections (what a quantizer quantizes)."""
    return shape.num_layers * (shape.layer_params - 2 * shape.hidden)


@dataclass(frozen=True)
class Workload:
    """The batch shape of one RL step.

    Args:
        prompt_len, completion_len: tokens; completion_len is the cap (KV is sized for it).
        rollout_seqs: sequences decoding at once across the whole cluster, when the run needs
            exactly that many (the KV for them must fit). ``None`` (default): the KV pool is
            elastic, as the runtime sizes it: whatever memory the other terms leave, at least
            ``min_rollout_seqs`` max-length sequences per device, at most what the step uses
            (``samples_per_step`` sequences at once).
        micro_batch: sequences per device (tp group) per forward/backward micro step,
            packed: a micro step holds ``micro_batch * seq_len`` tokens. 0 (default): auto,
            the planner picks it (see ``orbitrl.ledger.plan``); plain callers get 1.
        samples_per_step: sequences of one RL step (sets step time and the KV the step needs).
        kv_dtype: KV storage (bf16, fp8: half the bytes); block_size: tokens per KV block.
        act_bytes: bytes per activation element (2 for bf16 compute, 4 for fp32 on CPUs).
        recompute: per-layer activation checkpointing (keeps one residual per layer, redoes
            the layer in backward: about 4/3 the compute).
        logit_chunk: tokens per chunk of the chunked logprob (bounds the fp32 logits).
    """

    prompt_len: int = 512
    completion_len: int = 1536
    rollout_seqs: int | None = None
    micro_batch: int = 0
    samples_per_step: int = 512
    kv_dtype: str = "bf16"
    block_size: int = 16
    recompute: bool = True
    logit_chunk: int = 1024
    min_rollout_seqs: int = DEFAULT_MIN_ROLLOUT_SEQS
    act_bytes: int = 2

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.completion_len

    @property
    def micro(self) -> int:
        """Sequences per micro step (``micro_batch``, or 1 where left to auto)."""
        return self.micro_batch or 1

    @property
    def elastic_kv(self) -> bool:
        return self.rollout_seqs is None

    @property
    def blocks_per_seq(self) -> int:
        """KV blocks of one max-length (prompt + completion cap) sequence."""
        return blocks_for_tokens(self.seq_len, self.block_size)

    def kv_need_seqs(self) -> int:
        """Concurrent sequences the workload can use: the fixed count, or the whole step."""
        return self.rollout_seqs or self.samples_per_step

    def kv_reserve_seqs(self, devices: int) -> int:
        """Concurrent max-length sequences that must fit: the fixed count, or the elastic
        minimum (``min_rollout_seqs`` per device, no more than the step needs)."""
        if self.rollout_seqs:
            return self.rollout_seqs
        return max(1, min(self.min_rollout_seqs * devices, self.samples_per_step))


@dataclass(frozen=True)
class StateBytes:
    """Model-state bytes of a trained model, whole (not sharded)."""

    weights: int      # trained or frozen weights as stored
    grads: int        # persistent gradient buffers (0 when released per layer)
    master: int       # fp32 master copy
    optimizer: int    # optimizer moments
    layer_grad: int   # transient: one gathered layer's gradient (per-layer release)

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.master + self.optimizer

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def state_bytes(shape: ModelShape, strategy: Strategy) -> StateBytes:
    """Model state of the policy under ``strategy`` (see the module docstring for the bills)."""
    p = shape.total_params
    if strategy.kind == "adapter":
        a = shape.adapter_params(strategy.adapter_rank)
        return StateBytes(weights=strategy.frozen_bytes(shape) + 2 * a, grads=2 * a,
                          master=4 * a, optimizer=8 * a, layer_grad=0)
    w = int(p * strategy.bytes_per_param())
    g = int(p * PARAM_BYTES[strategy.grad_dtype])
    if strategy.kind == "adamw":
        # fp32 weights are their own master copy (CPU runs train in fp32)
        master = 0 if strategy.weight_dtype == "fp32" else 4 * p
        return StateBytes(weights=w, grads=g, master=master, optimizer=8 * p, layer_grad=0)
    layer_grad = int(shape.gathered_layer_params * PARAM_BYTES[strategy.grad_dtype])
    return StateBytes(weights=w, grads=0, master=0, optimizer=0, layer_grad=layer_grad)


def training_bytes(params: float, strategy: str = "adamw", weight_dtype: str = "bf16",
                   grad_dtype: str = "bf16") -> int:
    """Whole-model state bytes for a bare parameter count (1e12 AdamW -> 16e12 B)."""
    from orbitrl.ledger.models import from_params
    return state_bytes(from_params(params), Strategy(strategy, weight_dtype=weight_dtype,
                                                     grad_dtype=grad_dtype)).total


def layer_activation_elems(shape: ModelShape) -> int:
    """bf16 elements one decoder layer keeps per token for its backward (flash attention).

    Norm inputs/outputs and residual (5h), q and attention output (2q), k and v (2kv),
    gate, up, act(gate) and their product (4f, f the active feed-forward width).
    """
    q = shape.num_heads * shape.head_dim
    if shape.is_moe:
        f = (shape.experts_per_token + shape.shared_experts) * shape.expert_intermediate
    else:
        f = shape.intermediate
    return 5 * shape.hidden + 2 * q + 2 * shape.kv_dim + 4 * f


def activation_bytes(shape: ModelShape, tokens: int, recompute: bool, tp: int = 1,
                     elem: int = 2) -> int:
    """Saved activations for a backward over ``tokens`` tokens on one device (bf16).

    With recompute each layer keeps only its input (h) and one layer's full set is live
    during its recomputation; without, every layer keeps its full set. Tensor parallelism
    with sequence parallelism splits both by ``tp``.
    """
    per_layer = elem * tokens * layer_activation_elems(shape)
    if recompute:
        total = elem * tokens * shape.hidden * shape.num_layers + per_layer
    else:
        total = per_layer * shape.num_layers
    return total // tp


def forward_bytes(shape: ModelShape, tokens: int, tp: int = 1, elem: int = 2) -> int:
    """Live activations of a no-grad forward (scoring, prefill): one layer at a time."""
    return elem * tokens * layer_activation_elems(shape) // tp


def logits_bytes(shape: ModelShape, tokens: int, chunk: int, grad: bool) -> int:
    """fp32 logits of one chunk of tokens (and their gradient when training)."""
    return min(tokens, chunk) * shape.vocab * 4 * (2 if grad else 1)


def kv_block_bytes(shape: ModelShape, kv_dtype: str, block_size: int = 16) -> int:
    """One whole KV block (``block_size`` tokens, all layers, K and V; fp8 with its scales)."""
    scale = 4 if kv_dtype == "fp8" else 0
    return kv_bytes_per_block(shape.num_layers, shape.num_kv_heads, shape.head_dim,
                              block_size, kv_dtype, scale)


def kv_cache_bytes(shape: ModelShape, seqs: int, seq_len: int, kv_dtype: str,
                   block_size: int = 16) -> int:
    """Paged KV for ``seqs`` sequences of up to ``seq_len`` tokens (whole blocks)."""
    return seqs * blocks_for_tokens(seq_len, block_size) * kv_block_bytes(shape, kv_dtype,
                                                                           block_size)


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
    from orbitrl.ledger.bill import phase_terms  # the planner's own arithmetic
    shape = model if isinstance(model, ModelShape) else from_config(model)
    strat = strategy if isinstance(strategy, Strategy) else Strategy(strategy)
    terms = phase_terms(shape, strat, workload or Workload(), devices=devices,
                        prefetch_depth=prefetch_depth, kv_blocks=kv_blocks)
    out = {phase: sum(t.values()) for phase, t in terms.items()}
    out["peak"] = max(out.values())
    out["terms"] = terms
    return out


def runtime_prediction(cfg, hf_config: dict, prompt_len: int, kv_blocks: int | None = None,
                       kv_dtype: str | None = None, device: str = "cpu",
                       recompute: bool = False, devices: int = 1) -> dict:
    """:func:`predict_peak` for one orbitrl run (``orbitrl.config.Config``) on one device.

    Maps the run to the ledger's inputs: strategy from ``train.mode`` / ``train.optimizer``
    / ``model.base_dtype`` / ``lora.rank``, weights and activations in ``model.dtype``,
    the workload from ``rollout`` and ``train.micro_batch_tokens`` (``prompt_len``: the
    longest prompt of the task, in tokens), the KV pool as the engine allocated it. On a CPU
    device the host tier is the same memory, so host terms (the full-parameter mode's int8
    reference) are added to every phase. ``devices > 1``: one rank of a torchrun run, see
    :func:`sharded_runtime_terms`.

    Tiers (``rl/policy.py``), on one process: the full-mode reference on a CUDA device, or
    any reference with ``train.tiers``, holds its embeddings, final norm and head on the
    device and pulls its int8 layers one at a time with ``k`` prefetched (``train.tiers``
    or 2): ``1 + k`` layers in scoring. ``train.tiers: k`` keeps the policy's layers in
    host memory (the ledger's weight offload) with ``1 + k`` layers on the device in
    generation and scoring; in training ``k`` while the head updates, ``2 + k`` during a
    layer's backward (one whose updates are still landing); tiers imply recompute.
    """
    t, r = cfg.train, cfg.rollout
    recompute = recompute or t.recompute or t.tiers > 0  # what rl/policy.py sets
    compute = "fp32" if cfg.model.dtype == "fp32" else "bf16"
    opt = t.optimizer if t.optimizer != "auto" else "adalomo"  # (read in full mode only)
    if t.mode == "adapter":
        base = {"fp32": compute, "bf16": "bf16"}.get(cfg.model.base_dtype, cfg.model.base_dtype)
        strat = Strategy("adapter", base_dtype=base, adapter_rank=cfg.lora.rank,
                         dense_dtype=compute)
    else:
        strat = Strategy("adamw" if opt == "adamw" else "stateless", weight_dtype=compute,
                         grad_dtype=compute, dense_dtype=compute)
    seq_len = prompt_len + r.max_tokens
    n = max(1, int(devices))
    samples = math.ceil(r.n * r.prompts_per_step / n)  # this rank's share of the step
    work = Workload(prompt_len=prompt_len, completion_len=r.max_tokens,
                    micro_batch=max(1, min(samples, t.micro_batch_tokens // seq_len)),
                    samples_per_step=samples, block_size=r.block_size,
                    kv_dtype=kv_dtype or compute, recompute=recompute,
                    act_bytes=int(PARAM_BYTES[compute]))
    from orbitrl.ledger.bill import RoleOptions, phase_terms
    shape = from_config(hf_config)
    tiers = t.tiers if n == 1 and t.mode == "full" else 0
    pulled = t.mode == "full" and n == 1 and (device == "cuda" or tiers > 0)
    roles = RoleOptions(reference="host" if t.mode == "full" else "none",
                        offload=2 if tiers else 0)
    terms = phase_terms(shape, strat, work, kv_blocks=kv_blocks, roles=roles, with_host=True,
                        prefetch_depth=(tiers or 2) if pulled else 0)
    host = terms.pop("host")
    if tiers:
        # training's peak is the larger of two moments: the head's fused update (the largest
        # workspace, below) while the last k layers are still hot from the forward, and a
        # layer's backward (2 + k layers hot, a projection-sized workspace)
        lw = shape.gathered_layer_params * strat.bytes_per_param()
        ws = update_copies(opt) * largest_tensor_params(shape) * PARAM_BYTES[strat.grad_dtype]
        ws_layer = update_copies(opt) * largest_projection_params(shape) \
            * PARAM_BYTES[strat.grad_dtype]
        terms["train"]["comm_buffers:gather"] = int(
            max(tiers * lw + ws, (tiers + 2) * lw + ws_layer) - ws)
    if pulled and device == "cuda":  # the non-layer weights moved to the device
        fixed = int((shape.total_params - shape.num_layers * shape.layer_params) \
            * PARAM_BYTES[compute])
        host["reference:weights"] -= fixed
        for ph in terms.values():
            ph["reference:fixed"] = fixed
            if tiers:
                ph["actor:fixed"] = fixed
        if tiers:
            host["actor:weights"] -= fixed
    # orbitrl's engine allocates its KV pool once and keeps it: resident in every phase
    kv = terms["rollout"]["rollout_kv:blocks"]
    terms["score"]["rollout_kv:blocks"] = terms["train"]["rollout_kv:blocks"] = kv
    if strat.kind == "stateless":
        # one process, the update fused into backward per parameter (not per gathered
        # layer): the largest trained tensor's gradient plus the update's temporaries of its
        # size (train/optim.py: SGD one clipped copy; AdaLomo a clipped copy and then g^2 or
        # the update u, one at a time)
        terms["train"].pop("actor:layer_grad", None)
        terms["train"]["actor:update_workspace"] = int(
            update_copies(opt) * largest_tensor_params(shape) * PARAM_BYTES[strat.grad_dtype])
    # a frozen projection is dequantized to the compute dtype per call (forward, and again in
    # backward): the workspace of the largest projection is live on top of everything else
    proj = largest_projection_params(shape)
    if strat.kind == "adapter" and strat.base_dtype != compute:
        for ph in terms.values():
            ph["activations:dequant"] = int(proj * DEQUANT_WORKSPACE[strat.base_dtype])
    elif strat.kind != "adapter":  # the int8 reference scores with the same kernel
        terms["score"]["activations:dequant"] = int(proj * DEQUANT_WORKSPACE["int8"])
    if n > 1:
        sharded_runtime_terms(terms, shape, strat, n, PARAM_BYTES[compute],
                              base_sharded=t.mode == "full" or cfg.model.base_dtype == "fp32",
                              prefetch_depth=cfg.dist.prefetch_layers,
                              overlap=device == "cuda",
                              copies=update_copies(opt),
                              rollout_gathered=cfg.dist.rollout_weights == "gathered")
    if device != "cuda":
        for ph in terms.values():
            ph.update({f"host:{k}": b for k, b in host.items()})
    out = {phase: sum(tm.values()) for phase, tm in terms.items()}
    out["peak"] = max(out.values())
    out["terms"] = terms
    return out


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
    from orbitrl.errors import OrbitError

    r = cfg.rollout
    pred = runtime_prediction(cfg, hf_config, prompt_len, kv_blocks=0,
                              kv_dtype="fp8" if r.kv_dtype == "fp8" else None, device=device,
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


def update_copies(optimizer: str) -> int:
    """Tensors the size of the one being updated, alive at once inside a fused update: its
    gradient plus one clipped fp32 copy (SGD), plus g^2 or the update u (AdaLomo)."""
    return 3 if optimizer == "adalomo" else 2


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
      gathered whole at once (the computing layer and the prefetched one), in every phase
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
