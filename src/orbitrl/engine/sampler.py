"""Greedy / temperature / top-k / top-p sampling with per-sequence generators.

Sampling inverts the CDF of the row's distribution at one uniform drawn from the sequence's
own ``torch.Generator``: each row consumes exactly one draw per token from its own stream
(unseeded rows share the engine's generator), so a seeded sequence gets the same tokens
whatever else is in the batch, as long as its logits are the same (a batched matmul may
round differently from a smaller one; a flip needs the uniform to fall within that rounding
of a CDF step: rare, not impossible).
"""

from __future__ import annotations

import torch

from orbitrl.engine.sequence import SamplingParams


def filter_logits(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """x: [B, V] temperature-scaled logits; tokens outside each row's top-k, then outside
    its top-p nucleus, become -inf (the most likely token always stays)."""
    v = x.shape[-1]
    srt, order = x.sort(-1, descending=True)
    ranks = torch.arange(v, device=x.device)[None]
    k = torch.tensor([kk if 0 < kk < v else v for kk in top_k], device=x.device)[:, None]
    remove = ranks >= k
    srt = srt.masked_fill(remove, float("-inf"))
    p = torch.tensor(top_p, dtype=x.dtype, device=x.device)[:, None]
    probs = srt.softmax(-1)
    remove |= (probs.cumsum(-1) - probs) >= p
    remove[:, 0] = False
    return torch.full_like(x, float("-inf")).scatter(-1, order, srt.masked_fill(remove, float("-inf")))


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None], default: torch.Generator | None = None):
    """Draw one token per row.

    Args:
        logits: [B, V] fp32.
        params, generators: per row; a None generator draws from ``default``.
    Returns:
        tokens [B] long, logprobs [B] under the sampling distribution (0 for greedy rows),
        raw logprobs [B] (temperature 1, unfiltered).
    """
    b = logits.shape[0]
    raw = torch.log_softmax(logits, -1)
    rows = [i for i, p in enumerate(params) if p.temperature > 0]
    tokens = (logits.argmax(-1) if len(rows) < b
              else torch.empty(b, dtype=torch.long, device=logits.device))
    lp = torch.zeros(b, dtype=torch.float32, device=logits.device)
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        temps = torch.tensor([params[i].temperature for i in rows], device=logits.device)
        ks, ps = [params[i].top_k for i in rows], [params[i].top_p for i in rows]
        filtered = any(k > 0 for k in ks) or any(p < 1 for p in ps)
        if not filtered and all(params[i].temperature == 1 for i in rows):
            lps = raw if len(rows) == b else raw[idx]  # sampling distribution = raw one
        else:
            x = logits[idx] / temps[:, None]
            lps = torch.log_softmax(filter_logits(x, ks, ps) if filtered else x, -1)
        # inverse CDF: one uniform per row, from the row's own generator when it has one
        u = torch.rand(len(rows), generator=default)
        for j, i in enumerate(rows):
            if generators[i] is not None:
                u[j] = torch.rand(1, generator=generators[i])[0]
        cdf = lps.exp().cumsum(-1)
        u = (u.to(cdf.device) * cdf[:, -1]).clamp_min(1e-30)
        tok = torch.searchsorted(cdf, u[:, None])[:, 0].clamp_max(cdf.shape[1] - 1)
        tokens[idx] = tok
        lp[idx] = lps.gather(1, tok[:, None])[:, 0]
    return tokens, lp, raw.gather(1, tokens[:, None])[:, 0]
