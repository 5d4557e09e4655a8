"""Greedy / temperature / top-k / top-p sampling over a batch, on the logits' device, with a
counter-based random stream.

Every row inverts the CDF of its distribution at one uniform ``u = hash(key, counter)``:
``key`` is fixed per sequence from (seed, sample index) and ``counter`` is the index of the
token being drawn within the completion. A uniform is a pure function of those integers,
computed on the device for the whole batch (no generator state, no host round trip), so a
seeded sequence draws the same uniforms whatever else is in the batch and whichever path
(the static decode runner or a mixed prefill step) computes it, and the whole step can be
captured in a CUDA graph. Tokens are the same as long as the logits are (a batched matmul
may round differently from a smaller one; a flip needs the uniform to fall within that
rounding of a CDF step: rare, not impossible).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from orbitrl.engine.sequence import SamplingParams

_M64 = (1 << 64) - 1
_C1, _C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's multipliers
_GOLD = 0x9E3779B97F4A7C15


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _mix_int(x: int) -> int:
    """splitmix64's finaliser on a Python int (mod 2**64)."""
    x &= _M64
    x = ((x ^ (x >> 30)) * _C1) & _M64
    x = ((x ^ (x >> 27)) * _C2) & _M64
    return x ^ (x >> 31)


def row_key(seed: int, sample: int) -> int:
    """The per-sequence stream key (a signed int64) of sample ``sample`` under ``seed``."""
    return _signed(_mix_int(_mix_int(int(seed) + _GOLD) ^ (int(sample) * _GOLD)))


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (products wrap; ``>>`` is arithmetic on
    int64, so each shift is masked to act as the logical shift of the uint64 original)."""
    x = (x ^ ((x >> 30) & ((1 << 34) - 1))) * _signed(_C1)
    x = (x ^ ((x >> 27) & ((1 << 37) - 1))) * _signed(_C2)
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def uniforms(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """keys, counters: [B] int64 -> [B] fp32 uniforms in (0, 1): ``(2k + 1) / 2**24`` for
    the hash's top 23 bits ``k`` (exact in fp32, never 0 or 1)."""
    h = _mix(keys ^ (counters * _signed(_GOLD)))
    return (((h >> 41) & ((1 << 23) - 1)) * 2 + 1).float() * 2.0 ** -24


def uniforms_host(keys: list[int], counters: list[int]) -> list[float]:
    """:func:`uniforms` computed in Python, to the same values (the hash on unsigned
    64-bit ints): for a step's rows on a CPU, where the 15 int64 tensor ops of the device
    form cost more than the arithmetic (each op is several microseconds in a decode step)."""
    out = []
    for k, c in zip(keys, counters):
        h = _mix_int((k & _M64) ^ ((c * _GOLD) & _M64))
        out.append((2 * (h >> 41) + 1) * 2.0 ** -24)
    return out


def filter_logits(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """x: [B, V] temperature-scaled logits; top_k [B] long (0 = off), top_p [B] float
    (1 = off). Tokens outside each row's top-k, then outside its top-p nucleus, become -inf
    (the most likely token always stays)."""
    v = x.shape[-1]
    srt, order = x.sort(-1, descending=True)
    ranks = torch.arange(v, device=x.device)[None]
    k = torch.where((top_k > 0) & (top_k < v), top_k, v)[:, None]
    remove = ranks >= k
    srt = srt.masked_fill(remove, float("-inf"))
    probs = srt.softmax(-1)
    remove |= (probs.cumsum(-1) - probs) >= top_p.to(x.dtype)[:, None]
    remove[:, 0] = False
    return torch.full_like(x, float("-inf")).scatter(-1, order,
                                                     srt.masked_fill(remove, float("-inf")))


BLOCK = 256  # vocabulary entries per block of the two-level inverse CDF


def _invert_cdf(w: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row, the first index where the running sum of the non-negative weights ``w``
    [B, V] reaches ``target`` [B] (clamped into (0, total], so a zero-weight index is never
    returned): an inverse CDF in two levels, block sums then one block's running sum, which
    reads ``w`` once instead of writing a [B, V] cumsum (4 ms at 128 x 32k on one core)."""
    b, v = w.shape
    nb = v // BLOCK
    sums = w[:, :nb * BLOCK].view(b, nb, BLOCK).sum(-1)
    if v % BLOCK:
        sums = torch.cat([sums, w[:, nb * BLOCK:].sum(-1, keepdim=True)], 1)
    cdf = sums.cumsum(-1)
    target = torch.minimum(target.clamp_min(1e-30), cdf[:, -1])
    blk = torch.searchsorted(cdf, target[:, None])[:, 0].clamp_max(cdf.shape[1] - 1)
    before = torch.where(blk > 0, cdf.gather(1, (blk - 1).clamp_min(0)[:, None])[:, 0], 0.0)
    cols = blk[:, None] * BLOCK + torch.arange(BLOCK, device=w.device)
    inner = w.gather(1, cols.clamp_max(v - 1)).masked_fill(cols >= v, 0.0).cumsum(-1)
    # rounding may leave the block's own sum a hair under cdf[blk] - cdf[blk - 1]
    rest = torch.minimum((target - before).clamp_min(1e-30), inner[:, -1])
    off = torch.searchsorted(inner, rest[:, None])[:, 0].clamp_max(BLOCK - 1)
    # NaN weights (a diverged policy) search past the end: keep the id in the vocabulary
    # (an id >= V would fail the next step's embedding, on CUDA as a device-side assert)
    return (blk * BLOCK + off).clamp_max(v - 1)


def sample_rows(logits: torch.Tensor, inv_temp: torch.Tensor, greedy: torch.Tensor,
                u: torch.Tensor, top_k: torch.Tensor | None = None,
                top_p: torch.Tensor | None = None, *, all_raw: bool = False,
                any_greedy: bool = True, work: torch.Tensor | None = None):
    """Draw one token per row with per-row parameters as tensors (no host work, no
    data-dependent branches: the static decode runner captures it in its graphs).

    Args:
        logits: [B, V] fp32.
        inv_temp: [B] fp32, 1 / temperature (any finite value on greedy rows).
        greedy: [B] bool, rows that take the argmax.
        u: [B] fp32 uniforms in (0, 1) (:func:`uniforms`).
        top_k, top_p: [B] filters, or None when no row filters (the filter sorts [B, V]).
        all_raw: the caller knows that every row samples at temperature 1, unfiltered (the
            RL default): the raw distribution's weights are reused instead of a second
            exp over [B, V] (the same bits: ``x * 1`` is ``x``), and with ``any_greedy``
            False the logprobs returned are the raw ones (what the general path selects
            for such rows) without computing them a second way.
        any_greedy: False when the caller knows no row is greedy (skips an argmax over
            [B, V]).
        work: optional fp32 buffer of at least 2 * B * V elements for the two [B, V]
            intermediates (the same kernels, writing there): on a CPU a fresh 4 MB tensor
            costs its page faults at every step (``sub`` and ``exp`` over [32, 32000] took
            1.7 and 2.5 ms in an engine step against 0.2 and 1.0 ms in place).
    Returns:
        tokens [B] long, logprobs [B] under the sampling distribution (0 for greedy rows),
        raw logprobs [B] (temperature 1, unfiltered).

    One pass takes ``exp((x - max) / T)`` and its row sums; the token inverts that
    distribution's CDF at ``u`` (for T = 1 rows it is the raw distribution, the RL
    default). A token's raw logprob is its logit minus the log-normaliser.
    """
    mx = logits.amax(-1, keepdim=True)
    if work is not None:
        n = logits.numel()
        shifted = torch.sub(logits, mx, out=work[:n].view(logits.shape))
        e = torch.exp(shifted, out=work[n:2 * n].view(logits.shape))
    else:
        shifted = logits - mx
        e = shifted.exp()
    raw_total = e.sum(-1)
    if all_raw and top_k is None:
        x, w, total = shifted, e, raw_total
    else:
        x = shifted * inv_temp[:, None]
        if top_k is not None:
            x = filter_logits(x, top_k, top_p)
        w = x.exp()
        total = w.sum(-1)
    drawn = _invert_cdf(w, u * total)
    tokens = torch.where(greedy, logits.argmax(-1), drawn) if any_greedy else drawn
    # (z_y - max) - log(sum): the trainer's order (train/logprobs.py); z_y - lse rounds at
    # lse's magnitude (SmolLM2's reach 38 in a chat reply: an ulp of 3.8e-6 past 32)
    raw = shifted.gather(1, tokens[:, None])[:, 0] - raw_total.log()
    if all_raw and top_k is None and not any_greedy:  # every row plain: lp is raw
        return tokens, raw, raw
    lp = x.gather(1, tokens[:, None])[:, 0] - total.log()
    plain = inv_temp == 1.0  # rows drawn from the raw distribution: lp is raw exactly
    if top_k is not None:
        plain &= ((top_k <= 0) | (top_k >= logits.shape[1])) & (top_p >= 1.0)
    lp = torch.where(plain, raw, lp)
    return tokens, torch.where(greedy, 0.0, lp), raw


def row_params(params: list[SamplingParams], device) -> dict:
    """Per-row sampling tensors for :func:`sample_rows` from a list of SamplingParams
    (the mixed-step path; the decode runner keeps these in its static buffers)."""
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    greedy = temps == 0
    out = dict(inv_temp=torch.where(greedy, 1.0, 1.0 / temps.clamp_min(1e-30)).to(device),
               greedy=greedy.to(device))
    if any(0 < p.top_k or p.top_p < 1 for p in params):
        out["top_k"] = torch.tensor([p.top_k for p in params], device=device)
        out["top_p"] = torch.tensor([p.top_p for p in params], dtype=torch.float32,
                                    device=device)
    return out


def sample(logits: torch.Tensor, params: list[SamplingParams], keys: list[int],
           counters: list[int], work: torch.Tensor | None = None):
    """Draw one token per row from per-row SamplingParams; row ``i`` uses the uniform of
    (``keys[i]``, ``counters[i]``). Returns what :func:`sample_rows` returns."""
    dev = logits.device
    if dev.type == "cpu":  # the same values, without a chain of tiny int64 ops
        u = torch.tensor(uniforms_host(keys, counters), dtype=torch.float32)
    else:
        u = uniforms(torch.tensor(keys, dtype=torch.long, device=dev),
                     torch.tensor(counters, dtype=torch.long, device=dev))
    raw = all(p.temperature == 1.0 and p.top_k <= 0 and p.top_p >= 1 for p in params)
    return sample_rows(logits.float(), u=u, **row_params(params, dev), all_raw=raw,
                       any_greedy=any(p.temperature == 0 for p in params), work=work)
