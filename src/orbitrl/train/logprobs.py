"""Token logprobs and entropy without ever materialising the [tokens, vocab] logits.

The final hidden states are projected onto the vocabulary one (token chunk x vocab chunk)
tile at a time. Forward keeps, per token, a running max, the running sum of exp and the
running sum of exp * logit (online logsumexp), plus the target token's logit; backward
recomputes each tile and turns it straight into its contribution to the hidden-state and
weight gradients. Peak extra memory is one tile (``token_chunk x vocab_chunk`` fp32 values,
a few copies of it), whatever the vocabulary size.

One function serves scoring (under ``torch.no_grad()``: old/reference logprobs) and the
loss (with grad): the numbers are the same code path, so rollout/score/train agree up to
reduction order.

Maths, per token with logits z = (h @ W^T) / temperature, target y:
    lse = log sum_j exp z_j;  logprob = z_y - lse;  p = softmax(z)
    entropy H = lse - sum_j p_j z_j
    d logprob / dz = onehot(y) - p
    d H / dz       = -p * (z - lse + H)
With a final soft-cap c (Gemma), z = c * tanh((h @ W^T) / c) / temperature and the chain
rule adds the factor 1 - tanh^2 per logit.
"""

from __future__ import annotations

import torch

from orbitrl.errors import OrbitError
from orbitrl.model.attention import soft_cap
from orbitrl.model.gemm import head_gemm

VOCAB_CHUNK = 8192
TOKEN_CHUNK = 1024


def _tile(h: torch.Tensor, w: torch.Tensor, inv_t: float, cap: float | None,
          gemm=None) -> torch.Tensor:
    # h: [n, H], w: [v, H] -> fp32 logits [n, v] (soft-capped, scaled by 1/temperature);
    # gemm: model.gemm.head_gemm's oneDNN product (the rollout engine's rounding) or None
    z = h.float() @ w.float().t() if gemm is None else gemm(h.float(), w.float())
    if cap is not None:  # Gemma's final_logit_softcapping: attention.soft_cap, in place
        z = z.div_(cap).tanh_().mul_(cap)
    return z.mul_(inv_t) if inv_t != 1.0 else z


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_t, vocab_chunk, token_chunk, cap, gemm):
        # hidden: [N, H], weight: [V, H], targets: [N] (negative = ignored) -> [N], [N]
        N, V = hidden.shape[0], weight.shape[0]
        dev = hidden.device
        lse = torch.empty(N, dtype=torch.float32, device=dev)
        ent = torch.empty(N, dtype=torch.float32, device=dev)
        sel = torch.zeros(N, dtype=torch.float32, device=dev)
        valid = targets >= 0
        for t0 in range(0, N, token_chunk):
            t1 = min(N, t0 + token_chunk)
            h = hidden[t0:t1]
            y = targets[t0:t1]
            m = torch.full((t1 - t0,), float("-inf"), dtype=torch.float32, device=dev)
            s = torch.zeros(t1 - t0, dtype=torch.float32, device=dev)  # sum exp(z - m)
            sz = torch.zeros(t1 - t0, dtype=torch.float32, device=dev)  # sum exp(z - m) z
            for v0 in range(0, V, vocab_chunk):
                v1 = min(V, v0 + vocab_chunk)
                z = _tile(h, weight[v0:v1], inv_t, cap, gemm)  # [n, v]
                m_new = torch.maximum(m, z.max(dim=1).values)
                scale = torch.exp(m - m_new)
                e = torch.exp(z - m_new[:, None])
                s = s * scale + e.sum(dim=1)
                sz = sz * scale + (e * z).sum(dim=1)
                m = m_new
                hit = (y >= v0) & (y < v1)
                if hit.any():
                    idx = (y - v0).clamp(0, v1 - v0 - 1)
                    zy = z.gather(1, idx[:, None])[:, 0]
                    sel[t0:t1] = torch.where(hit, zy, sel[t0:t1])
                del z, e
            log_s = torch.log(s)
            lse[t0:t1] = m + log_s
            ent[t0:t1] = lse[t0:t1] - sz / s
            # (z_y - max) - log(sum), not z_y - lse: lse rounds at its magnitude (SmolLM2's
            # reach 38 in a chat reply: an ulp of 3.8e-6 past 32), and the rollout's sampler subtracts in
            # this order too (engine/sampler.py): the two round alike
            sel[t0:t1] = (sel[t0:t1] - m) - log_s
        logp = torch.where(valid, sel, torch.zeros_like(lse))
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.cfg = (inv_t, vocab_chunk, token_chunk, cap, gemm)
        ctx.mark_non_differentiable(targets)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        inv_t, vocab_chunk, token_chunk, cap, gemm = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        N, V = hidden.shape[0], weight.shape[0]
        dev = hidden.device
        g_logp = (torch.zeros(N, device=dev) if g_logp is None else g_logp.float())
        g_logp = torch.where(targets >= 0, g_logp, torch.zeros_like(g_logp))
        g_ent = torch.zeros(N, device=dev) if g_ent is None else g_ent.float()
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=dev) if need_h else None
        grad_w = None
        if need_w:  # in the weight's layout (a column-major head, model/decoder.py): autograd
            # then hands this buffer to .grad as it is instead of copying it into that layout
            col = weight.dim() == 2 and weight.t().is_contiguous() and not weight.is_contiguous()
            grad_w = (torch.zeros(weight.shape[::-1], dtype=torch.float32, device=dev).t() if col
                      else torch.zeros(weight.shape, dtype=torch.float32, device=dev))
        for t0 in range(0, N, token_chunk):
            t1 = min(N, t0 + token_chunk)
            h = hidden[t0:t1]
            y = targets[t0:t1]
            gl, ge = g_logp[t0:t1, None], g_ent[t0:t1, None]
            l, H = lse[t0:t1, None], ent[t0:t1, None]
            for v0 in range(0, V, vocab_chunk):
                v1 = min(V, v0 + vocab_chunk)
                w = weight[v0:v1]
                z = _tile(h, w, inv_t, cap, gemm)  # [n, v]
                # capped: d z / d (h @ w^T) = inv_t * (1 - tanh^2), tanh = z / (inv_t * cap)
                slope = None if cap is None else 1 - (z / (inv_t * cap)).square_()
                p = torch.exp(z - l)
                # dL/dz = gl * (onehot - p) - ge * p * (z - lse + H)
                dz = z.sub_(l).add_(H).mul_(ge).add_(gl).mul_(p).neg_()
                del p
                hit = (y >= v0) & (y < v1)
                if hit.any():
                    rows = hit.nonzero()[:, 0]
                    dz[rows, y[rows] - v0] += gl[rows, 0]
                if inv_t != 1.0:
                    dz.mul_(inv_t)
                if slope is not None:
                    dz.mul_(slope)
                    del slope
                if need_h:
                    grad_h[t0:t1].addmm_(dz, w.float())
                if need_w:
                    grad_w[v0:v1].addmm_(dz.t(), h.float())
                del dz
        return (grad_h.to(hidden.dtype) if need_h else None,
                grad_w.to(weight.dtype) if need_w else None, None, None, None, None, None,
                None)


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                   temperature: float = 1.0, with_entropy: bool = False,
                   vocab_chunk: int = VOCAB_CHUNK, token_chunk: int = TOKEN_CHUNK,
                   softcap: float | None = None):
    """Log-probability of each target token (and the entropy of each next-token distribution)
    under ``softmax(hidden @ weight.T / temperature)``, computed tile by tile; with
    ``softcap`` the logits are ``softcap * tanh(hidden @ weight.T / softcap)`` first (Gemma's
    ``final_logit_softcapping``: ``model.config.final_softcap``, as ``Decoder.head``).

    Args:
        hidden: [..., H] final normed hidden states (``model(..., return_hidden=True)``).
        weight: [V, H] vocabulary projection (``model.lm_head.weight``).
        targets: [...] token ids, same leading shape as ``hidden``; a negative id marks a
            position to ignore (its logprob is 0 and sends no gradient; its entropy is still
            computed).
        temperature: the sampling temperature the logprobs refer to (> 0).
        with_entropy: also return the entropy.
        vocab_chunk, token_chunk: tile size; peak extra memory ~ 4 * token_chunk *
            vocab_chunk * 4 bytes.
    Returns:
        logprobs [...] fp32, or (logprobs, entropy) with ``with_entropy``. Differentiable
        in ``hidden`` and ``weight``.
    """
    if temperature <= 0:
        raise OrbitError(f"temperature must be > 0 for logprobs, got {temperature}")
    if vocab_chunk < 1 or token_chunk < 1:
        raise OrbitError("vocab_chunk and token_chunk must be >= 1")
    if hidden.shape[:-1] != targets.shape or hidden.shape[-1] != weight.shape[-1]:
        raise OrbitError(f"shape mismatch: hidden {tuple(hidden.shape)}, weight "
                         f"{tuple(weight.shape)}, targets {tuple(targets.shape)}")
    lead = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1).long()
    if y.numel() and int(y.max()) >= weight.shape[0]:
        raise OrbitError(f"target id {int(y.max())} >= vocab size {weight.shape[0]}")
    logp, ent = _ChunkedLogprobs.apply(h, weight, y, 1.0 / temperature, vocab_chunk,
                                       token_chunk, softcap, head_gemm(weight))
    logp, ent = logp.view(lead), ent.view(lead)
    return (logp, ent) if with_entropy else logp


def model_logprobs(model, input_ids: torch.Tensor, targets: torch.Tensor, *,
                   positions=None, seq_ids=None, temperature: float = 1.0,
                   with_entropy: bool = False, vocab_chunk: int = VOCAB_CHUNK,
                   token_chunk: int = TOKEN_CHUNK):
    """Run the decoder to its final hidden states and score ``targets`` chunk by chunk.

    Args:
        model: an orbitrl ``Decoder``.
        input_ids: [B, T]; positions / seq_ids as in ``Decoder.forward`` (packed rows).
        targets: [B, T] the token each position predicts (usually ``input_ids`` shifted
            left by one within each sequence), negative where nothing is predicted.
    Returns:
        logprobs [B, T] (and entropy [B, T] with ``with_entropy``).
    """
    hidden = model(input_ids, positions=positions, seq_ids=seq_ids, return_hidden=True)
    return token_logprobs(hidden, model.lm_head.weight, targets, temperature=temperature,
                          with_entropy=with_entropy, vocab_chunk=vocab_chunk,
                          token_chunk=token_chunk,
                          softcap=getattr(model.config, "final_softcap", None))


def naive_token_logprobs(hidden, weight, targets, temperature: float = 1.0,
                         softcap: float | None = None):
    """Reference path that materialises [N, V] logits (for tests and the benchmark)."""
    z = soft_cap(hidden.float() @ weight.float().t(), softcap) / temperature
    lp_all = torch.log_softmax(z, dim=-1)
    y = targets.long()
    logp = lp_all.gather(-1, y.clamp(min=0)[..., None])[..., 0]
    logp = torch.where(y >= 0, logp, torch.zeros_like(logp))
    ent = -(lp_all.exp() * lp_all).sum(-1)
    return logp, ent
