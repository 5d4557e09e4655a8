"""Paged attention over the KV pool: decode and chunked prefill, in Triton and in plain torch.

The Triton kernels (``engine/triton_attention.py``) read K/V blocks where they lie in the
pool, through each sequence's block table: no gather into a padded contiguous copy. Decode
runs one program per (sequence, kv head) that serves the kv head's G = Hq / Hkv query heads
together (K/V read once per group of query heads), with an online softmax in fp32, fp8 e4m3
decoded in the kernel with its per-(token, kv head) scales, and sliding windows that skip
the blocks wholly outside the window. Optional: split-K over long contexts (partial results
merged by a reduce kernel), prefix groups, in which the GRPO samples of one prompt read
their shared prompt blocks once per group, and attention sinks (gpt-oss: a logit per query
head that joins the softmax's denominator, added where a row's softmax is finished). The
torch functions are the reference and the CPU path; they gather a static
``max_blocks * block_size`` keys per row and mask, so they are CUDA-graph capturable too.

Backends: ``"torch"``, ``"triton"``, or ``"auto"`` (Triton when q is on CUDA and Triton is
installed, else torch). Triton on CPU tensors runs in Triton's interpreter, which must be
switched on with ``TRITON_INTERPRET=1`` before ``orbitrl.engine.triton_attention`` is first
imported (this module imports it only on the first Triton call); that is how the tests run
the kernels on CPU.

How the decode runner calls it (per layer, inside the captured graph):

    # static buffers of the bucket, overwritten in place before each replay:
    #   block_tables int32 [B, max_blocks] (a row's unused entries: any valid block, e.g. 0)
    #   context_lens int32 [B] (tokens including the one decoded now; 0 for padding rows)
    cache.write(layer, slot_mapping, k, v)             # the step's K/V first
    o = paged_decode(q, cache.k[layer], cache.v[layer], block_tables, context_lens,
                     block_size=cache.block_size, scale=scale, window=windows[layer],
                     k_scale=cache.k_scale[layer] if cache.fp8 else None,
                     v_scale=cache.v_scale[layer] if cache.fp8 else None)  # q, o: [B, Hq, D]

Everything it launches has static shapes (the split count depends only on the buffers'
shapes), does no host sync, and gives padding rows zeros. With GRPO groups, compute
``groups = shared_prefix_groups(block_tables, context_lens, block_size)`` once per step
(also capturable: torch ops, static shapes) and pass ``prefix_groups=groups`` to every layer.
Chunked prefill calls ``paged_prefill`` once per sequence chunk, outside the graphs.
"""

from __future__ import annotations

import importlib.util
from contextlib import nullcontext
from functools import lru_cache
from typing import NamedTuple

import torch

from orbitrl.engine.paged_common import dequantize
from orbitrl.model.attention import sdpa


class PrefixGroups(NamedTuple):
    """Decode rows that share leading KV blocks, as contiguous runs of rows.

    Group g is rows ``offsets[g] .. offsets[g + 1] - 1``; its first ``shared_lens[g]`` key
    positions are the same tokens for every member and are read through the first member's
    block table. ``offsets`` int32 [NG + 1] covers every row (0 .. B, unused trailing groups
    empty); ``shared_lens`` int32 [NG] is at most every member's context length;
    ``max_group`` (a power of two) bounds the members of any group.
    """
    offsets: torch.Tensor
    shared_lens: torch.Tensor
    max_group: int


def shared_prefix_groups(block_tables: torch.Tensor, context_lens: torch.Tensor,
                         block_size: int, max_group: int = 8) -> PrefixGroups:
    """Group consecutive rows whose first block is the same (a GRPO request's samples sit
    next to each other), at most ``max_group`` rows per group; a group shares the leading
    blocks common to all its members. Torch ops with static shapes (NG = B), no host sync.

    block_tables: int32 [B, max_blocks]; context_lens: int32 [B].
    """
    if max_group < 1 or max_group & (max_group - 1):
        raise ValueError(f"max_group must be a power of two, got {max_group}")
    B, nb = block_tables.shape
    dev = block_tables.device
    bt, ctx = block_tables.long(), context_lens.long()
    idx = torch.arange(B, device=dev)
    live = ctx > 0
    start = torch.ones(B, dtype=torch.bool, device=dev)
    start[1:] = ~(live[1:] & live[:-1] & (bt[1:, 0] == bt[:-1, 0]))
    run_first = torch.cummax(torch.where(start, idx, 0), 0).values
    start |= (idx - run_first) % max_group == 0
    first = torch.cummax(torch.where(start, idx, 0), 0).values  # each row's group leader
    gid = torch.cumsum(start.long(), 0) - 1
    # leading blocks equal to the leader's, counting only blocks both rows own
    nblk = (ctx + block_size - 1) // block_size
    col = torch.arange(nb, device=dev)[None]
    eq = (bt == bt[first]) & (col < nblk[:, None]) & (col < nblk[first][:, None])
    common = eq.long().cumprod(1).sum(1) * block_size
    common = torch.minimum(common, torch.minimum(ctx, ctx[first]))
    shared = torch.full((B,), 1 << 40, dtype=torch.long, device=dev)
    shared = shared.scatter_reduce(0, gid, common, "amin")
    count = torch.zeros(B, dtype=torch.long, device=dev).scatter_add_(0, gid, torch.ones_like(gid))
    shared = torch.where(count > 1, shared, 0)  # a lone row has nothing to share
    offsets = torch.cat([count.new_zeros(1), count.cumsum(0)])
    return PrefixGroups(offsets.to(torch.int32), shared.to(torch.int32), max_group)


@lru_cache(maxsize=1)
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _use_triton(q: torch.Tensor, backend: str) -> bool:
    if backend == "torch":
        return False
    if backend == "triton":
        return True
    if backend == "auto":
        return q.is_cuda and triton_available()
    raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")


def _on(q):
    """Triton launches on the current CUDA device: make it q's."""
    return torch.cuda.device(q.device) if q.is_cuda else nullcontext()


def _check(q, k_cache, k_scale, v_scale):
    if q.shape[-2] % k_cache.shape[1]:
        raise ValueError(f"{q.shape[-2]} query heads are not a multiple of {k_cache.shape[1]} "
                         "kv heads")
    if (k_scale is None) != (v_scale is None):
        raise ValueError("fp8 KV needs both k_scale and v_scale")


def paged_decode(q, k_cache, v_cache, block_tables, context_lens, *, block_size, scale,
                 window=None, k_scale=None, v_scale=None, backend="auto",
                 prefix_groups: PrefixGroups | None = None, num_splits: int | None = None,
                 sinks=None):
    """One decode query per sequence against its paged context.

    Args:
        q: [B, Hq, D]. k_cache, v_cache: one layer's pool [num_slots, Hkv, D] in the model
            dtype, or uint8 fp8 e4m3 bits with k_scale, v_scale [num_slots, Hkv, 1] fp32.
        block_tables: int32 [B, max_blocks]; slot = block * block_size + offset.
        context_lens: int32 [B], tokens in context including the one decoded (its K/V is
            already written); 0 marks a padding row, which returns zeros.
        window: sliding window: key position p is attended iff qpos - window < p <= qpos,
            qpos = context_len - 1. None: no window.
        prefix_groups: rows sharing leading blocks (see ``shared_prefix_groups``); Triton
            reads each group's shared blocks once. The result does not depend on it.
        num_splits: key splits per row for the Triton kernel (None: by batch size).
        sinks: [Hq] logits in each row's softmax denominator (gpt-oss), or None.
    Returns:
        [B, Hq, D] in q's dtype.
    """
    _check(q, k_cache, k_scale, v_scale)
    if _use_triton(q, backend):
        from orbitrl.engine import triton_attention  # optional: triton

        with _on(q):
            return triton_attention.decode(q, k_cache, v_cache, block_tables, context_lens,
                                           block_size=block_size, scale=scale, window=window,
                                           k_scale=k_scale, v_scale=v_scale,
                                           num_splits=num_splits, groups=prefix_groups,
                                           sinks=sinks)
    return paged_decode_torch(q, k_cache, v_cache, block_tables, context_lens,
                              block_size=block_size, scale=scale, window=window,
                              k_scale=k_scale, v_scale=v_scale, sinks=sinks)


def _gather(cache, scale, slots, dtype):
    """cache[slots] dequantized to ``dtype`` the way ``KVCache.read`` does it."""
    x = cache[slots]
    if scale is None:
        return x.to(dtype)
    return dequantize(x, scale[slots], dtype)


def paged_decode_torch(q, k_cache, v_cache, block_tables, context_lens, *, block_size, scale,
                       window=None, k_scale=None, v_scale=None, prefix_groups=None,
                       sinks=None):
    """Reference for ``paged_decode``: gathers every row's ``max_blocks * block_size`` slots
    and masks by context length, so its shapes are static (capturable). ``prefix_groups``
    is accepted and ignored: grouping changes only how the kernel reads the blocks."""
    _check(q, k_cache, k_scale, v_scale)
    B, hq, d = q.shape
    hkv, nb = k_cache.shape[1], block_tables.shape[1]
    ar = torch.arange(block_size, device=q.device)
    slots = (block_tables.long()[:, :, None] * block_size + ar).reshape(B, nb * block_size)
    k = _gather(k_cache, k_scale, slots, q.dtype).transpose(1, 2)  # [B, Hkv, C, D]
    v = _gather(v_cache, v_scale, slots, q.dtype).transpose(1, 2)
    ctx = context_lens.long()
    kpos = torch.arange(nb * block_size, device=q.device)[None]
    qpos = ctx[:, None] - 1
    mask = kpos <= qpos
    if window is not None:
        mask &= qpos - kpos < window
    mask[:, 0] |= ctx == 0  # keeps padding rows finite; zeroed below
    o = sdpa(q.view(B, hkv, hq // hkv, d), k, v, mask[:, None, None, :], scale, exact=False,
             sinks=None if sinks is None else sinks.view(hkv, hq // hkv))
    o = torch.where((ctx > 0)[:, None, None, None], o, 0.0)
    return o.reshape(B, hq, d)


def paged_prefill(q, k_cache, v_cache, block_table, start, *, block_size, scale, window=None,
                  k_scale=None, v_scale=None, backend="auto", sinks=None):
    """Chunked prefill of one sequence over its paged prefix.

    Args:
        q: [T, Hq, D] for positions start .. start + T - 1, whose K/V are already written.
        block_table: int32 [max_blocks] of the sequence (covering start + T tokens).
        start: int, tokens before the chunk. Other arguments as in ``paged_decode``.
    Returns:
        [T, Hq, D] in q's dtype: each position attends causally over positions 0 .. itself.
    """
    _check(q, k_cache, k_scale, v_scale)
    if _use_triton(q, backend):
        from orbitrl.engine import triton_attention  # optional: triton

        with _on(q):
            return triton_attention.prefill(q, k_cache, v_cache, block_table, start,
                                            block_size=block_size, scale=scale,
                                            window=window, k_scale=k_scale, v_scale=v_scale,
                                            sinks=sinks)
    return paged_prefill_torch(q, k_cache, v_cache, block_table, start, block_size=block_size,
                               scale=scale, window=window, k_scale=k_scale, v_scale=v_scale,
                               sinks=sinks)


def paged_prefill_torch(q, k_cache, v_cache, block_table, start, *, block_size, scale,
                        window=None, k_scale=None, v_scale=None, sinks=None):
    """Reference for ``paged_prefill``: gathers the start + T context slots and runs SDPA."""
    _check(q, k_cache, k_scale, v_scale)
    t, hq, d = q.shape
    ctx = int(start) + t
    pos = torch.arange(ctx, device=q.device)
    slots = block_table.long()[pos // block_size] * block_size + pos % block_size
    k = _gather(k_cache, k_scale, slots, q.dtype).transpose(0, 1)[None]  # [1, Hkv, C, D]
    v = _gather(v_cache, v_scale, slots, q.dtype).transpose(0, 1)[None]
    qpos = pos[int(start):, None]
    mask = pos[None] <= qpos
    if window is not None:
        mask &= qpos - pos[None] < window
    o = sdpa(q.transpose(0, 1)[None], k, v, mask[None, None], scale, exact=False,
             enable_gqa=hq != k.shape[1], sinks=None if sinks is None else sinks[:, None])
    return o[0].transpose(0, 1)
