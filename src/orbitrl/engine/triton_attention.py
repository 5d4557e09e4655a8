"""Triton kernels behind ``attention_kernels`` (imported only when the Triton backend runs).

Every kernel shares one inner loop, :func:`_attend`: a set of query rows (the G query heads
of one kv head, for one or more query positions) against key positions ``[k_start, k_end)``
of one sequence, read in place through its block table, with an online softmax in fp32.
K/V are never gathered into a contiguous copy. fp8 e4m3 bits are decoded in the kernel and
their per-(token, head) scales are applied to the scores and probabilities, not to the tiles.
Attention sinks (gpt-oss: a logit per query head in the softmax's denominator, in log2
units here) join where a row's softmax is finished: :func:`_with_sink` before a direct
store, or the reduce kernel over the split partials.

Triton decides at decoration time whether a kernel is compiled or interpreted: on CPU
tensors these kernels need ``TRITON_INTERPRET=1`` set before this module is imported.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from orbitrl.engine.paged_common import auto_splits

try:
    from triton import knobs

    INTERPRETED = bool(knobs.runtime.interpret)
except ImportError:  # Triton before 3.4 reads the variable directly
    INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
LOG2E = 1.4426950408889634
# a CUDA architecture (e.g. 90) while ``triton_aot`` compiles these kernels for it on a host
# without a GPU: the launches then take the GPU's tile sizes on CPU tensors
COMPILE_FOR: int | None = None


def _gpu(q) -> bool:
    return q.is_cuda or COMPILE_FOR is not None


@triton.jit
def _fp8_to_f16(bits):
    """uint8 e4m3fn bits -> fp16 holding value / 256, exactly (sign to bit 15, exponent and
    mantissa shifted into fp16's fields; e4m3's bias 7 vs fp16's 15 is the 2**-8)."""
    b = bits.to(tl.int32)
    h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return h.to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def _attend(q, qpos, row_lo, K, V, KS, VS, bt_row, k_start, k_end, h, qk_scale,
            HKV: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
            FP8: tl.constexpr, DOT: tl.constexpr):
    """Online softmax of ``q`` [ROWS, BLOCK_D] over key positions [k_start, k_end), with
    the matmuls' operands in dtype DOT and fp32 accumulation.

    Row r may attend position p iff row_lo[r] <= p <= qpos[r] (causal and window). Returns
    (acc [ROWS, BLOCK_D] unnormalized, l [ROWS] softmax denominators, m [ROWS] running max
    in log2 units); a row that attended nothing has l == 0.
    """
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    m = tl.full([ROWS], -1e30, tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    q = q.to(DOT)
    for kb in range(k_start, k_end, BLOCK_N):
        kpos = kb + tl.arange(0, BLOCK_N)
        kin = kpos < k_end
        blk = tl.load(bt_row + kpos // BLOCK_SIZE, mask=kin, other=0).to(tl.int64)
        slot = blk * BLOCK_SIZE + kpos % BLOCK_SIZE
        off = slot[:, None] * (HKV * D) + h * D + offs_d[None, :]
        tmask = kin[:, None] & dmask[None, :]
        k = tl.load(K + off, mask=tmask, other=0)
        v = tl.load(V + off, mask=tmask, other=0)
        if FP8:
            k = _fp8_to_f16(k)
            v = _fp8_to_f16(v)
        s = tl.dot(q, tl.trans(k.to(DOT)), input_precision="ieee")  # [ROWS, BLOCK_N]
        if FP8:
            ks = tl.load(KS + slot * HKV + h, mask=kin, other=0.0)
            s = s * (ks * 256.0)[None, :]
        ok = kin[None, :] & (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] >= row_lo[:, None])
        s = tl.where(ok, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        if FP8:
            vs = tl.load(VS + slot * HKV + h, mask=kin, other=0.0)
            p = p * (vs * 256.0)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v.to(DOT), input_precision="ieee")
        m = m_new
    return acc, l, m


@triton.jit
def _with_sink(acc, l, m, sink):
    """The rows' (acc, l, m) with ``sink`` [ROWS] (log2 units) added to the softmax's
    denominator, rescaled to the larger of m and the sink."""
    m_new = tl.maximum(m, sink)
    alpha = tl.exp2(m - m_new)
    return acc * alpha[:, None], l * alpha + tl.exp2(sink - m_new), m_new


@triton.jit
def _finish(acc, l, m, out_ptrs, omask, lse_ptrs, rmask, DIRECT: tl.constexpr):
    """Store acc / l (zeros where l == 0) and, unless DIRECT, the row's log2-sum-exp."""
    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptrs, o.to(out_ptrs.dtype.element_ty), mask=omask)
    if not DIRECT:
        lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
        tl.store(lse_ptrs, lse, mask=rmask)


@triton.jit
def _decode_kernel(Q, K, V, KS, VS, BT, CTX, BEGIN, OUT, LSE, SINKS, qk_scale, window,
                   max_blocks, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_BASE: tl.constexpr,
                   NUM_SLOTS: tl.constexpr, FP8: tl.constexpr, DOT: tl.constexpr,
                   HAS_BEGIN: tl.constexpr, HAS_WINDOW: tl.constexpr, DIRECT: tl.constexpr,
                   HAS_SINKS: tl.constexpr):
    """Program (row b, kv head h, split s): the G query heads of h over split s of row b's
    keys [lo, ctx). DIRECT writes OUT [B, HQ, D] (with the SINKS [HQ] when HAS_SINKS);
    otherwise OUT is the partial buffer [B, HQ, NUM_SLOTS, D] (fp32) and LSE
    [B, HQ, NUM_SLOTS] at slot SPLIT_BASE + s."""
    b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    G: tl.constexpr = HQ // HKV
    ctx = tl.load(CTX + b)
    lo = 0
    if HAS_BEGIN:
        lo = tl.load(BEGIN + b)
    if HAS_WINDOW:
        lo = tl.maximum(lo, ctx - window)
    tiles = tl.cdiv(tl.maximum(ctx - lo, 0), BLOCK_N)
    per = tl.cdiv(tiles, NUM_SPLITS)
    k_start = lo + s * per * BLOCK_N
    k_end = tl.minimum(k_start + per * BLOCK_N, ctx)

    offs_g = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    rmask = offs_g < G
    heads = h * G + offs_g
    q = tl.load(Q + b * HQ * D + heads[:, None] * D + offs_d[None, :],
                mask=rmask[:, None] & (offs_d[None, :] < D), other=0)
    qpos = tl.zeros([BLOCK_H], tl.int32) + ctx - 1
    acc, l, m = _attend(q, qpos, qpos * 0 + lo, K, V, KS, VS, BT + b * max_blocks, k_start,
                        k_end, h, qk_scale, HKV, D, BLOCK_SIZE, BLOCK_N, BLOCK_D, BLOCK_H, FP8, DOT)
    omask = rmask[:, None] & (offs_d[None, :] < D)
    if DIRECT:
        if HAS_SINKS:
            acc, l, m = _with_sink(acc, l, m, tl.load(SINKS + heads, mask=rmask, other=0.0))
        out_ptrs = OUT + b * HQ * D + heads[:, None] * D + offs_d[None, :]
        _finish(acc, l, m, out_ptrs, omask, LSE, rmask, True)
    else:
        row = (b * HQ + heads) * NUM_SLOTS + SPLIT_BASE + s
        _finish(acc, l, m, OUT + row[:, None] * D + offs_d[None, :], omask, LSE + row, rmask,
                False)


@triton.jit
def _shared_prefix_kernel(Q, K, V, KS, VS, BT, CTX, OFFSETS, SHARED, PART, LSE, qk_scale,
                          window, max_blocks,
                          HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                          BLOCK_SIZE: tl.constexpr, G_PAD: tl.constexpr,
                          MAX_GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_D: tl.constexpr, NUM_SLOTS: tl.constexpr, FP8: tl.constexpr,
                          DOT: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Program (group g, kv head h): every member's G query heads (MAX_GROUP * G_PAD rows)
    over the group's shared leading keys [0, SHARED[g]), read once through the first
    member's block table. Writes slot 0 of the partial buffers for each member row."""
    g, h = tl.program_id(0), tl.program_id(1)
    G: tl.constexpr = HQ // HKV
    ROWS: tl.constexpr = MAX_GROUP * G_PAD
    first = tl.load(OFFSETS + g)
    n = tl.load(OFFSETS + g + 1) - first
    if n > 0:
        shared = tl.load(SHARED + g)
        r = tl.arange(0, ROWS)
        j, gi = r // G_PAD, r % G_PAD
        rmask = (j < n) & (gi < G)
        b = first + j
        heads = h * G + gi
        ctx = tl.load(CTX + b, mask=j < n, other=1)
        qpos = ctx - 1
        row_lo = qpos * 0
        if HAS_WINDOW:
            row_lo = tl.maximum(ctx - window, 0)
        k_start = tl.min(tl.where(rmask, row_lo, shared), 0)
        offs_d = tl.arange(0, BLOCK_D)
        q = tl.load(Q + b[:, None] * HQ * D + heads[:, None] * D + offs_d[None, :],
                    mask=rmask[:, None] & (offs_d[None, :] < D), other=0)
        acc, l, m = _attend(q, qpos, row_lo, K, V, KS, VS, BT + first * max_blocks, k_start,
                            shared, h, qk_scale, HKV, D, BLOCK_SIZE, BLOCK_N, BLOCK_D, ROWS,
                            FP8, DOT)
        row = (b * HQ + heads) * NUM_SLOTS
        omask = rmask[:, None] & (offs_d[None, :] < D)
        _finish(acc, l, m, PART + row[:, None] * D + offs_d[None, :], omask, LSE + row, rmask,
                False)


@triton.jit
def _reduce_kernel(PART, LSE, OUT, SINKS, HQ: tl.constexpr, D: tl.constexpr,
                   BLOCK_D: tl.constexpr, NUM_SLOTS: tl.constexpr, BLOCK_S: tl.constexpr,
                   HAS_SINKS: tl.constexpr):
    """Program (row b, query head): combine the NUM_SLOTS partial outputs by their log2-sum-
    exp weights, the head's sink in the denominator when HAS_SINKS; a row with nothing
    attended gets zeros."""
    b, hq = tl.program_id(0), tl.program_id(1)
    row = b * HQ + hq
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    smask = offs_s < NUM_SLOTS
    lse = tl.load(LSE + row * NUM_SLOTS + offs_s, mask=smask, other=float("-inf"))
    mx = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(SINKS + hq)
        mx = tl.maximum(mx, sink)
    w = tl.where(lse > float("-inf"), tl.exp2(lse - tl.where(mx > float("-inf"), mx, 0.0)), 0.0)
    part = tl.load(PART + (row * NUM_SLOTS + offs_s[:, None]) * D + offs_d[None, :],
                   mask=smask[:, None] & (offs_d[None, :] < D), other=0.0)
    tot = tl.sum(w, 0)
    if HAS_SINKS:
        tot += tl.exp2(sink - mx)
    o = tl.sum(part * w[:, None], 0) / tl.where(tot > 0, tot, 1.0)
    tl.store(OUT + row * D + offs_d, o.to(OUT.dtype.element_ty), mask=offs_d < D)


@triton.jit
def _prefill_kernel(Q, K, V, KS, VS, BT, OUT, SINKS, qk_scale, window, start, T,
                    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
                    DOT: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Program (query tile i, kv head h): BLOCK_M query positions x the G query heads of h
    (rows = BLOCK_M * G_PAD) over the paged prefix and the chunk, causal (the SINKS [HQ]
    in each row's denominator when HAS_SINKS)."""
    i, h = tl.program_id(0), tl.program_id(1)
    G: tl.constexpr = HQ // HKV
    ROWS: tl.constexpr = BLOCK_M * G_PAD
    r = tl.arange(0, ROWS)
    t = i * BLOCK_M + r // G_PAD
    gi = r % G_PAD
    rmask = (t < T) & (gi < G)
    heads = h * G + gi
    qpos = start + t
    row_lo = qpos * 0
    k_start = 0
    if HAS_WINDOW:
        row_lo = tl.maximum(qpos - window + 1, 0)
        k_start = tl.maximum(start + i * BLOCK_M - window + 1, 0)
    k_end = tl.minimum(start + (i + 1) * BLOCK_M, start + T)
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(Q + t[:, None] * HQ * D + heads[:, None] * D + offs_d[None, :],
                mask=rmask[:, None] & (offs_d[None, :] < D), other=0)
    acc, l, m = _attend(q, qpos, row_lo, K, V, KS, VS, BT, k_start, k_end, h, qk_scale,
                        HKV, D, BLOCK_SIZE, BLOCK_N, BLOCK_D, ROWS, FP8, DOT)
    if HAS_SINKS:
        acc, l, m = _with_sink(acc, l, m, tl.load(SINKS + heads, mask=rmask, other=0.0))
    out_ptrs = OUT + t[:, None] * HQ * D + heads[:, None] * D + offs_d[None, :]
    _finish(acc, l, m, out_ptrs, rmask[:, None] & (offs_d[None, :] < D), OUT, rmask, True)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _kv(k_cache, v_cache, k_scale, v_scale):
    """(K, V, KS, VS, FP8) launch arguments; unused scale pointers point at the cache."""
    for t in (k_cache, v_cache) + ((k_scale, v_scale) if k_scale is not None else ()):
        if not t.is_contiguous():
            raise ValueError("paged attention: the KV cache and its scales must be contiguous")
    if k_scale is None:
        return k_cache, v_cache, k_cache, v_cache, False
    if k_cache.dtype != torch.uint8:
        raise ValueError("fp8 KV is passed as uint8 bits with k_scale / v_scale")
    return k_cache, v_cache, k_scale, v_scale, True


def _check_device(q):
    if q.device.type == "cpu" and not INTERPRETED and COMPILE_FOR is None:
        raise RuntimeError("the Triton backend on CPU tensors runs in Triton's interpreter: set "
                           "TRITON_INTERPRET=1 before orbitrl.engine.triton_attention is imported")


def _dot_dtype(q):
    """The matmuls' operand dtype: q's, except bf16 under the interpreter, whose tl.dot
    multiplies bf16 bit patterns (it stores bf16 as uint16); fp32 there instead."""
    if q.dtype == torch.bfloat16:
        return tl.float32 if INTERPRETED else tl.bfloat16
    return {torch.float16: tl.float16, torch.float32: tl.float32}[q.dtype]


def _block_n(q) -> int:
    # 64 keys per tile on a GPU (32 for fp32 heads wider than 64: K and V tiles of
    # 64 x 128 fp32, pipelined, would crowd an SM's shared memory); 16 under the
    # interpreter, so small tests cross many tiles
    if not _gpu(q):
        return 16
    return 32 if q.dtype == torch.float32 and q.shape[-1] > 64 else 64


def _launch_opts(q) -> dict:
    # fp32 on 8 warps: on 4, the fp32 tiles (operands of FMA dots, not tensor cores) outgrow
    # 255 registers per thread; compiled for sm_90 (triton_aot), 128-wide fp32 heads spilled
    # 344-6888 bytes of stack per thread on 4 warps, 0-368 on 8 (bar fp8 KV's prefill).
    # Fewer pipeline stages did not remove the rest.
    if _gpu(q) and q.dtype == torch.float32:
        return dict(num_warps=8)
    return {}


def _sinks(sinks, q):
    """(pointer, HAS_SINKS): the sinks in log2 units as fp32, or q (never read)."""
    if sinks is None:
        return q, False
    return (sinks.detach().float() * LOG2E).contiguous(), True


def decode(q, k_cache, v_cache, block_tables, context_lens, *, block_size, scale, window,
           k_scale, v_scale, num_splits, groups, sinks=None):
    """See ``attention_kernels.paged_decode``; ``groups`` is a PrefixGroups or None."""
    _check_device(q)
    B, HQ, D = q.shape
    HKV = k_cache.shape[1]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    q = q.contiguous()
    bt, ctx = block_tables.contiguous(), context_lens.contiguous()
    K, V, KS, VS, fp8 = _kv(k_cache, v_cache, k_scale, v_scale)
    if num_splits is None:
        num_splits = auto_splits(B, HKV, bt.shape[1] * block_size, q.device)
    common = dict(HQ=HQ, HKV=HKV, D=D, BLOCK_SIZE=block_size, BLOCK_N=_block_n(q),
                  BLOCK_D=_pow2(D), FP8=fp8, DOT=_dot_dtype(q), HAS_WINDOW=window is not None,
                  **_launch_opts(q))
    qk_scale, win, nb = scale * LOG2E, int(window or 0), bt.shape[1]
    blk_h = max(16, _pow2(HQ // HKV))
    sk, has_sinks = _sinks(sinks, q)
    if groups is None and num_splits == 1:
        _decode_kernel[(B, HKV, 1)](q, K, V, KS, VS, bt, ctx, ctx, out, out, sk, qk_scale, win,
                                    nb, BLOCK_H=blk_h, NUM_SPLITS=1, SPLIT_BASE=0, NUM_SLOTS=1,
                                    HAS_BEGIN=False, DIRECT=True, HAS_SINKS=has_sinks,
                                    **common)
        return out
    slots = num_splits + (groups is not None)
    part = torch.empty(B, HQ, slots, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, HQ, slots, dtype=torch.float32, device=q.device)
    begin = ctx
    if groups is not None:
        begin = _shared_prefix(q, K, V, KS, VS, bt, ctx, groups, part, lse, qk_scale, win,
                               slots, common)
    _decode_kernel[(B, HKV, num_splits)](q, K, V, KS, VS, bt, ctx, begin, part, lse, sk,
                                         qk_scale, win, nb, BLOCK_H=blk_h,
                                         NUM_SPLITS=num_splits, SPLIT_BASE=slots - num_splits,
                                         NUM_SLOTS=slots, HAS_BEGIN=groups is not None,
                                         DIRECT=False, HAS_SINKS=False, **common)
    _reduce_kernel[(B, HQ)](part, lse, out, sk, HQ=HQ, D=D, BLOCK_D=_pow2(D), NUM_SLOTS=slots,
                            BLOCK_S=_pow2(slots), HAS_SINKS=has_sinks)
    return out


def _shared_prefix(q, K, V, KS, VS, bt, ctx, groups, part, lse, qk_scale, win, slots, common):
    """Run the group kernel into slot 0; returns each row's first unshared key position."""
    offsets, shared = groups.offsets.contiguous(), groups.shared_lens.contiguous()
    B, HQ, HKV = q.shape[0], common["HQ"], common["HKV"]
    g_pad = _pow2(HQ // HKV)
    g_pad = max(g_pad, 16 // groups.max_group)
    _shared_prefix_kernel[(shared.shape[0], HKV)](
        q, K, V, KS, VS, bt, ctx, offsets, shared, part, lse, qk_scale, win, bt.shape[1],
        G_PAD=g_pad, MAX_GROUP=groups.max_group, NUM_SLOTS=slots, **common)
    rows = torch.arange(B, dtype=offsets.dtype, device=q.device)
    row_group = torch.searchsorted(offsets[1:].contiguous(), rows, right=True)
    return shared[row_group.clamp_max(shared.shape[0] - 1)].to(torch.int32).contiguous()


def prefill(q, k_cache, v_cache, block_table, start, *, block_size, scale, window, k_scale,
            v_scale, sinks=None):
    """See ``attention_kernels.paged_prefill``."""
    _check_device(q)
    T, HQ, D = q.shape
    HKV = k_cache.shape[1]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    K, V, KS, VS, fp8 = _kv(k_cache, v_cache, k_scale, v_scale)
    g_pad = _pow2(HQ // HKV)
    rows = 64 if _gpu(q) else 16
    block_m = max(1, rows // g_pad)
    sk, has_sinks = _sinks(sinks, q)
    _prefill_kernel[(triton.cdiv(T, block_m), HKV)](
        q.contiguous(), K, V, KS, VS, block_table.contiguous(), out, sk, scale * LOG2E,
        int(window or 0), int(start), T, HQ=HQ, HKV=HKV, D=D, BLOCK_SIZE=block_size,
        G_PAD=g_pad, BLOCK_M=block_m, BLOCK_N=_block_n(q), BLOCK_D=_pow2(D), FP8=fp8,
        DOT=_dot_dtype(q), HAS_WINDOW=window is not None, HAS_SINKS=has_sinks,
        **_launch_opts(q))
    return out
