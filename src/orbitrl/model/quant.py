"""Frozen base weights in a storage format, dequantized per linear call to the compute dtype.

Formats (bytes per parameter in :mod:`orbitrl.ledger.formats`, the planner's source too):

- ``fp32``, ``bf16``: the weight as is, upcast per call.
- ``int8``: torchao ``Int8Tensor`` (symmetric, per output row).
- ``nf4``: torchao ``NF4Tensor`` (QLoRA's NormalFloat4, double-quantized block scales).
- ``nf4mix``: ``nf4`` for the MLP's gate and up projections, ``int8`` for the attention
  projections and the down projection (:func:`orbitrl.ledger.formats.mixed_format`). Why:
  on SmolLM2-135M, 100 held-out sums answered greedily: fp32 21, int8 19, every projection
  nf4 2, nf4 on gate/up only with int8 elsewhere 18; nf4 everywhere but the down and value
  projections 13, and nf4 on the MLP alone 6: the down projection and attention are what 4
  bits break.
- ``int4``: our own symmetric group-wise int4 (two codes per byte, a bf16 scale per group):
  torchao's int4 tensors need GPU kernels (mslk) and do not run on CPU. Its codes are tested
  against torchao's ``quantize_affine``.

Why a custom autograd function: a plain ``F.linear(x, w.dequantize())`` makes autograd keep
the dequantized full-precision weight of every layer alive until backward, so training would
hold the whole full-precision base after all. :class:`_DequantLinear` keeps only the stored
format and dequantizes again in backward (the gradient w.r.t. the input; the base is frozen).
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

from orbitrl.errors import OrbitError
from orbitrl.ledger import formats as fmts

FORMATS = ("fp32", "bf16", "int8", "nf4", "nf4mix", "int4")
_PLAIN = {"fp32": torch.float32, "bf16": torch.bfloat16}
# device types each format's implementation runs on (None: any device torch runs on)
_DEVICES = {"fp32": None, "bf16": None, "int4": None, "int8": ("cpu", "cuda"),
            "nf4": ("cpu", "cuda"), "nf4mix": ("cpu", "cuda")}
_LIBRARY = {"int8": "torchao Int8Tensor", "nf4": "torchao NF4Tensor",
            "nf4mix": "torchao NF4Tensor and Int8Tensor"}

# Projection weights inside decoder layers: what the loader quantizes (embeddings, norms and
# the LM head stay in the load dtype; DeepSeek-V3's latent projections are quantized too).
# Mixtures: every expert projection too (each dequantized only when its expert runs);
# routers and the shared-expert gate stay as loaded.
QUANTIZED_WEIGHTS = re.compile(r"model\.layers\.\d+\.(self_attn|mlp|block_sparse_moe)\."
                               r"((shared_experts?|experts\.\d+)\.)?"
                               r"(\w+_proj|w[123]|kv_a_proj_with_mqa)\.weight")


def _torchao():
    """torchao's ``Int8Tensor`` and ``NF4Tensor`` as attributes of one namespace (its
    start-up noise is filtered by orbitrl._quiet). NF4Tensor moved to
    ``torchao.quantization`` in 0.18; before, it lives in ``torchao.dtypes``."""
    from torchao.quantization import Int8Tensor  # start-up: torchao ~1 s
    try:
        from torchao.quantization import NF4Tensor  # start-up: torchao ~1 s
    except ImportError:  # torchao < 0.18
        from torchao.dtypes import NF4Tensor  # start-up: torchao ~1 s
    return SimpleNamespace(Int8Tensor=Int8Tensor, NF4Tensor=NF4Tensor)


def check_format(fmt: str, device="cpu", key: str = "base_format") -> None:
    """Raise a one-line OrbitError naming ``key`` if ``fmt`` is unknown or cannot run on
    ``device`` (library missing, device type unsupported)."""
    if fmt not in FORMATS:
        raise OrbitError(f"{key}: unknown frozen-base format {fmt!r} "
                         f"(choose from {', '.join(FORMATS)})")
    dev = torch.device(device).type
    allowed = _DEVICES[fmt]
    if allowed is not None and dev not in allowed:
        raise OrbitError(f"{key}: format {fmt!r} ({_LIBRARY[fmt]}) does not run on device "
                         f"{dev!r} (runs on {', '.join(allowed)}; bf16 or int4 run anywhere)")
    if fmt in _LIBRARY:
        try:
            _torchao()
        except ImportError as e:
            raise OrbitError(f"{key}: format {fmt!r} needs torchao ({e}); "
                             "pip install torchao, or use bf16 or int4") from None


# ---- group-wise int4 (ours) ----------------------------------------------------------------

def quantize_int4(w: torch.Tensor, group: int = fmts.INT4_GROUP):
    """Symmetric group-wise int4, torchao's ``choose_qparams_affine`` convention
    (scale = absmax / 7.5, codes round-half-even clamped to [-8, 7]).

    Args:
        w: [out, in] weight, in % group == 0.
    Returns:
        packed: uint8 [out, in // 2] (even column in the low nibble); scales: bf16
        [out, in // group]. Codes are computed against the bf16-rounded scale, so the stored
        pair is self-consistent.
    """
    out, inp = w.shape
    wg = w.float().reshape(out, inp // group, group)
    scale = (wg.abs().amax(-1) / 7.5).clamp(min=torch.finfo(torch.float32).eps)
    scale = scale.to(torch.bfloat16)
    q = torch.round(wg / scale.float()[..., None]).clamp(-8, 7)
    u = (q + 8).to(torch.uint8).reshape(out, inp)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous(), scale


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, dtype=torch.float32):
    """Inverse of :func:`quantize_int4`: [out, in // 2] codes, [out, G] scales -> [out, in]."""
    out = packed.shape[0]
    u = torch.stack([packed & 0xF, packed >> 4], -1).reshape(out, -1)
    q = u.to(torch.float32) - 8
    w = q.reshape(out, scales.shape[1], -1) * scales.float()[..., None]
    return w.reshape(out, -1).to(dtype)


# ---- NF4 dequantization ---------------------------------------------------------------------

_NF4_PAIRS: dict = {}  # (device, dtype) -> [256]: each byte's two code-book values


def _nf4_pairs(nf4: torch.Tensor) -> torch.Tensor:
    """Byte -> (high-nibble value, low-nibble value), one entry per byte [256] in an integer
    dtype twice the code book's width (so one gather moves both values; 2 KiB for fp32),
    one table per device and dtype: the NF4 code book is one constant, shared by every
    layer."""
    key = (nf4.device, nf4.dtype)
    table = _NF4_PAIRS.get(key)
    if table is None:
        codes = torch.arange(256, device=nf4.device)
        pairs = torch.stack([nf4[codes >> 4], nf4[codes & 0xF]], -1).contiguous()
        wide = {4: torch.int64, 2: torch.int32}[nf4.element_size()]
        table = _NF4_PAIRS[key] = pairs.view(wide).view(256)
    return table


def dequantize_nf4(w) -> torch.Tensor:
    """torchao ``NF4Tensor.get_original_weight``, bit for bit, in a third of the kernels.

    torchao splits each byte into two int64 code tensors, gathers each, scales each and
    interleaves them with a stack (14 kernels, two int64 copies of the codes). Here one
    gather from the byte -> value-pair table yields the values already interleaved, and
    one multiply applies the block scales: the same products in the same dtype, so the
    weight is identical. The double-quantized scales are decoded per call as torchao does
    (keeping them decoded would add 4 bytes per 64 weights to the resident base).

    Args:
        w: an ``NF4Tensor`` of ``N`` values in blocks of ``w.block_size``.
    Returns:
        the weight in ``w.dtype``, shaped as ``w``.
    """
    n_sb = w.quantized_scalers.numel() // w.scaler_block_size
    scalers = (w.quantized_scalers.view(n_sb, w.scaler_block_size)
               / w.quantization_factor.unsqueeze(-1)).flatten().to(w.dtype) + w.scaler_mean
    pairs = _nf4_pairs(w.nf4).index_select(0, w.quantized_data.to(torch.int32))  # [N / 2]
    vals = pairs.view(w.nf4.dtype).view(-1, w.block_size)  # [blocks, block], interleaved
    return (vals * scalers.unsqueeze(-1)).view(w.shape)


# ---- the module ----------------------------------------------------------------------------

class _DequantLinear(torch.autograd.Function):
    """y = x @ W^T with W dequantized in forward and again in backward (never saved)."""

    @staticmethod
    def forward(ctx, x, mod):
        ctx.mod = mod
        return F.linear(x, mod.compute_weight(x.dtype))

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return None, None
        return grad @ ctx.mod.compute_weight(grad.dtype), None


def cache_dequantized(model: nn.Module, budget_bytes: int, dtype=torch.float32) -> int:
    """Keep every frozen projection's weight in the compute ``dtype`` after its first use,
    when all of them together take at most ``budget_bytes``; returns the bytes the copies
    take (0: nothing cached, each call dequantizes afresh).

    Dequantizing per call keeps only the stored format resident, at one dequantization per
    projection per forward (and per backward): 28 of them per decode step of the built-in
    model, 16% of its GRPO step on a CPU. For a model whose compute-dtype projections fit
    the budget (``model.dequant_cache_mb``), the copies cost less memory than they save
    time; larger models keep the per-call path. Plain formats already in ``dtype`` (an fp32
    base computing in fp32) need no copy and are not counted."""
    mods = [m for m in model.modules() if isinstance(m, FrozenLinear)
            and not (m.fmt in _PLAIN and _PLAIN[m.fmt] == dtype)]
    size = sum(m.out_features * m.in_features for m in mods) * dtype.itemsize
    on = bool(mods) and size <= budget_bytes
    for m in mods:
        m.cache_weight, m._cached = on, None
    return size if on else 0


def leaf_tensors(t: torch.Tensor):
    """Plain tensors behind a (possibly subclassed) tensor, e.g. NF4's codes and scales."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        for n in names:
            inner = getattr(t, n)
            if inner is not None:
                yield from leaf_tensors(inner)
    else:
        yield t


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (subclasses unpacked)."""
    seen, total = set(), 0
    for t in tensors:
        for leaf in leaf_tensors(t):
            s = leaf.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
    return total


class FrozenLinear(nn.Module):
    """A frozen linear layer whose weight is stored in ``fmt`` and dequantized per call.

    Args:
        weight: [out, in] full-precision weight (consumed; only the stored format is kept).
        bias: optional [out] bias, kept as a frozen parameter in its own dtype.
        fmt: one of :data:`FORMATS`.
        group_size: int4 group (values per scale along the input dimension).
    The forward computes in the input's dtype: x [..., in] -> [..., out].
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 fmt: str = "bf16", group_size: int = fmts.INT4_GROUP, name: str = "weight"):
        super().__init__()
        check_format(fmt, weight.device)
        fmt = fmts.mixed_format(fmt, name)  # nf4mix: this weight's own format, by its name
        self.fmt, self.out_features, self.in_features = fmt, *weight.shape
        self.group_size = group_size
        w = weight.detach()
        if fmt in _PLAIN:
            self.register_buffer("weight", w.to(_PLAIN[fmt]).contiguous())
        elif fmt == "int8":
            from torchao.quantization.granularity import PerRow  # start-up: torchao ~1 s
            self.register_buffer("weight", _torchao().Int8Tensor.from_hp(
                w.float().contiguous(), granularity=PerRow()))
        elif fmt == "nf4":
            n = w.numel()
            if n % fmts.NF4_BLOCK:
                raise OrbitError(f"{name}: {n} values are not a multiple of the NF4 block "
                                 f"({fmts.NF4_BLOCK}); use int8 or bf16 for it")
            sb = fmts.nf4_scaler_block(n)
            self.register_buffer("weight", _torchao().NF4Tensor.from_tensor(
                w.float().contiguous(), fmts.NF4_BLOCK, sb))
        else:  # int4
            if self.in_features % group_size:
                raise OrbitError(f"{name}: in_features {self.in_features} is not a multiple "
                                 f"of the int4 group size {group_size}")
            packed, scales = quantize_int4(w, group_size)
            self.register_buffer("qweight", packed)
            self.register_buffer("scales", scales)
        if bias is not None:
            bias = nn.Parameter(bias.detach(), requires_grad=False)
        self.register_parameter("bias", bias)
        self.cache_weight, self._cached = False, None  # see cache_dequantized

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str, **kw) -> "FrozenLinear":
        return cls(linear.weight, linear.bias, fmt, **kw)

    @property
    def device(self) -> torch.device:
        return (self.qweight if self.fmt == "int4" else self.weight).device

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """The weight [out, in] in ``dtype`` (a fresh tensor for quantized formats)."""
        if self.fmt in _PLAIN:
            return self.weight.to(dtype)
        if self.fmt == "int8":
            return self.weight.dequantize(dtype)
        if self.fmt == "nf4":
            return dequantize_nf4(self.weight).to(dtype)
        return dequantize_int4(self.qweight, self.scales, dtype)

    def compute_weight(self, dtype) -> torch.Tensor:
        """The weight in ``dtype`` for one call: dequantized afresh, or, once
        :func:`cache_dequantized` enabled this module, the copy kept from the last call
        (kept while the stored weight is the same tensor on the same device)."""
        if not self.cache_weight:
            return self.dequantize(dtype)
        src = self.qweight if self.fmt == "int4" else self.weight
        hit = self._cached
        if hit is not None and hit[0] is src and hit[1].dtype == dtype:
            return hit[1]
        with torch.inference_mode(False):  # kept: a normal tensor even if made in a rollout
            w = self.dequantize(dtype)
        self._cached = (src, w)
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad and torch.is_grad_enabled():
            y = _DequantLinear.apply(x, self)
        else:  # nothing to differentiate (rollout, scoring): skip the autograd node
            y = F.linear(x, self.compute_weight(x.dtype))
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def weight_bytes(self) -> int:
        """Resident bytes of the weight and its scales (what the ledger prices)."""
        stored = [self.qweight, self.scales] if self.fmt == "int4" else [self.weight]
        return storage_bytes(stored)

    def dequantized_state(self) -> dict[str, torch.Tensor]:
        """HF-named tensors for export (``weight`` in fp32, ``bias``)."""
        out = {"weight": self.dequantize(torch.float32)}
        if self.bias is not None:
            out["bias"] = self.bias.detach()
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"fmt={self.fmt}, bias={self.bias is not None}")


# ---- quantize while loading ----------------------------------------------------------------

def quantizing_hook(fmt: str, group_size: int = fmts.INT4_GROUP, then=None):
    """An ``on_tensor`` hook for :func:`orbitrl.model.weights.load_model` that turns each
    decoder-layer projection weight into a :class:`FrozenLinear` as it streams by, so the
    full-precision model never exists. ``then`` is an earlier hook applied first."""

    def hook(model: nn.Module, name: str, t: torch.Tensor):
        if then is not None:
            out = then(model, name, t)
            if out is not None:
                return out
        if not QUANTIZED_WEIGHTS.fullmatch(name):
            return None
        owner = model.get_submodule(name.rpartition(".")[0])
        bias = owner.bias if isinstance(owner, nn.Linear) else None  # may still be on meta
        return FrozenLinear(t, bias, fmt, group_size=group_size, name=name)

    return hook


def finish_frozen(model: nn.Module, path="") -> None:
    """After loading: every FrozenLinear bias loaded and frozen (biases may stream by after
    their weight and are then assigned as ordinary parameters)."""
    for name, mod in model.named_modules():
        if isinstance(mod, FrozenLinear) and mod.bias is not None:
            if mod.bias.is_meta:
                raise OrbitError(f"{path}: checkpoint lacks weight {name + '.bias'!r}")
            mod.bias.requires_grad_(False)


def frozen_linears(model: nn.Module) -> dict[str, FrozenLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, FrozenLinear)}
