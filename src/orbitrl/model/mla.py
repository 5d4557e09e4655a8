"""DeepSeek-V3's multi-head latent attention (transformers' ``DeepseekV3Attention``).

Each token's keys and values come from one compressed row: ``kv_a_proj_with_mqa`` gives a
latent ``c`` [kv_lora_rank] (normed by ``kv_a_layernorm``) and one rotary key ``k_pe``
[rope] that every head shares; ``kv_b_proj`` expands ``c`` into each head's ``k_nope``
[nope] and ``v`` [v_dim]. A q/k head is ``nope + rope`` channels, rope last; queries come
from ``q_proj``, or ``q_b_proj(q_a_layernorm(q_a_proj(x)))`` with ``q_lora_rank``.

The row ``latent = cat(c, rotated k_pe)`` [kv_lora_rank + rope] is what the engine's paged
KV cache keeps per token and layer (one "head", no V): the backend gets it with
``expand=`` this module's :meth:`MLAttention.expand` and decompresses the gathered rows
through ``kv_b_proj`` at every step (a module call, so LoRA and frozen formats on
``kv_b_proj`` apply). The trainer's forward expands its own rows the same way.

``rope_interleave`` (transformers' default for this family): the rope channels come in
pairs (x0, x1), (x2, x3), ... and the rotated result is laid out evens first, then odds;
that is the usual rotate-half rotation of the de-interleaved channels (the same products
and sums), which is how it is computed here.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from orbitrl.model.attention import dense_attention
from orbitrl.model.config import ModelConfig
from orbitrl.model.moe import row_count
from orbitrl.model.rope import apply_rotary


class MLAttention(nn.Module):
    """Attention of one layer; the decoder's ``Attention`` interface (x [B, T, H] ->
    [B, T, H]). ``norm``: the decoder's RMSNorm class (for ``q_a_layernorm`` and
    ``kv_a_layernorm``, eps 1e-6 as in transformers whatever ``rms_norm_eps``)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, norm):
        super().__init__()
        m = cfg.mla
        self.layer_idx, self.nh, self.scale = layer_idx, cfg.num_heads, cfg.attn_scale
        self.nope, self.rope, self.v_dim, self.rank = m.nope, m.rope, m.v_dim, m.kv_lora_rank
        self.interleave = m.interleave
        h, qk = cfg.hidden_size, m.nope + m.rope
        if m.q_lora_rank:
            self.q_a_proj = nn.Linear(h, m.q_lora_rank, bias=m.bias)
            self.q_a_layernorm = norm(m.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(m.q_lora_rank, self.nh * qk, bias=False)
        else:
            self.q_proj = nn.Linear(h, self.nh * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, m.kv_lora_rank + m.rope, bias=m.bias)
        self.kv_a_layernorm = norm(m.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, self.nh * (m.nope + m.v_dim), bias=False)
        self.o_proj = nn.Linear(self.nh * m.v_dim, h, bias=m.bias)

    def forward(self, x, cos, sin, masks, attn=None):
        B, T, _ = x.shape
        if "q_proj" in self._modules:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(B, T, self.nh, self.nope + self.rope).split(
            (self.nope, self.rope), -1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split((self.rank, self.rope), -1)
        c, k_pe = self.kv_a_layernorm(c), k_pe.view(B, T, 1, self.rope)
        if self.interleave:  # pairs -> halves (evens, then odds): rotate-half applies
            q_pe, k_pe = (torch.cat((t[..., 0::2], t[..., 1::2]), -1) for t in (q_pe, k_pe))
        q = torch.cat((q_nope, apply_rotary(q_pe, cos, sin)), -1)  # [B, T, Hq, nope + rope]
        latent = torch.cat((c.view(B, T, 1, self.rank), apply_rotary(k_pe, cos, sin)), -1)
        if attn is not None:  # the engine: the latent goes to its cache, expanded there
            out = attn(self.layer_idx, q, latent, None, expand=self.expand)
        else:
            k, v = self.expand(latent)
            out = dense_attention(q, k, v, masks(None), self.scale, masks.exact)
        return self.o_proj(out.reshape(B, T, self.nh * self.v_dim))

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows [..., 1, kv_lora_rank + rope] -> (k [..., Hq, nope + rope],
        v [..., Hq, v_dim]): ``kv_b_proj`` on c, the one k_pe beside every head's k_nope.

        On a CPU a few rows go through the GEMM padded to ``moe.row_count`` rows: the engine
        expands each context it gathers (one row for a one-token prompt), the trainer its
        whole batch, and a GEMM of few rows rounds a row differently (docs/moe.md)."""
        lead = latent.shape[:-2]
        c = latent[..., 0, :self.rank].reshape(-1, self.rank)
        m = c.shape[0]
        if c.device.type == "cpu" and row_count(m) != m:
            kv = self.kv_b_proj(F.pad(c, (0, 0, 0, row_count(m) - m)))[:m]
        else:
            kv = self.kv_b_proj(c)
        kv = kv.view(*lead, self.nh, self.nope + self.v_dim)
        k_nope, v = kv.split((self.nope, self.v_dim), -1)
        k_pe = latent[..., self.rank:].expand(*lead, self.nh, self.rope)
        return torch.cat((k_nope, k_pe), -1), v
