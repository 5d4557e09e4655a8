"""Our sparse MoE layer against transformers' on the same shapes and weights, forward and
forward+backward, in one process: each transformers call runs right after one of ours, and
the ratio printed is the median over repeats of (transformers' time / ours) of those pairs
(above 1: ours is faster); the times are medians too. Which of a pair runs first alternates
from one repeat to the next.

transformers runs its experts through ``config._experts_implementation``: "eager" (a loop over
the experts hit), "batched_mm" (gathers every token's expert weights, one bmm) and
"grouped_mm" (``torch._grouped_mm``, its default where it dispatches). Ours: the (token, slot)
pairs sorted by expert, the experts' weights stacked at load (``moe.pack_experts``), two
grouped GEMMs forward (short expert slices padded for row invariance), the backward's on the
real rows, weight gradients per active expert (model/moe.py).

    python benchmarks/bench_moe.py [--repeats 21] [--threads 1] [--clock wall|cpu] [--cold]

``--clock cpu`` times each call in the process's CPU time instead of wall-clock time: on a
machine shared with other jobs a call's wall time includes the time other processes held
its core, CPU time does not (with ``--threads 1``; cache and memory-bandwidth contention
still count). ``--cold`` writes a 64 MB buffer before each timed call, so each starts with
its weights out of the caches, as in a model whose other layers run in between (here a
layer's 8-24 MB of expert weights would otherwise partly stay in a 32 MB L3 from one call
to the next).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

# (family, hidden, expert width, experts, top-k, tokens): decode batch, a training micro-batch
SHAPES = [
    ("qwen3_moe", 512, 256, 16, 4, 16),
    ("qwen3_moe", 512, 256, 16, 4, 1024),
    ("mixtral", 256, 512, 8, 2, 1024),
]
HF_IMPLS = ("eager", "batched_mm", "grouped_mm")


def build(family, h, w, e, k):
    """transformers' first sparse block and ours, holding the same weights."""
    import orbitrl
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(num_local_experts=e) if family == "mixtral" else dict(
        num_experts=e, moe_intermediate_size=w, norm_topk_prob=True)
    cfg = AutoConfig.for_model(family, vocab_size=64, hidden_size=h, intermediate_size=w,
                               num_hidden_layers=1, num_attention_heads=4,
                               num_key_value_heads=4, num_experts_per_tok=k, **kw)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * (0.5 if n.endswith("gate.weight") else 0.05))
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = orbitrl.load_model(d)
    attr = "block_sparse_moe" if family == "mixtral" and hasattr(hf.model.layers[0],
                                                                "block_sparse_moe") else "mlp"
    return hf, getattr(hf.model.layers[0], attr), ours.model.layers[0].__getattr__(
        ours.model.layers[0].ffn_name)


CLOCK = time.perf_counter
FLUSH = None  # --cold: a 64 MB buffer written before each timed call


def timed(fn, x, backward: bool) -> float:
    """Seconds of one call (and its backward); gradients start empty, as after a training
    step's ``zero_grad(set_to_none=True)`` (otherwise each repeat adds into the last one's,
    a pass over every weight's gradient that no training step makes)."""
    x = x.detach().requires_grad_(backward)
    for p in fn.parameters():
        p.grad = None
    if FLUSH is not None:
        FLUSH.add_(1.0)
    t = CLOCK()
    if backward:
        fn(x).sum().backward()
    else:
        with torch.no_grad():
            fn(x)
    return CLOCK() - t


def run_shape(shape, repeats: int) -> list[tuple]:
    family, h, w, e, k, n = shape
    hf, hf_block, ours = build(family, h, w, e, k)
    x = torch.randn(1, n, h)
    with torch.no_grad():  # same function first
        hf.config._experts_implementation = "eager"
        err = (hf_block(x) - ours(x)).abs().max().item()
    # batched_mm gathers a weight copy per (token, slot): skip it where that passes 1 GB
    gathered = n * k * 3 * h * w * 4
    impls = [i for i in HF_IMPLS if (i != "batched_mm" or gathered < 1 << 30)
             and _works(hf, hf_block, x, i)]
    rows = []
    for backward in (False, True):
        times = {i: [] for i in impls + ["ours"]}
        ratios = {i: [] for i in impls}
        for r in range(repeats):
            for i in impls:  # each pair back to back: a shared machine's load hits both
                hf.config._experts_implementation = i
                # which of the two runs first alternates: the first one inherits the caches
                # (and freed memory) of the previous pair's call, e.g. batched_mm's 1 GB
                if r % 2:
                    ours_s = timed(ours, x, backward)
                    hf_s = timed(hf_block, x, backward)
                else:
                    hf_s = timed(hf_block, x, backward)
                    ours_s = timed(ours, x, backward)
                times[i].append(hf_s)
                times["ours"].append(ours_s)
                ratios[i].append(hf_s / ours_s)
        med = {i: statistics.median(v) for i, v in times.items()}
        med.update({("ratio", i): statistics.median(v) for i, v in ratios.items()})
        rows.append((shape, "fwd+bwd" if backward else "fwd", med, err))
    return rows


def _works(hf, block, x, impl) -> bool:
    hf.config._experts_implementation = impl
    try:
        with torch.no_grad():
            block(x[:, :2])
        return True
    except Exception:  # an implementation that does not dispatch on this device
        return False


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", type=int, default=None, help="run only SHAPES[i]")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall-clock time, or the process's CPU time (see above)")
    ap.add_argument("--cold", action="store_true",
                    help="evict the caches before each timed call (see above)")
    a = ap.parse_args()
    global CLOCK, FLUSH
    CLOCK = time.process_time if a.clock == "cpu" else time.perf_counter
    FLUSH = torch.zeros(16 << 20) if a.cold else None
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {a.threads} thread(s), fp32, medians of {a.repeats}, "
          f"{a.clock} clock" + (", cold caches" if a.cold else ""))
    print("| shape (family H/W/E/k, tokens) | pass | ours ms | " +
          " | ".join(f"{i} ms (ratio)" for i in HF_IMPLS) + " | max abs diff |")
    print("|---|---|---|" + "---|" * len(HF_IMPLS) + "---|")
    for shape in SHAPES if a.only is None else [SHAPES[a.only]]:
        for (fam, h, w, e, k, n), kind, med, err in run_shape(shape, a.repeats):
            cells = [f"{med[i] * 1e3:.2f} ({med[('ratio', i)]:.2f}x)" if i in med else "n/a"
                     for i in HF_IMPLS]
            print(f"| {fam} {h}/{w}/{e}/{k}, {n} | {kind} | {med['ours'] * 1e3:.2f} | "
                  + " | ".join(cells) + f" | {err:.1e} |")


if __name__ == "__main__":
    main()
