"""Dense attention over the tokens of one forward call, with packing and sliding windows.

Sequences may be packed into one row: ``seq_ids`` [B, T] names the sequence each token
belongs to (-1 marks padding) and ``positions`` [B, T] its position inside that sequence.
A token attends to earlier tokens of its own sequence only, and, where ``parent_ids`` names
another sequence for it, to that sequence's earlier tokens too: several completions laid
after one copy of their shared prompt (a GRPO group) read that copy as their prefix. The engine replaces this with
attention over its paged KV cache through the ``attn`` backend argument of the decoder.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def build_mask(seq_ids: torch.Tensor, positions: torch.Tensor,
               window: int | None = None, parent_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean mask [B, 1, T, T]; True = may attend. ``parent_ids`` [B, T]: the sequence
    whose tokens (laid out earlier in the row) each token also sees as its prefix; a token's
    own id means none. ``positions`` must then continue from the prefix."""
    T = seq_ids.shape[1]
    idx = torch.arange(T, device=seq_ids.device)
    causal = idx[None, :, None] >= idx[None, None, :]  # [1, T, T]
    same = seq_ids[:, :, None] == seq_ids[:, None, :]  # [B, T, T]
    if parent_ids is not None:
        same |= (parent_ids[:, :, None] == seq_ids[:, None, :]) & (seq_ids >= 0)[:, None, :]
    mask = causal & same
    if window is not None:
        mask &= (positions[:, :, None] - positions[:, None, :]) < window
    # padding rows (seq_id -1) see only themselves, so softmax has no empty row
    eye = torch.eye(T, dtype=torch.bool, device=seq_ids.device)[None]
    mask |= eye & (seq_ids < 0)[:, :, None]
    return mask[:, None]


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """transformers' soft-capping ``tanh(x / cap) * cap`` (Gemma's attention scores and
    logits); ``cap`` None: x as it is."""
    if cap is None:
        return x
    return torch.tanh(x / cap) * cap


def softmax_with_sinks(s: torch.Tensor, sinks: torch.Tensor | None,
                       dtype: torch.dtype) -> torch.Tensor:
    """Softmax over the last dim of scores ``s``; with ``sinks`` (gpt-oss: one logit per
    query row, broadcastable to ``s.shape[:-1]``) each row's sink joins the denominator
    and its probability is dropped (transformers' eager gpt-oss attention)."""
    if sinks is None:
        return torch.softmax(s, -1, dtype=dtype)
    sink = sinks.to(s.dtype)[..., None].expand(*s.shape[:-1], 1)
    return torch.softmax(torch.cat([s, sink], -1), -1, dtype=dtype)[..., :-1]


def _explicit_attention(q, k, v, mask, scale: float, cap: float | None, exact: bool,
                        enable_gqa: bool, sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention with soft-capped scores or sinks, which SDPA cannot express: transformers'
    eager attention (scores scaled, capped, masked; softmax in fp32, with the sinks in its
    denominator, cast back to q's dtype before the product with v), in fp64 for fp32 CPU
    inputs with ``exact``. Shapes as in sdpa."""
    dt = q.dtype
    if enable_gqa and k.shape[-3] != q.shape[-3]:  # each kv head serves its group of q heads
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    wide = exact and dt == torch.float32 and q.device.type == "cpu"
    if wide:
        q, k, v = q.double(), k.double(), v.double()
    s = soft_cap((q @ k.transpose(-1, -2)) * scale, cap)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    p = softmax_with_sinks(s, sinks, torch.float64 if wide else torch.float32).to(q.dtype)
    return (p @ v).to(dt)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
         scale: float, exact: bool = True, enable_gqa: bool = False,
         softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on [..., H, T, D]; with ``exact``, fp32 inputs on
    a CPU are computed in fp64 and rounded back to fp32.

    Why: the engine attends over each sequence's own paged keys, the trainer over packed
    rows whose other sequences' keys are masked out, so fp32 SDPA reduces the same sums in
    different orders (its blocks and vector lanes follow the layout) and the two differ by
    ulps, which the layers above amplify into 1e-5..1e-4 of a sampled token's logprob. In
    fp64 the orders still differ but the rounded fp32 results agree (to 1 ulp at worst), so
    a rollout's logprobs are the trainer's to the bit wherever the rest of the model
    is row-invariant (docs/moe.md, "Routing replay").

    ``softcap``: the scores soft-capped before the mask (Gemma 2); ``sinks``: a logit per
    query row in each softmax's denominator (gpt-oss; broadcastable to [..., H, T]), both
    computed without SDPA (``_explicit_attention``: the [..., H, T, S] scores exist)."""
    if softcap is not None or sinks is not None:
        return _explicit_attention(q, k, v, mask, scale, softcap, exact, enable_gqa, sinks)
    if exact and q.dtype == torch.float32 and q.device.type == "cpu":
        out = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                             attn_mask=mask, scale=scale,
                                             enable_gqa=enable_gqa)
        return out.float()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=enable_gqa)


def decode_attention_exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           allowed: torch.Tensor, scale: float,
                           softcap: float | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per row over its gathered context, fp32 in and out, computed in fp64
    (what :func:`sdpa` with ``exact`` gives, to the rounding of the fp32 result).

    q: [B, Hkv, G, D] (the G query heads of a kv head as G queries of it); k, v: [B, C, Hkv, D]
    as gathered from a slot-major cache (v [B, C, Hkv, Dv]: MLA's values are narrower);
    allowed: bool, broadcastable to [B, Hkv, G, C] (every row allows at least one key);
    sinks (gpt-oss): [Hkv, G]. Returns [B, Hkv, G, Dv].

    Why not ``sdpa``: at a decode step's shapes (a few queries per head) two batched fp64
    GEMMs over the [B * Hkv] heads and a softmax, with the transposes folded into the fp64
    copies, cost less than fp64 SDPA's CPU kernel; in the small model's rollout the
    attention time moved from 1.07-1.14 s to 1.03-1.09 s (of about 5 s)."""
    b, c, hkv, d = k.shape
    g = q.shape[2]
    k64 = torch.empty(b, hkv, c, d, dtype=torch.float64, device=k.device)
    dv = v.shape[-1]
    v64 = torch.empty_like(k64) if dv == d else k64.new_empty(b, hkv, c, dv)
    k64.copy_(k.transpose(1, 2))
    v64.copy_(v.transpose(1, 2))
    s = torch.bmm(q.reshape(b * hkv, g, d).double(), k64.view(b * hkv, c, d).transpose(1, 2))
    s = soft_cap(s.view(b, hkv, g, c).mul_(scale), softcap)  # (Gemma 2: capped scores)
    s = s.masked_fill_(~allowed, float("-inf"))
    p = softmax_with_sinks(s, sinks, torch.float64).view(b * hkv, g, c)
    return torch.bmm(p, v64.view(b * hkv, c, dv)).view(b, hkv, g, dv).float()


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor | None, scale: float, exact: bool = True,
                    softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, T, Hq, D], k/v: [B, S, Hkv, D], mask: [B, 1, T, S] -> [B, T, Hq, D].
    ``exact``, ``softcap``: see :func:`sdpa`; ``sinks``: [Hq] (gpt-oss)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = sdpa(q, k, v, mask, scale, exact, enable_gqa=q.shape[1] != k.shape[1],
               softcap=softcap, sinks=None if sinks is None else sinks[:, None])
    return out.transpose(1, 2)
