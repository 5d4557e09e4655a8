"""Paged decode attention on a GPU: the Triton kernel (K/V read in place through the block
tables) against the torch reference it replaces (gather every context, then SDPA), one
layer of a Qwen2-0.5B-shaped model (14 query heads, 2 kv heads, head dim 64) at batch 512.

    python benchmarks/bench_attention_kernels.py            # contexts 32 .. 768
    python benchmarks/bench_attention_kernels.py --quick    # three context rows

Method. One pool per KV dtype (bf16, fp8 e4m3 + fp32 scales), filled with random values,
block size 16, each row's blocks scattered over the pool (a shuffled permutation). Rows:
every sequence at one context length, a ragged batch (lengths uniform in 32 .. 768), and a
GRPO-shaped batch (64 prompts x 8 samples, prompt 256 tokens shared by the samples, 1 .. 256
own tokens each) also run with prefix groups, so each prompt's blocks are read once per
group. Time per call: CUDA events over ``--iters`` back-to-back calls after warm-up. GB/s:
the KV bytes the call must read at least (every attended token's K and V, plus the fp8
scales; shared prompt blocks counted once with prefix groups) over that time, against the
device's copy bandwidth measured in the same run (``--peak-gbs`` sets a data-sheet figure
instead). Exits with status 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import sys

import torch

from orbitrl.engine.attention_kernels import paged_decode, shared_prefix_groups
from orbitrl.engine.paged_attention import KVCache

HQ, HKV, D, BS = 14, 2, 64, 16


def _time_us(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of 1 GiB: bytes read + written per second."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = _time_us(lambda: b.copy_(a), 10)
    return 2 * a.numel() / us / 1e3


def _pool(num_blocks: int, fp8: bool) -> KVCache:
    cache = KVCache(1, HKV, D, num_blocks, BS, torch.bfloat16, "cuda", fp8=fp8)
    n = num_blocks * BS
    for lo in range(0, n, 1 << 20):  # in chunks: the fp8 quantization works in fp32
        s = torch.arange(lo, min(lo + (1 << 20), n), device="cuda")
        cache.write(0, s, torch.randn(len(s), HKV, D, device="cuda", dtype=torch.bfloat16),
                    torch.randn(len(s), HKV, D, device="cuda", dtype=torch.bfloat16))
    return cache


def _batches(batch: int, quick: bool):
    """(name, context_lens [B], block tables [B, W], prefix length shared by groups of 8)."""
    g = torch.Generator().manual_seed(0)
    fixed = [32, 256, 768] if quick else [32, 64, 128, 256, 512, 768]
    for c in fixed:
        yield f"all {c}", torch.full((batch,), c, dtype=torch.int32), 0
    yield "ragged 32-768", torch.randint(32, 769, (batch,), generator=g, dtype=torch.int32), 0
    yield "grpo 256+1-256", 256 + torch.randint(1, 257, (batch,), generator=g,
                                                dtype=torch.int32), 256


def _tables(ctx: torch.Tensor, prefix: int, num_blocks: int):
    """Scattered blocks per row; rows 8k .. 8k+7 share their first prefix / BS blocks."""
    perm = iter(torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist())
    width = -(-int(ctx.max()) // BS)
    rows, pb = [], prefix // BS
    for i, c in enumerate(ctx.tolist()):
        shared = rows[i - i % 8][:pb] if i % 8 else [next(perm) for _ in range(pb)]
        own = [next(perm) for _ in range(-(-c // BS) - pb)]
        rows.append(shared + own + [0] * (width - pb - len(own)))
    return torch.tensor(rows, dtype=torch.int32, device="cuda")


def _kv_bytes(ctx: torch.Tensor, fp8: bool, shared_once: int = 0) -> int:
    per_token = 2 * HKV * ((D + 4) if fp8 else 2 * D)  # K and V (+ fp32 scales)
    tokens = int(ctx.sum()) - shared_once * (len(ctx) - len(ctx) // 8)
    return tokens * per_token


def _run(cache, ctx, bt, prefix, iters):
    q = torch.randn(len(ctx), HQ, D, device="cuda", dtype=torch.bfloat16)
    ctx = ctx.to("cuda")
    kw = dict(block_size=BS, scale=D ** -0.5)
    if cache.fp8:
        kw.update(k_scale=cache.k_scale[0], v_scale=cache.v_scale[0])
    call = lambda backend, **extra: paged_decode(  # noqa: E731
        q, cache.k[0], cache.v[0], bt, ctx, backend=backend, **kw, **extra)
    ref = call("torch").float()
    methods = {"torch gather+SDPA": {"backend": "torch"}, "triton": {"backend": "triton"}}
    if prefix:
        groups = shared_prefix_groups(bt, ctx, BS, max_group=8)
        methods["triton, prefix groups"] = {"backend": "triton", "prefix_groups": groups}
    out = {}
    for name, extra in methods.items():
        err = (call(**extra).float() - ref).abs().max().item()
        us = _time_us(lambda: call(**extra), iters)
        out[name] = (us, err)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="three context rows, fewer calls")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--peak-gbs", type=float, default=None,
                    help="the device's memory bandwidth (GB/s); default: measured copy")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_attention_kernels: needs a CUDA device (torch sees none); the kernels "
              "are tested on CPU by tests/engine/test_attention_kernels.py", file=sys.stderr)
        sys.exit(2)
    iters = args.iters or (20 if args.quick else 100)
    peak = args.peak_gbs or copy_bandwidth_gbs()
    src = "given" if args.peak_gbs else "measured copy"
    print(f"device {torch.cuda.get_device_name(0)} | bandwidth {peak:.0f} GB/s ({src}) | "
          f"batch {args.batch} | {HQ} heads, {HKV} kv heads, head dim {D}, block {BS}")
    print(f"{'kv':5} {'contexts':15} {'method':22} {'us/call':>9} {'GB/s':>7} {'% bw':>6} "
          f"{'x torch':>8} {'max err':>8}")
    batches = list(_batches(args.batch, args.quick))
    for fp8 in (False, True):
        num_blocks = args.batch * (-(-768 // BS))
        cache = _pool(num_blocks, fp8)
        for name, ctx, prefix in batches:
            bt = _tables(ctx, prefix, num_blocks)
            res = _run(cache, ctx, bt, prefix, iters)
            base = res["torch gather+SDPA"][0]
            for method, (us, err) in res.items():
                once = prefix if "groups" in method else 0
                gbs = _kv_bytes(ctx, fp8, once) / us / 1e3
                print(f"{'fp8' if fp8 else 'bf16':5} {name:15} {method:22} {us:9.1f} "
                      f"{gbs:7.0f} {100 * gbs / peak:5.1f}% {base / us:7.2f}x {err:8.1e}")
        del cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
