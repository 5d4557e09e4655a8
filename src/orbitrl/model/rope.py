"""Rotary position embeddings: default, linear and llama3 frequency scaling.

Frequencies are computed in fp32 exactly as transformers does, so logits match to rounding.
"""

from __future__ import annotations

import math

import torch

from orbitrl.model.config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, with the config's scaling applied."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d))
    p = cfg.rope_params
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


class Rotary:
    """cos/sin tables for given positions; caches inv_freq per device (not a module buffer,
    so that building the model on the meta device needs no special care)."""

    def __init__(self, cfg: ModelConfig):
        self._inv_cpu = inv_frequencies(cfg)
        self._inv = {}

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions: [B, T] int -> (cos, signed sin): [B, T, 1, head_dim] in dtype, the sine's
        first half negated (see :func:`apply_rotary`)."""
        dev = positions.device
        inv = self._inv.get(dev)
        if inv is None:
            inv = self._inv[dev] = self._inv_cpu.to(dev)
        freqs = positions.float()[..., None] * inv  # [B, T, D/2]
        sin = freqs.sin()
        return (torch.cat((freqs, freqs), dim=-1).cos().to(dtype)[:, :, None, :],
                torch.cat((-sin, sin), dim=-1).to(dtype)[:, :, None, :])


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin`` with the same products and sums:
    ``rotate_half(x) = cat(-x2, x1)`` is ``roll(x, D/2) = cat(x2, x1)`` times the sign that
    ``signed_sin = cat(-sin1, sin2)`` carries (a sign flip is exact): roll, two products
    and a sum, where rotate_half took chunk, neg and cat before them (twice per layer).

    x: [B, T, H, D]; cos / signed_sin: [B, T, 1, D] (from :class:`Rotary`)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin
