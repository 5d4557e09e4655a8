"""Rotary position embeddings: default, linear, llama3, yarn, longrope and dynamic (NTK)
frequency scaling, and partial rotary (Phi-3/4's ``partial_rotary_factor``).

Frequencies are computed in fp32 exactly as transformers does (``modeling_rope_utils.py``),
so logits match to rounding (dynamic NTK past its switch: to an ulp, see ``Rotary``). yarn
and longrope also scale cos and sin by an attention factor, as transformers' rotary
embeddings do.

longrope and dynamic depend, in transformers, on the running sequence length: each forward
takes ``seq_len = max(position_ids) + 1`` and picks longrope's long factors when it exceeds
``original_max_position_embeddings`` (short ones otherwise), or recomputes dynamic NTK's base
for ``seq_len`` when it exceeds ``max_position_embeddings``. Here the choice is made per
token: the token at position ``p`` takes the frequencies transformers uses for
``seq_len = p + 1``, i.e. those of the decode step that generates it one token at a time. So
a token's rotation depends on its position only, and the engine (prefill chunks, decode
steps, its KV cache) and the trainer (whole packed sequences) rotate every token alike.
This equals transformers' forward for sequences within the switch length (the original
context), and transformers' ``generate`` whenever the prompt lies within it (its decode
steps are one token each; Phi-3's aside, below). A single transformers forward over a
longer sequence instead rotates all of its tokens with the long (or rescaled)
frequencies, and transformers' Phi-3 ``generate`` re-encodes the whole sequence so when it
first passes the switch (docs/models.md, "Rope scaling").
"""

from __future__ import annotations

import math

import torch

from orbitrl.model.config import ModelConfig


def _arange(d: int, device="cpu") -> torch.Tensor:
    """transformers' exponent grid ``arange(0, d, 2) / d`` in fp32."""
    return torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d


def inv_frequencies(cfg: ModelConfig, long: bool = False) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] in fp32, with the config's scaling applied:
    for longrope the short factors (``long``: the long ones); for dynamic NTK those of
    sequences within ``max_position_embeddings``."""
    d = cfg.rotary_dim or cfg.head_dim
    p = cfg.rope_params
    if cfg.rope_type == "yarn":
        return _yarn(cfg, d)
    if cfg.rope_type == "longrope":
        ext = torch.tensor(p["long_factor" if long else "short_factor"], dtype=torch.float32,
                           device="cpu")
        return 1.0 / (ext * cfg.rope_theta ** _arange(d))
    theta = cfg.rope_theta
    if cfg.rope_type == "dynamic":  # transformers' init: seq_len = max_position_embeddings
        mpe, factor = cfg.max_position_embeddings, p["factor"]
        theta = theta * ((factor * mpe / mpe) - (factor - 1)) ** (d / (d - 2))
    inv = 1.0 / (theta ** _arange(d))
    if cfg.rope_type == "linear":
        inv = inv / p["factor"]
    elif cfg.rope_type == "llama3":
        factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old_ctx = p["original_max_position_embeddings"]
        lo_wavelen, hi_wavelen = old_ctx / lo, old_ctx / hi
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > lo_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < hi_wavelen) * ~(wavelen > lo_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def _scale_factor(cfg: ModelConfig) -> float:
    """yarn / longrope ``factor``; absent, max_position_embeddings over the original
    context (transformers' rule)."""
    f = cfg.rope_params.get("factor")
    if f is None:
        f = cfg.max_position_embeddings / cfg.rope_params["original_max_position_embeddings"]
    return f


def _yarn(cfg: ModelConfig, d: int) -> torch.Tensor:
    """YaRN: interpolated (divided by factor) below the correction range, extrapolated
    (unchanged) above it, a linear ramp between (transformers' ``_compute_yarn_parameters``)."""
    p = cfg.rope_params
    base, factor = cfg.rope_theta, _scale_factor(cfg)
    orig = p["original_max_position_embeddings"]
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def dim_of(rotations):  # the dimension that turns ``rotations`` times over orig
        return (d * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # transformers': no division by zero
    ramp = torch.arange(d // 2, dtype=torch.float32, device="cpu")
    ramp = torch.clamp((ramp - low) / (high - low), 0, 1)
    pos_freqs = base ** _arange(d)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # the share kept extrapolated
    return interpolated * (1 - keep) + extrapolated * keep


def attention_factor(cfg: ModelConfig) -> float:
    """The factor transformers multiplies cos and sin by: yarn's mscale, longrope's
    ``sqrt(1 + log(factor) / log(original))``, or the config's ``attention_factor``; 1 for
    the other types."""
    p = cfg.rope_params
    af = p.get("attention_factor")
    if cfg.rope_type == "yarn" and af is None:
        factor = _scale_factor(cfg)

        def mscale(scale, m=1):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if p.get("mscale") and p.get("mscale_all_dim"):
            af = float(mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"]))
        else:
            af = mscale(factor)
    elif cfg.rope_type == "longrope" and af is None:
        factor = _scale_factor(cfg)
        orig = p["original_max_position_embeddings"]
        af = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    elif cfg.rope_type not in ("yarn", "longrope"):
        af = 1.0
    return af


class Rotary:
    """cos/sin tables for given positions; caches inv_freq per device (not a module buffer,
    so that building the model on the meta device needs no special care).

    longrope and dynamic: a token at position ``p >= switch`` (longrope:
    ``original_max_position_embeddings``; dynamic: ``max_position_embeddings``) takes the
    frequencies transformers uses for ``seq_len = p + 1`` (the module docstring)."""

    def __init__(self, cfg: ModelConfig):
        self._inv_cpu = inv_frequencies(cfg)
        self._inv = {}
        self.scale = attention_factor(cfg)
        self.kind, self.switch = cfg.rope_type, None
        if cfg.rope_type == "longrope":
            self.switch = cfg.rope_params["original_max_position_embeddings"]
            self._long_cpu, self._long = inv_frequencies(cfg, long=True), {}
        elif cfg.rope_type == "dynamic":
            self.switch = cfg.max_position_embeddings
            self._dynamic = (cfg.rope_theta, cfg.rope_params["factor"],
                             cfg.max_position_embeddings, cfg.rotary_dim or cfg.head_dim)

    def _beyond(self, positions: torch.Tensor) -> torch.Tensor:
        """[B, T, D/2] frequencies of tokens past the switch (each for seq_len = p + 1)."""
        dev = positions.device
        if self.kind == "longrope":
            inv = self._long.get(dev)
            if inv is None:
                inv = self._long[dev] = self._long_cpu.to(dev)
            return inv
        # dynamic NTK, transformers' _compute_dynamic_ntk_parameters with seq_len = p + 1, in
        # its fp32 steps, except that the two powers are taken in fp64 and rounded: an fp32
        # pow over a vector takes SIMD lanes or a scalar tail by the element's place, which
        # can differ by an ulp, and a token's frequencies must not depend on the batch it
        # sits in (engine steps against the trainer's rows); fp32 pow rounds within an ulp
        # of these (tests/model/test_rope.py)
        theta, factor, mpe, d = self._dynamic
        seq_len = torch.clamp_min(positions + 1, mpe)
        grown = ((factor * seq_len / mpe) - (factor - 1)).double() ** (d / (d - 2))
        base = theta * grown.float()
        return 1.0 / (base.double()[..., None] ** _arange(d, dev).double()).float()

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions: [B, T] int -> (cos, signed sin): [B, T, 1, rotary_dim] in dtype, the
        sine's first half negated (see :func:`apply_rotary`)."""
        dev = positions.device
        inv = self._inv.get(dev)
        if inv is None:
            inv = self._inv[dev] = self._inv_cpu.to(dev)
        if self.switch is not None:
            inv = torch.where((positions >= self.switch)[..., None], self._beyond(positions), inv)
        freqs = positions.float()[..., None] * inv  # [B, T, D/2]
        cos, sin = torch.cat((freqs, freqs), dim=-1).cos(), freqs.sin()
        if self.scale != 1.0:  # yarn / longrope: transformers scales cos and sin in fp32
            cos, sin = cos * self.scale, sin * self.scale
        return (cos.to(dtype)[:, :, None, :],
                torch.cat((-sin, sin), dim=-1).to(dtype)[:, :, None, :])


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin`` with the same products and sums:
    ``rotate_half(x) = cat(-x2, x1)`` is ``roll(x, D/2) = cat(x2, x1)`` times the sign that
    ``signed_sin = cat(-sin1, sin2)`` carries (a sign flip is exact): roll, two products
    and a sum, where rotate_half took chunk, neg and cat before them (twice per layer).
    Partial rotary (tables narrower than the heads, Phi-3/4): the first ``R`` channels of
    each head rotate, the rest pass through (transformers' ``cat(rotated, pass)``).

    x: [B, T, H, D]; cos / signed_sin: [B, T, 1, R] (from :class:`Rotary`), R <= D."""
    r = cos.shape[-1]
    if r != x.shape[-1]:
        part = x[..., :r]
        return torch.cat((part * cos + part.roll(r // 2, -1) * signed_sin, x[..., r:]), -1)
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin
