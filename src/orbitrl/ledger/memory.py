"""Memory ledger: bytes of model state, activations, logits and KV, per device and per phase.

Units are bytes throughout (GB in docs and CLI means 1e9 bytes, so "16 TB" is 16e12 bytes).
The planner calls these with a cluster's sharding; the runtime's prediction of one run
(``runtime.py``) calls the same ones through ``bill.phase_terms``.

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

import functools
import math
from dataclasses import asdict, dataclass

from orbitrl.ledger.formats import PLANNER_INT4_GROUP, PLANNER_PARAM_BYTES, bytes_per_param
from orbitrl.ledger.kv import blocks_for_tokens, kv_bytes_per_block
from orbitrl.ledger.models import ModelShape, from_params

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
DEQUANT_WORKSPACE = {"nf4": 20, "nf4mix": 20, "int8": 8, "bf16": 4, "fp16": 4}


def largest_projection_params(shape: ModelShape) -> int:
    """Elements of the largest decoder-layer projection (what is dequantized per call)."""
    q = shape.num_heads * shape.head_dim
    f = shape.expert_intermediate if shape.is_moe else shape.intermediate
    if shape.fused_projections:  # Phi-3/4: qkv_proj and gate_up_proj
        return shape.hidden * max(2 * f, q + 2 * shape.kv_dim)
    return shape.hidden * max(f, q, shape.kv_dim)


def largest_tensor_params(shape: ModelShape) -> int:
    """Elements of the model's largest single weight (embedding, a projection, the lm head)."""
    q = shape.num_heads * shape.head_dim
    f = shape.expert_intermediate if shape.is_moe else shape.intermediate
    return max(shape.vocab * shape.hidden, largest_projection_params(shape),
               shape.hidden * max(f, 1), shape.hidden * q)


def projection_params(shape: ModelShape) -> int:
    """Parameters of the decoder layers' projections (what a quantizer quantizes)."""
    return shape.num_layers * (shape.layer_params - 2 * shape.hidden)


ROW_TOKENS = 64  # the trainer's shortest packed row (rl/batch.py): short samples share rows


# ---- the trainer's packed layout on lengths (rl/batch.py lays samples out by these) --------
# model/gemm.py multiplies on oneDNN at exactly the rows given up to EXACT_ROWS (a decode
# step's batch), past it at one of ROW_BUCKETS_PER_OCTAVE padded row counts per power of two
# (at most 1/16 of the product wasted): oneDNN keeps a primitive per row count it has seen
EXACT_ROWS = 64
ROW_BUCKETS_PER_OCTAVE = 16


def row_bucket(m: int) -> int:
    """The row count ``m`` rows are multiplied at on oneDNN (model/gemm.py onednn_mm):
    ``m`` up to EXACT_ROWS, else the next multiple of 1/ROW_BUCKETS_PER_OCTAVE of the power
    of two below it."""
    if m <= EXACT_ROWS:
        return m
    step = max(1, (1 << ((m - 1).bit_length() - 1)) // ROW_BUCKETS_PER_OCTAVE)
    return -(-m // step) * step


def shares_prompt(prompt: int, completions: list[int], width: int) -> bool:
    """A GRPO group laid out as one copy of its prompt followed by every completion: when
    it fits a row of ``width``, or when its dense attention costs no more than its samples'
    own rows ((P + sum C)^2 <= sum (P + C)^2: the prompt dominates, as a chat template's
    system turn makes it). SmolLM2's 47-token chat prompts with 8 completions of 16: 175
    positions per group instead of 8 x 63 = 504, attention 30.6k score pairs per head
    instead of 31.8k."""
    shared = prompt + sum(completions)
    return len(completions) > 1 and (
        shared <= width or shared ** 2 <= sum((prompt + c) ** 2 for c in completions))


def unit_layout(groups: list[tuple[int, list[int]]], row_tokens: int = ROW_TOKENS
                ) -> tuple[list[bool], list[int], int]:
    """For ``groups`` (a prompt's length, its completions' lengths), in order: whether each
    is one unit with one copy of its prompt (:func:`shares_prompt`), the units' lengths in
    layout order (a shared group one unit, every other sample its own), and the row width:
    at least the longest sample and ``row_tokens``, widened to the longest unit."""
    width = max([row_tokens] + [p + c for p, cs in groups for c in cs])
    shared = [shares_prompt(p, cs, width) for p, cs in groups]
    lens: list[int] = []
    for (p, cs), sh in zip(groups, shared):
        lens += [p + sum(cs)] if sh else [p + c for c in cs]
    return shared, lens, max([width] + lens)


def first_fit_rows(lens: list[int], width: int) -> tuple[list[tuple[int, int]], int, int]:
    """(row, offset) of each unit, first fit, in order, into rows of ``width``; and the rows
    and the row length (the fullest row's fill) the layout takes."""
    fill: list[int] = []
    where = []
    for n in lens:
        r = next((r for r, f in enumerate(fill) if f + n <= width), len(fill))
        if r == len(fill):
            fill.append(0)
        where.append((r, fill[r]))
        fill[r] += n
    return where, len(fill), max(fill)


def layout_positions(groups: list[tuple[int, list[int]]], row_tokens: int = ROW_TOKENS) -> int:
    """Rows x row length the trainer computes for ``groups`` (see :func:`unit_layout`)."""
    _, lens, width = unit_layout(groups, row_tokens)
    _, rows, length = first_fit_rows(lens, width)
    return rows * length


@functools.lru_cache(maxsize=64)  # a run's start-up prices the same shape several times
def cap_micro_positions(prompt: int, cap: int, group: int, samples: int,
                        max_tokens: int) -> int:
    """Positions of the first micro-batch ``rl/batch.py micro_batches`` cuts from
    ``samples`` samples of ``prompt`` + ``cap`` tokens in groups of ``group`` (one prompt
    each, in order): as many samples as stay within ``max_tokens`` positions, at least one."""
    def positions(k: int) -> int:
        full, rem = divmod(k, group)
        units = [(prompt, [cap] * group)] * full + ([(prompt, [cap] * rem)] if rem else [])
        return layout_positions(units)

    k = 1  # greedy, as micro_batches cuts (positions need not grow with k: rows repack)
    while k < samples and positions(k + 1) <= max_tokens:
        k += 1
    return positions(k)


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
        fp64_attention: fp32 attention computed in fp64 (CPUs): q, k, v saved in fp64 too.
        reply_len: the typical completion, tokens, for the step time (the trainer's and
            scorer's tokens, the rollout's decode steps); 0 (default): spread below the cap
            by the long-tail model (``ledger/timing.py``). Memory is priced at the cap.
        group_size: samples per prompt (``rollout.n``): a group whose prompt and
            completions fit one packed row is trained with one copy of its prompt
            (``rl/batch.py``), which the step time counts so.
        micro_tokens: positions of one micro-batch as the trainer laid it out (rows x row
            length), when known: a step's own shape (``observe/memory.py``, the prediction
            at the step's shape); 0 (default): ``micro_batch * seq_len``, every reply at
            the cap.
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
    fp64_attention: bool = False
    reply_len: int = 0
    group_size: int = 1
    micro_tokens: int = 0

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.completion_len

    @property
    def micro_positions(self) -> int:
        """Positions of one micro-batch: ``micro_tokens``, else ``micro * seq_len``."""
        return self.micro_tokens or self.micro * self.seq_len

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
                     elem: int = 2, fp64_attention: bool = False) -> int:
    """Saved activations for a backward over ``tokens`` tokens on one device (bf16).

    With recompute each layer keeps only its input (h) and one layer's full set is live
    during its recomputation; without, every layer keeps its full set. Tensor parallelism
    with sequence parallelism splits both by ``tp``. ``fp64_attention``: attention's own
    fp64 copies of q, k and v, kept for its backward (measured on SmolLM2-135M: 49.4 KB
    per token and layer against 42.2 KB without this term, 49.9 KB with it).
    """
    per_layer = elem * tokens * layer_activation_elems(shape)
    if fp64_attention:
        per_layer += 8 * tokens * (shape.num_heads * shape.head_dim + 2 * shape.kv_dim)
    if recompute:
        total = elem * tokens * shape.hidden * shape.num_layers + per_layer
    else:
        total = per_layer * shape.num_layers
    return total // tp


def forward_bytes(shape: ModelShape, tokens: int, tp: int = 1, elem: int = 2) -> int:
    """Live activations of a no-grad forward (scoring, prefill): one layer at a time."""
    return elem * tokens * layer_activation_elems(shape) // tp


# the chunked logprob's tile (train/logprobs.py VOCAB_CHUNK; tests/ledger check they agree)
LOGIT_VOCAB_CHUNK = 8192


def logits_bytes(shape: ModelShape, tokens: int, chunk: int, grad: bool) -> int:
    """The chunked logprob's fp32 work (train/logprobs.py): it never holds the [tokens,
    vocab] logits, only a (``chunk`` tokens x 8192 vocabulary) tile at a time and, when
    training, one more of its size (the tile's softmax in backward; a third lives only
    for a moment)."""
    return min(tokens, chunk) * min(shape.vocab, LOGIT_VOCAB_CHUNK) * 4 * (2 if grad else 1)


def kv_block_bytes(shape: ModelShape, kv_dtype: str, block_size: int = 16) -> int:
    """One whole KV block (``block_size`` tokens, all layers, K and V; fp8 with its scales)."""
    scale = 4 if kv_dtype == "fp8" else 0
    return kv_bytes_per_block(shape.num_layers, shape.num_kv_heads, shape.head_dim,
                              block_size, kv_dtype, scale, shape.kv_latent)


def kv_cache_bytes(shape: ModelShape, seqs: int, seq_len: int, kv_dtype: str,
                   block_size: int = 16) -> int:
    """Paged KV for ``seqs`` sequences of up to ``seq_len`` tokens (whole blocks)."""
    return seqs * blocks_for_tokens(seq_len, block_size) * kv_block_bytes(shape, kv_dtype,
                                                                           block_size)
