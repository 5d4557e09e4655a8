"""Bytes per parameter of each frozen-weight storage format (weights + scales), pure arithmetic.

The one source of these figures: the planner prices a frozen base with :func:`bytes_per_param`
and the runtime's :class:`orbitrl.model.quant.FrozenLinear` is tested to hold exactly
:func:`linear_bytes` for its shape. Each formula mirrors the layout actually stored:

- ``fp32`` / ``bf16`` / ``fp16``: the weight, 4 / 2 / 2 B.
- ``int8`` (torchao ``Int8Tensor``, symmetric per output row): 1 B code, plus per row an fp32
  scale and an int8 zero point: ``1 + 5 / in_features``.
- ``nf4`` (torchao ``NF4Tensor``, QLoRA's double quantization): 4-bit codes over the flattened
  weight in blocks of ``block`` values; each block's absmax quantized to int8; one fp32 factor
  per ``scaler_block`` absmaxes; per tensor an fp32 mean and the 16-entry fp32 code book:
  ``0.5 + 1 / block + 4 / (block * scaler_block)`` (+ 68 B per tensor).
- ``int4`` (ours, symmetric group-wise, two codes per byte): ``0.5 + 2 / group`` (a bf16
  scale per ``group`` values along the input dimension). The runtime defaults to
  ``INT4_GROUP`` (32); the planner prices int4 at ``PLANNER_INT4_GROUP`` (128, the layout of
  GPTQ/AWQ and torchao int4 weight-only checkpoints) unless told another group.
- ``nf4mix``: ``nf4`` for the MLP's input projections (gate and up), ``int8`` for the
  attention projections and the down projection, the ones 4 bits break first on a small
  model (llama.cpp's Q4_K_M keeps its down and value projections wider for the same reason).
  Priced at ``NF4MIX_SHARE`` of a model's projection weights in nf4, the rest int8; per
  weight, :func:`linear_bytes` of the format each one is stored in (:func:`mixed_format`).
"""

from __future__ import annotations

import math
import re

FORMATS = ("fp32", "bf16", "fp16", "int8", "nf4", "nf4mix", "int4")

NF4_BLOCK = 64          # values per absmax (QLoRA, torchao and bitsandbytes default)
NF4_SCALER_BLOCK = 256  # absmaxes per fp32 factor (torchao default)
INT4_GROUP = 32         # values per bf16 scale (GGUF Q4_0-sized groups; divides every width)
# The planner's int4 at scale: the common int4 checkpoints (GPTQ, AWQ, torchao int4
# weight-only) use groups of 128, i.e. 0.515625 B/param (1.6e12 params -> 0.825 TB). The
# runtime's own default stays INT4_GROUP; a runtime prediction passes its group explicitly.
PLANNER_INT4_GROUP = 128
TYPICAL_IN_FEATURES = 4096  # a row length for per-row overheads when no shape is given

# nf4mix: the share of a dense decoder's projection weights in the MLP's gate and up
# projections (2 h i of 2 h i + h i + attention): SmolLM2-135M 0.50, Llama-3-8B 0.54,
# Qwen2.5-7B 0.60; a mixture's experts are almost all MLP (0.6-0.67)
NF4MIX_SHARE = 0.5
NF4MIX_NF4 = re.compile(r".*\.(gate_proj|up_proj|gate_up_proj|w1|w3)\.weight")

_PLAIN = {"fp32": 4, "bf16": 2, "fp16": 2}
_NF4_PER_TENSOR = 4 + 16 * 4  # fp32 scaler mean + fp32 code book


def nf4_scaler_block(numel: int, block: int = NF4_BLOCK,
                     scaler_block: int = NF4_SCALER_BLOCK) -> int:
    """The scaler block a tensor of ``numel`` values actually gets: the largest divisor of its
    block count that divides ``scaler_block`` (torchao needs the count divisible)."""
    return math.gcd(numel // block, scaler_block)


def bytes_per_param(fmt: str, in_features: int = TYPICAL_IN_FEATURES, *,
                    block: int = NF4_BLOCK, scaler_block: int = NF4_SCALER_BLOCK,
                    group: int = INT4_GROUP) -> float:
    """Bytes one frozen weight parameter costs in ``fmt``, scales included.

    Args:
        fmt: one of :data:`FORMATS`.
        in_features: row length (per-row scales of int8 are amortised over it).
        block, scaler_block: NF4 block sizes. group: int4 group size.
    Returns:
        Bytes per parameter (per-tensor constants excluded; see :func:`linear_bytes`).
    """
    if fmt in _PLAIN:
        return float(_PLAIN[fmt])
    if fmt == "int8":
        return 1.0 + 5.0 / in_features
    if fmt == "nf4":
        return 0.5 + 1.0 / block + 4.0 / (block * scaler_block)
    if fmt == "int4":
        return 0.5 + 2.0 / group
    if fmt == "nf4mix":
        return NF4MIX_SHARE * bytes_per_param("nf4", in_features, block=block,
                                              scaler_block=scaler_block) + \
            (1 - NF4MIX_SHARE) * bytes_per_param("int8", in_features)
    raise ValueError(f"unknown weight format {fmt!r}; one of {', '.join(FORMATS)}")


def mixed_format(fmt: str, name: str) -> str:
    """The format the weight ``name`` (a checkpoint name) is stored in under ``fmt``: for
    ``nf4mix`` nf4 or int8 by projection, else ``fmt`` itself."""
    if fmt != "nf4mix":
        return fmt
    return "nf4" if NF4MIX_NF4.fullmatch(name) else "int8"


def linear_bytes(fmt: str, out_features: int, in_features: int, *, block: int = NF4_BLOCK,
                 scaler_block: int = NF4_SCALER_BLOCK, group: int = INT4_GROUP) -> int:
    """Exact resident bytes of one frozen ``[out_features, in_features]`` weight in ``fmt``
    (bias excluded), per-tensor constants and the actual NF4 scaler block included."""
    n = out_features * in_features
    if fmt in _PLAIN:
        return n * _PLAIN[fmt]
    if fmt == "int8":
        return n + 5 * out_features
    if fmt == "nf4":
        blocks = n // block
        sb = nf4_scaler_block(n, block, scaler_block)
        return n // 2 + blocks + 4 * (blocks // sb) + _NF4_PER_TENSOR
    if fmt == "int4":
        return n // 2 + 2 * out_features * (in_features // group)
    raise ValueError(f"unknown weight format {fmt!r}; one of {', '.join(FORMATS)}")


# Bytes per parameter for a typical row length, in the runtime's own layouts (int4 at
# INT4_GROUP): what orbitrl.model.quant stores, checked by its tests.
PARAM_BYTES = {**{fmt: bytes_per_param(fmt) for fmt in FORMATS}, "fp8": 1.0}

# What the planner prices: the same, except int4 at PLANNER_INT4_GROUP (see above).
PLANNER_PARAM_BYTES = {**PARAM_BYTES, "int4": bytes_per_param("int4", group=PLANNER_INT4_GROUP)}
