"""Model-FLOPs utilisation of an RL step and where the rest of the step went.

Useful FLOPs count the matmuls a step needs: 2 x params per token for each forward
(rollout tokens, each scoring pass), and for training 6 x params per token with trainable
weights (forward + both backward products) or 4 x params per token over a frozen base
(adapters: no weight gradients of the base). The waterfall splits the step's wall time
into the ideal time of those FLOPs at the machine's peak and what each cause took away:
decode below the roofline (rollout steps while the batch was at least half as wide as its
widest), the long tail (rollout steps with fewer than half the widest batch), scoring and
training below peak, syncs (zero in the colocated single-process mode) and idle time (the
step minus its phases: rewards, bookkeeping).
"""

from __future__ import annotations

import time

import torch


def measure_peak_flops(n: int = 512, repeat: int = 5) -> float:
    """Sustained fp32 matmul FLOP/s of this process on the host (threads as configured)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    t0 = time.perf_counter()
    for _ in range(repeat):
        a @ b
    return 2 * n ** 3 * repeat / (time.perf_counter() - t0)


def waterfall(params: int, peak: float, rollout_tokens: int, timeline, score_tokens: int,
              score_passes: int, train_tokens: int, frozen_base: bool, seconds: dict,
              step_seconds: float) -> dict:
    """MFU of one step and the seconds each cause took from it.

    Args:
        params: parameters a token passes through (compute params, embeddings excluded).
        peak: peak FLOP/s of the device.
        rollout_tokens: tokens the engine computed (prefill + decode).
        timeline: the engine's per-step (sequences, tokens, seconds) during this rollout.
        score_tokens, score_passes: tokens per scoring pass and how many passes ran.
        train_tokens: tokens through forward + backward (all epochs).
        frozen_base: adapters over a frozen base (4 x params per token to train).
        seconds: phase seconds (rollout, reward, score, train).
        step_seconds: the step's wall time.
    """
    f_roll = 2 * params * rollout_tokens
    f_score = 2 * params * score_tokens * score_passes
    f_train = (4 if frozen_base else 6) * params * train_tokens
    useful = f_roll + f_score + f_train
    widest = max((n for n, _, _ in timeline), default=0)
    tail_s = sum(s for n, _, s in timeline if n < widest / 2)
    roll_s = seconds.get("rollout", 0.0)
    phases = sum(seconds.values())
    out = {
        "mfu": useful / (peak * step_seconds) if step_seconds > 0 else 0.0,
        "mfu_ideal_s": useful / peak,
        "mfu_lost_decode_s": max(0.0, roll_s - tail_s - f_roll / peak),
        "mfu_lost_long_tail_s": tail_s,
        "mfu_lost_score_s": max(0.0, seconds.get("score", 0.0) - f_score / peak),
        "mfu_lost_train_s": max(0.0, seconds.get("train", 0.0) - f_train / peak),
        "mfu_lost_sync_s": 0.0,
        "mfu_lost_idle_s": max(0.0, step_seconds - phases) + seconds.get("reward", 0.0),
    }
    return out


def _layer_rate(hidden: int, intermediate: int, tokens: int = 1024, seconds: float = 0.5) -> float:
    """FLOP/s of a feed-forward's two products, forward and input gradient (what training an
    adapter over a frozen base runs), at this model's widths over ``tokens`` rows."""
    w1, w2 = torch.randn(intermediate, hidden), torch.randn(hidden, intermediate)
    x = torch.randn(tokens, hidden, requires_grad=True)

    def once():
        y = torch.nn.functional.linear(torch.nn.functional.linear(x, w1), w2)
        y.backward(torch.ones_like(y))

    once()
    t0, n = time.perf_counter(), 0
    while n < 2 or time.perf_counter() - t0 < seconds:
        once()
        n += 1
    return 8 * tokens * hidden * intermediate * n / (time.perf_counter() - t0)


def measure_machine(hidden: int = 512, intermediate: int = 2048, seconds: float = 1.0) -> dict:
    """This host's rates for the planner (``orbitrl plan --this-machine``): sustained fp32
    matmul TFLOP/s at the model's widths (a feed-forward's forward and input gradient over
    1024 rows), copy bandwidth in GB/s (a 256 MiB copy into a buffer already touched: read +
    write), at torch's current thread count (the host's cost per op is orbitrl's own:
    observe/calibrate.py)."""
    # the best of three: a shared host's rate wanders between timings (90-165 GFLOP/s seen
    # on one 2-core machine within minutes)
    flops = max(_layer_rate(hidden, intermediate, seconds=seconds / 4) for _ in range(3))
    a, b = torch.ones(64 << 20), torch.zeros(64 << 20)  # 256 MiB of fp32 each
    b.copy_(a)
    t0, n = time.perf_counter(), 0
    while n < 3 or time.perf_counter() - t0 < seconds / 2:
        b.copy_(a)
        n += 1
    gbps = 2 * a.numel() * 4 * n / (time.perf_counter() - t0) / 1e9
    return {"device_tflops": flops / 1e12, "hbm_gbps": gbps, "threads": torch.get_num_threads()}
