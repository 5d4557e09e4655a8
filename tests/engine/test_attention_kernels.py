"""Paged attention kernels against their torch references and the engine's PagedAttention.

Without CUDA the Triton kernels run in Triton's interpreter on CPU (switched on below,
before the kernel module is imported); with CUDA the same tests run the compiled kernels,
and the ``gpu`` tests add bf16 shapes of a real model and a timing check.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from orbitrl.engine.attention_kernels import (  # noqa: E402
    _use_triton, paged_decode, paged_decode_torch, paged_prefill, paged_prefill_torch, shared_prefix_groups)
from orbitrl.engine.paged_attention import KVCache, PagedAttention  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = dict(atol=2e-5, rtol=1e-5)  # fp32: only the summation order differs


def _pool(hkv, d, num_blocks, bs, fp8, dtype=torch.float32, seed=0):
    """A one-layer pool with every slot written (through quantization when fp8)."""
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(1, hkv, d, num_blocks, bs, dtype, DEV, fp8=fp8)
    n = num_blocks * bs
    k, v = (torch.randn(n, hkv, d, generator=g).to(DEV) for _ in range(2))
    cache.write(0, torch.arange(n, device=DEV), k, v)
    return cache


def _tables(ctx, bs, max_blocks, num_blocks, seed=0):
    """Each row gets its own blocks in shuffled pool order; unused entries are 0."""
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    bt = torch.zeros(len(ctx), max_blocks, dtype=torch.int32)
    for i, c in enumerate(ctx):
        n = -(-c // bs)
        bt[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    return bt.to(DEV)


def _kw(cache, bs, window=None):
    scales = dict(k_scale=cache.k_scale[0], v_scale=cache.v_scale[0]) if cache.fp8 else {}
    return dict(block_size=bs, scale=0.3, window=window, **scales)


def _decode_both(cache, q, bt, ctx, bs, window, **extra):
    kw = _kw(cache, bs, window)
    ref = paged_decode_torch(q, cache.k[0], cache.v[0], bt, ctx, **kw)
    out = paged_decode(q, cache.k[0], cache.v[0], bt, ctx, backend="triton", **kw, **extra)
    return out, ref


def _engine_decode(cache, q, bt, ctx, bs, window):
    """The engine's gather + SDPA path on the live rows; it writes the decoded token's K/V
    itself, so we hand it what the pool already holds there (a no-op write unless fp8)."""
    live = [i for i, c in enumerate(ctx.tolist()) if c > 0]
    items = [(bt[i, :-(-int(ctx[i]) // bs)].tolist(), int(ctx[i]) - 1, 1) for i in live]
    attn = PagedAttention.build(cache, [window], 0.3, items)
    k, v = cache.read(0, attn.slot_mapping)
    return live, attn(0, q[live][None], k[None], v[None])[0]


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_decode_matches_references(group, fp8, window):
    bs, hkv, d = 4, 2, 16
    ctx = torch.tensor([1, 13, 0, 29, 8, 4], dtype=torch.int32, device=DEV)  # 0: padding row
    cache = _pool(hkv, d, 40, bs, fp8, seed=group)
    bt = _tables(ctx.tolist(), bs, 9, 40, seed=group)
    q = torch.randn(len(ctx), hkv * group, d, device=DEV)
    out, ref = _decode_both(cache, q, bt, ctx, bs, window)
    assert out.dtype == q.dtype and not out.isnan().any()
    torch.testing.assert_close(out, ref, **TOL)
    assert (out[2] == 0).all()
    if not fp8:  # fp8: the engine path re-quantizes the decoded token's K/V when it writes it
        live, eng = _engine_decode(cache, q, bt, ctx, bs, window)
        torch.testing.assert_close(out[live], eng, **TOL)


def test_decode_engine_path_fp8():
    """Against PagedAttention with fp8: run it first (it writes the token's K/V), then the
    kernel over the pool it left."""
    bs, hkv, d, group = 4, 2, 16, 2
    ctx = torch.tensor([5, 18, 1], dtype=torch.int32, device=DEV)
    cache = _pool(hkv, d, 16, bs, True, seed=3)
    bt = _tables(ctx.tolist(), bs, 5, 16, seed=3)
    q = torch.randn(3, hkv * group, d, device=DEV)
    live, eng = _engine_decode(cache, q, bt, ctx, bs, None)
    out, ref = _decode_both(cache, q, bt, ctx, bs, None)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(out, eng, **TOL)


def test_odd_shapes():
    """Qwen2-0.5B's 7 query heads per kv head, a head dim and a block size that are not
    powers of two: decode (plain, split, grouped) and prefill."""
    bs, hkv, d, group = 3, 2, 24, 7
    bt, ctx = _grpo_tables(bs, 3, [[4, 7], [2]], 40, seed=8)
    cache = _pool(hkv, d, 40, bs, True, seed=8)
    q = torch.randn(len(ctx), hkv * group, d, device=DEV)
    groups = shared_prefix_groups(bt, ctx, bs, max_group=2)
    for extra in ({}, {"num_splits": 2}, {"prefix_groups": groups}):
        out, ref = _decode_both(cache, q, bt, ctx, bs, 5, **extra)
        torch.testing.assert_close(out, ref, **TOL)
    kw = _kw(cache, bs, None)
    qp = torch.randn(int(ctx[1]) - 4, hkv * group, d, device=DEV)
    out = paged_prefill(qp, cache.k[0], cache.v[0], bt[1], 4, backend="triton", **kw)
    torch.testing.assert_close(out, paged_prefill_torch(qp, cache.k[0], cache.v[0], bt[1], 4, **kw),
                               **TOL)


@pytest.mark.parametrize("fp8", [False, True])
def test_bf16(fp8):
    """A bf16 model: the kernels against the fp32 reference over the same stored K/V (the
    reference dequantizes fp8 to bf16 first, so it is compared in fp32 throughout)."""
    bs, hkv, d, group = 4, 2, 16, 2
    ctx = torch.tensor([21, 0, 6], dtype=torch.int32, device=DEV)
    cache = _pool(hkv, d, 16, bs, fp8, dtype=torch.bfloat16, seed=9)
    bt = _tables(ctx.tolist(), bs, 6, 16, seed=9)
    q = torch.randn(3, hkv * group, d, device=DEV, dtype=torch.bfloat16)
    kw = _kw(cache, bs, 9)
    if fp8:
        f8 = torch.float8_e4m3fn
        k = cache.k[0].view(f8).float() * cache.k_scale[0]
        v = cache.v[0].view(f8).float() * cache.v_scale[0]
    else:
        k, v = cache.k[0].float(), cache.v[0].float()
    ref_kw = dict(block_size=bs, scale=0.3, window=9)
    out = paged_decode(q, cache.k[0], cache.v[0], bt, ctx, backend="triton", **kw)
    ref = paged_decode_torch(q.float(), k, v, bt, ctx, **ref_kw)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
    out = paged_prefill(q, cache.k[0], cache.v[0], bt[0], 18, backend="triton", **kw)
    ref = paged_prefill_torch(q.float(), k, v, bt[0], 18, **ref_kw)
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


def test_fp8_every_bit_pattern():
    """K and V hold each of the 254 finite e4m3 bit patterns (subnormals included) once; the
    kernel's in-register decode must match torch's float8 conversion."""
    bs, d = 4, 16
    bits = torch.arange(256, dtype=torch.uint8)
    bits[bits & 0x7F == 0x7F] = 0  # the two NaN patterns
    cache = KVCache(1, 1, d, 4, bs, torch.float32, DEV, fp8=True)
    cache.k[0] = bits.view(16, 1, d).to(DEV)
    cache.v[0] = bits.flip(0).view(16, 1, d).to(DEV)
    cache.k_scale[0] = torch.rand(16, 1, 1, generator=torch.Generator().manual_seed(0)).to(DEV)
    ctx = torch.tensor([16], dtype=torch.int32, device=DEV)
    bt = torch.tensor([[3, 0, 2, 1]], dtype=torch.int32, device=DEV)
    q = torch.randn(1, 2, d, device=DEV) * 0.01
    out, ref = _decode_both(cache, q, bt, ctx, bs, None)
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("window", [None, 7])
def test_decode_splits_agree(window):
    bs, hkv, d = 4, 2, 16
    ctx = torch.tensor([45, 1, 0, 20], dtype=torch.int32, device=DEV)
    cache = _pool(hkv, d, 32, bs, True, seed=5)
    bt = _tables(ctx.tolist(), bs, 12, 32, seed=5)
    q = torch.randn(4, 4, d, device=DEV)
    for splits in (2, 5):
        out, ref = _decode_both(cache, q, bt, ctx, bs, window, num_splits=splits)
        torch.testing.assert_close(out, ref, **TOL)
        assert (out[2] == 0).all()


def test_decode_reads_only_its_keys():
    """Changing a key outside a row's attended range (before the window, at or past its
    context length, in another row's blocks) leaves its output bit for bit; changing one
    inside moves it."""
    bs, hkv, d, window = 4, 1, 16, 5
    ctx = torch.tensor([14, 9], dtype=torch.int32, device=DEV)
    cache = _pool(hkv, d, 12, bs, False, seed=7)
    bt = _tables(ctx.tolist(), bs, 4, 12, seed=7)
    q = torch.randn(2, 2, d, device=DEV)
    kw = _kw(cache, bs, window)

    def run():
        return paged_decode(q, cache.k[0], cache.v[0], bt, ctx, backend="triton", **kw)[0]

    base = run()
    slot = lambda p: int(bt[0, p // bs]) * bs + p % bs  # noqa: E731
    for pos, same in [(8, True), (9, False), (13, False), (14, True), (15, True)]:
        saved = cache.k[0, slot(pos)].clone()
        cache.k[0, slot(pos)] += 3.0
        assert torch.equal(run(), base) == same, pos
        cache.k[0, slot(pos)] = saved
    cache.v[0, int(bt[1, 0]) * bs] += 3.0  # row 1's block
    assert torch.equal(run(), base)


def _grpo_tables(bs, prompt_blocks, tails, num_blocks, seed):
    """Rows of requests whose samples share ``prompt_blocks`` leading blocks, then each
    sample's own blocks; tails = per request, each sample's own token counts."""
    perm = iter(torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist())
    rows, ctx = [], []
    for req in tails:
        prompt = [next(perm) for _ in range(prompt_blocks)]
        for own in req:
            rows.append(prompt + [next(perm) for _ in range(-(-own // bs))])
            ctx.append(prompt_blocks * bs + own)
    width = max(map(len, rows)) + 1
    bt = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
    return bt.to(DEV), torch.tensor(ctx, dtype=torch.int32, device=DEV)


def test_shared_prefix_groups():
    bs = 4
    bt, ctx = _grpo_tables(bs, 3, [[5, 1, 9], [2], [3, 3, 3, 3, 3]], 60, seed=1)
    bt = torch.cat([bt, bt[:1]])  # a padding row that repeats request 0's table
    ctx = torch.cat([ctx, ctx.new_zeros(1)])
    bt[6, 3] = bt[5, 3]  # rows 5 and 6 also share their fourth block
    g = shared_prefix_groups(bt, ctx, bs, max_group=4)
    assert g.offsets.tolist() == [0, 3, 4, 8, 9, 10, 10, 10, 10, 10, 10]
    # row 3 is alone; rows 4-7 share 3 blocks; row 8 (a fifth sample) starts its own group
    assert g.shared_lens.tolist() == [12, 0, 12, 0, 0, 0, 0, 0, 0, 0]
    bt[4, 3] = bt[5, 3]
    bt[7, 3] = bt[5, 3]
    g = shared_prefix_groups(bt, ctx, bs, max_group=4)
    assert g.shared_lens[2] == 15  # four shared blocks, capped by the shortest context


@pytest.mark.parametrize("fp8,window,splits", [(False, None, 1), (True, None, 3),
                                               (False, 9, 2)])
def test_decode_prefix_groups(fp8, window, splits):
    bs, hkv, d = 4, 2, 16
    bt, ctx = _grpo_tables(bs, 3, [[5, 1, 9], [2], [3, 11]], 60, seed=2)
    cache = _pool(hkv, d, 60, bs, fp8, seed=2)
    q = torch.randn(len(ctx), hkv * 4, d, device=DEV)
    groups = shared_prefix_groups(bt, ctx, bs, max_group=2)
    assert groups.shared_lens.tolist()[:4] == [12, 0, 0, 12]
    out, ref = _decode_both(cache, q, bt, ctx, bs, window, prefix_groups=groups,
                            num_splits=splits)
    torch.testing.assert_close(out, ref, **TOL)


def test_prefix_group_reads_the_leaders_blocks():
    """The shared blocks are read once, through the group's first row: a second row that
    points at other prompt blocks still sees the first row's (the grouping is trusted)."""
    bs, hkv, d = 4, 2, 16
    bt, ctx = _grpo_tables(bs, 2, [[3, 6]], 30, seed=4)
    cache = _pool(hkv, d, 30, bs, False, seed=4)
    q = torch.randn(2, 4, d, device=DEV)
    groups = shared_prefix_groups(bt, ctx, bs, max_group=2)
    moved = bt.clone()
    unused = sorted(set(range(30)) - set(bt.flatten().tolist()))
    moved[1, :2] = torch.tensor(unused[:2], dtype=torch.int32)  # other blocks, other K/V
    kw = _kw(cache, bs)
    out = paged_decode(q, cache.k[0], cache.v[0], moved, ctx, backend="triton",
                       prefix_groups=groups, **kw)
    torch.testing.assert_close(out, paged_decode_torch(q, cache.k[0], cache.v[0], bt, ctx, **kw),
                               **TOL)
    own = paged_decode_torch(q, cache.k[0], cache.v[0], moved, ctx, **kw)
    assert (out[1] - own[1]).abs().max() > 1e-2


def _engine_prefill(cache, q, table, start, bs, window):
    attn = PagedAttention.build(cache, [window], 0.3, [(table, start, q.shape[0])])
    k, v = cache.read(0, attn.slot_mapping)
    return attn(0, q[None], k[None], v[None])[0]


@pytest.mark.parametrize("start,t,window", [(0, 13, None), (6, 11, None), (9, 20, 7),
                                            (16, 1, 5)])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_prefill_matches_references(group, fp8, start, t, window):
    bs, hkv, d = 4, 2, 16
    cache = _pool(hkv, d, 24, bs, fp8, seed=group)
    table = _tables([start + t], bs, 12, 24, seed=group)[0]
    q = torch.randn(t, hkv * group, d, device=DEV)
    kw = _kw(cache, bs, window)
    ref = paged_prefill_torch(q, cache.k[0], cache.v[0], table, start, **kw)
    out = paged_prefill(q, cache.k[0], cache.v[0], table, start, backend="triton", **kw)
    torch.testing.assert_close(out, ref, **TOL)
    if not fp8:
        own = table[:-(-(start + t) // bs)].tolist()
        torch.testing.assert_close(out, _engine_prefill(cache, q, own, start, bs, window), **TOL)


def test_sinks_in_every_path():
    """Attention sinks (gpt-oss: a logit per query head in each softmax's denominator): the
    decode kernel direct, split (reduce kernel) and by prefix groups, and the prefill kernel,
    against the torch references, the engine's PagedAttention and the softmax over the
    scores with the sink appended written out; a padding row stays zero."""
    bs, hkv, d, group = 4, 2, 16, 2
    bt, ctx = _grpo_tables(bs, 2, [[5, 1], [9]], 40, seed=6)
    bt, ctx = torch.cat([bt, bt[:1]]), torch.cat([ctx, ctx.new_zeros(1)])  # a padding row
    cache = _pool(hkv, d, 40, bs, False, seed=6)
    q = torch.randn(len(ctx), hkv * group, d, device=DEV)
    sinks = torch.tensor([2.0, -1.0, 0.5, 6.0], device=DEV)
    kw = _kw(cache, bs)
    ref = paged_decode_torch(q, cache.k[0], cache.v[0], bt, ctx, sinks=sinks, **kw)
    plain = paged_decode_torch(q, cache.k[0], cache.v[0], bt, ctx, **kw)
    assert (ref[:3] - plain[:3]).abs().max() > 1e-2 and (ref[3] == 0).all()
    for b in range(3):  # written out: softmax over [scores, sink], the sink's share dropped
        n = int(ctx[b])
        slots = (bt[b].long()[:, None] * bs + torch.arange(bs, device=DEV)).reshape(-1)[:n]
        k, v = cache.read(0, slots)
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [n, Hq, D]
        s = torch.einsum("hd,nhd->hn", q[b], k) * 0.3
        p = torch.softmax(torch.cat([s, sinks[:, None]], 1), 1)[:, :-1]
        torch.testing.assert_close(ref[b], torch.einsum("hn,nhd->hd", p, v), **TOL)
    groups = shared_prefix_groups(bt, ctx, bs, max_group=2)
    for extra in ({}, {"num_splits": 3}, {"prefix_groups": groups}):
        out = paged_decode(q, cache.k[0], cache.v[0], bt, ctx, backend="triton", sinks=sinks,
                           **kw, **extra)
        torch.testing.assert_close(out, ref, **TOL)
        assert (out[3] == 0).all()
    live = [0, 1, 2]
    items = [(bt[i, :-(-int(ctx[i]) // bs)].tolist(), int(ctx[i]) - 1, 1) for i in live]
    attn = PagedAttention.build(cache, [None], 0.3, items)
    k, v = cache.read(0, attn.slot_mapping)
    torch.testing.assert_close(attn(0, q[live][None], k[None], v[None], sinks=sinks)[0],
                               ref[live], **TOL)
    start, t = 3, int(ctx[2]) - 3
    qp = torch.randn(t, hkv * group, d, device=DEV)
    want = paged_prefill_torch(qp, cache.k[0], cache.v[0], bt[2], start, sinks=sinks, **kw)
    got = paged_prefill(qp, cache.k[0], cache.v[0], bt[2], start, backend="triton",
                        sinks=sinks, **kw)
    torch.testing.assert_close(got, want, **TOL)
    own = bt[2, :-(-(start + t) // bs)].tolist()
    attn = PagedAttention.build(cache, [None], 0.3, [(own, start, t)])
    k, v = cache.read(0, attn.slot_mapping)
    torch.testing.assert_close(attn(0, qp[None], k[None], v[None], sinks=sinks)[0], want,
                               **TOL)


def test_backend_dispatch():
    bs = 4
    ctx = torch.tensor([6], dtype=torch.int32, device=DEV)
    cache = _pool(1, 16, 4, bs, False)
    bt = _tables([6], bs, 2, 4)
    q = torch.randn(1, 2, 16, device=DEV)
    kw = _kw(cache, bs)
    ref = paged_decode_torch(q, cache.k[0], cache.v[0], bt, ctx, **kw)
    assert _use_triton(q, "auto") == (DEV == "cuda")  # auto: torch on CPU, Triton on CUDA
    if DEV == "cpu":
        assert torch.equal(paged_decode(q, cache.k[0], cache.v[0], bt, ctx, **kw), ref)
    with pytest.raises(ValueError, match="backend"):
        paged_decode(q, cache.k[0], cache.v[0], bt, ctx, backend="cuda", **kw)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode(torch.randn(1, 3, 16, device=DEV), cache.k[0].expand(-1, 2, -1),
                     cache.v[0], bt, ctx, **kw)


# ---- on a GPU: a real model's shapes in bf16, and the kernel against gather + SDPA ----

QWEN = dict(hq=14, hkv=2, d=64)


def _gpu_batch(batch, fp8, ctx_hi=768, bs=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(32, ctx_hi + 1, (batch,), generator=g, dtype=torch.int32)
    max_blocks = -(-ctx_hi // bs)
    cache = KVCache(1, QWEN["hkv"], QWEN["d"], batch * max_blocks, bs, torch.bfloat16, "cuda",
                    fp8=fp8)
    n = cache.k.shape[1]
    cache.write(0, torch.arange(n, device="cuda"),
                torch.randn(n, QWEN["hkv"], QWEN["d"], device="cuda", dtype=torch.bfloat16),
                torch.randn(n, QWEN["hkv"], QWEN["d"], device="cuda", dtype=torch.bfloat16))
    perm = torch.randperm(batch * max_blocks, generator=g).int().view(batch, max_blocks)
    q = torch.randn(batch, QWEN["hq"], QWEN["d"], device="cuda", dtype=torch.bfloat16)
    return cache, perm.cuda(), ctx.cuda(), q


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_decode_bf16(fp8):
    cache, bt, ctx, q = _gpu_batch(64, fp8)
    ctx[3] = 0
    for window, splits in [(None, 1), (None, 4), (100, 2)]:
        out, ref = _decode_both(cache, q, bt, ctx, 16, window, num_splits=splits)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        assert (out[3] == 0).all()


@pytest.mark.gpu
def test_gpu_prefill_bf16():
    cache, bt, _, _ = _gpu_batch(4, False)
    q = torch.randn(300, QWEN["hq"], QWEN["d"], device="cuda", dtype=torch.bfloat16)
    for start, window in [(0, None), (200, None), (200, 128)]:
        kw = _kw(cache, 16, window)
        out = paged_prefill(q, cache.k[0], cache.v[0], bt[0], start, backend="triton", **kw)
        ref = paged_prefill_torch(q, cache.k[0], cache.v[0], bt[0], start, **kw)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("backend,grouped", [("torch", False), ("triton", False),
                                             ("triton", True)])
def test_gpu_decode_captures(backend, grouped):
    """Captured in a CUDA graph over static buffers (prefix groups computed inside it),
    replayed after the buffers change in place: the same bits as an eager call."""
    cache, bt, ctx, q = _gpu_batch(48, True)
    kw = _kw(cache, 16, 200)

    def step():
        groups = shared_prefix_groups(bt, ctx, 16) if grouped else None
        return paged_decode(q, cache.k[0], cache.v[0], bt, ctx, backend=backend,
                            prefix_groups=groups, **kw)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    bt[8:16, :4] = bt[8, :4]  # a group of 8 sharing 4 blocks
    ctx.copy_(torch.randint(64, 700, ctx.shape, device="cuda", dtype=torch.int32))
    ctx[5] = 0
    q.normal_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, step())
    assert (out[5] == 0).all()
