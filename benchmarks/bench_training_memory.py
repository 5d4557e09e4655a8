"""Peak memory and step time of one training step, per optimizer / residency mode, and the
logprob+loss working memory of the chunked path against naive [tokens, vocab] logits.

    python benchmarks/bench_training_memory.py            # ~5 min on 2 idle CPU cores
    python benchmarks/bench_training_memory.py --quick    # smaller model, for a smoke run
    python benchmarks/bench_training_memory.py --only adamw,adalomo_fused_1pass,adalomo_fused \
        --repeats 3                                       # full mode's clip modes vs AdamW

Method. Every configuration runs in its own fresh subprocess (``--worker NAME``), so no
allocator cache or earlier peak leaks between them. The worker builds the same model
(random init from a Llama-shaped config, fp32) and batch, then resets the kernel's RSS
high-water mark (``echo 5 > /proc/self/clear_refs``) and runs ``--steps`` steps; peak =
``VmHWM`` after the steps minus ``VmRSS`` just before them (the model, batch and torch
itself are in the baseline, so "net peak" is what the step adds on top of the weights:
gradients, optimizer state, activations, logits). Step time is the mean over the steps
after the first. All configurations use the same loss (advantage-weighted chunked token
logprobs) and activation recomputation, so they differ only in optimizer and residency.
Configurations run one after another on shared cores: compare times within one run only.
``--repeats N`` runs the whole list N times, interleaved (a, b, c, a, b, c, ...), and reports
the median of each configuration's step time and net peak, so a slow minute on shared
cores hits every configuration alike.

``--device`` (auto: CUDA when available, else the CPU): on CUDA the model and batch live on
the GPU, step times are taken after ``torch.cuda.synchronize()`` and the net peak is
``torch.cuda.max_memory_allocated()`` during the steps minus the allocation before them.

Full mode's two clip modes are ``adalomo_fused_1pass`` (``clip="grouped"``, the default:
one forward + backward, AdaLomo's per-tensor update normalization) and ``adalomo_fused``
(``clip="global"``: exact global clip by two passes); the summary line checks the one-pass
default against the target of at most 1.2x AdamW's step time at most 0.4x its net peak.

On a CPU host the "device" is the host: layer tiers cannot lower RSS there, so for the
tiered run the table also gives the device-tier peak from the residency accounting (what
a GPU would hold: non-layer weights + 1 + k layers).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

MB = 1 << 20


def _status(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


def _reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _config(quick: bool):
    from orbitrl.model.config import ModelConfig

    if quick:
        h, layers, inter, vocab = 256, 4, 704, 8000
    else:  # ~111M parameters (untied 32k embeddings are 49M of them)
        h, layers, inter, vocab = 768, 10, 2048, 32000
    return ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=h,
                       intermediate_size=inter, num_layers=layers, num_heads=h // 64,
                       num_kv_heads=max(1, h // 256), head_dim=64)


def _device(args) -> str:
    import torch

    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return args.device


def _train_worker(name: str, args) -> dict:
    import torch

    from orbitrl.model.decoder import Decoder
    from orbitrl.train.logprobs import model_logprobs
    from orbitrl.train.optim import FusedSGD, build_optimizer
    from orbitrl.train.residency import LayerResidency

    dev = torch.device(_device(args))
    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    cfg = _config(args.quick)
    model = Decoder(cfg).to(dev).train()
    model.recompute = True
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
    tgt = torch.cat([ids[:, 1:], torch.full((args.batch, 1), -1)], 1)
    adv = torch.randn(args.batch, 1, generator=g)
    ids, tgt, adv = ids.to(dev), tgt.to(dev), adv.to(dev)
    n_tok = int((tgt >= 0).sum())
    extra = {}
    note = ""

    def loss_fn():
        lp = model_logprobs(model, ids, tgt)
        return -(lp * adv).sum() / n_tok

    def closure():
        loss = loss_fn()
        loss.backward()
        return loss

    res = None
    if name == "adamw":
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, lr=1e-5)

        def step():
            closure()
            torch.nn.utils.clip_grad_norm_(params, 0.3)
            opt.step()
            opt.zero_grad(set_to_none=True)
        note = "fp32 weights = master; grads + m + v"
    elif name == "lora_nf4":
        try:
            from orbitrl.model.lora import adapter_parameters, apply_lora
        except ImportError:  # pragma: no cover
            raise SystemExit("orbitrl.model.lora not importable")
        apply_lora(model, rank=16, base_format="nf4")
        params = adapter_parameters(model)
        opt = torch.optim.AdamW(params, lr=1e-4)

        def step():
            closure()
            torch.nn.utils.clip_grad_norm_(params, 0.3)
            opt.step()
            opt.zero_grad(set_to_none=True)
        note = "orbitrl.model.lora, rank 16 all linears, NF4 base (torchao); AdamW on adapters"
        extra["trainable"] = sum(p.numel() for p in params)
    else:
        params = list(model.parameters())
        extra["trainable"] = sum(p.numel() for p in params)  # before tiers empty them
        if name == "sgd_fused":
            opt = FusedSGD(params, lr=1e-5)
            note = "two-pass exact clip"
        elif name == "sgd_fused_1pass":
            opt = FusedSGD(params, lr=1e-5, two_pass=False, nonfinite="stop")
            note = "clip from previous norm"
        elif name == "adalomo_fused":
            opt = build_optimizer("adalomo", params, 1e-3, clip="global")
            note = "factored 2nd moment, clip=global (two-pass exact)"
        elif name == "adalomo_fused_1pass":
            opt = build_optimizer("adalomo", params, 1e-3, clip="grouped")
            note = "factored 2nd moment, clip=grouped (one pass, full-mode default)"
        elif name == "sgd_fused_tiers":
            opt = FusedSGD(params, lr=1e-5)
            res = LayerResidency(model, prefetch=2, keep_timeline=False)
            note = "two-pass, layer tiers k=2"
        else:
            raise SystemExit(f"unknown config {name}")

        def step():
            opt.step(closure)

    extra.setdefault("trainable", sum(p.numel() for p in params))
    import gc
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    else:
        base = _status("VmRSS")
        _reset_peak()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(dev) if cuda else _status("VmHWM")
    out = dict(name=name,
               base_rss=base, net_peak=peak - base, peak_rss=peak,
               step_s=sum(times[1:]) / max(1, len(times) - 1), note=note, **extra)
    if res is not None:
        out["device_tier_peak"] = res.stats.peak_device_bytes
        out["misses"], out["hits"] = res.stats.misses, res.stats.hits
        out["weights_bytes"] = res.fixed_bytes + res.stats.host_bytes
    if hasattr(opt, "stats"):
        out["measure_s"] = opt.stats.measure_s / args.steps
        out["apply_s"] = opt.stats.apply_s / args.steps
    return out


def _logprob_worker(name: str, args) -> dict:
    import torch

    from orbitrl.train.logprobs import naive_token_logprobs, token_logprobs

    path, vocab = name.split("_")[1], int(name.split("_")[2].rstrip("k")) * 1000
    N, H = args.lp_tokens, 768
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(N, H, generator=g) * 0.5).requires_grad_()
    w = (torch.randn(vocab, H, generator=g) * 0.05).requires_grad_()
    y = torch.randint(0, vocab, (N,), generator=g)
    adv = torch.randn(N, generator=g)
    base = _status("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    if path == "naive":
        lp, ent = naive_token_logprobs(h, w, y)
    else:
        lp, ent = token_logprobs(h, w, y, with_entropy=True)
    loss = -(lp * adv).mean() - 0.01 * ent.mean()
    loss.backward()
    dt = time.perf_counter() - t0
    peak = _status("VmHWM")
    grads = (h.numel() + w.numel()) * 4  # d/dh and d/dW: the same for both paths
    return dict(name=name, vocab=vocab, tokens=N, net_peak=peak - base,
                working=peak - base - grads, step_s=dt)


TRAIN = ["adamw", "sgd_fused", "sgd_fused_1pass", "adalomo_fused_1pass", "adalomo_fused",
         "sgd_fused_tiers", "lora_nf4"]
LOGPROB = ["lp_naive_32k", "lp_chunked_32k", "lp_naive_128k", "lp_chunked_128k"]


def _spawn(name: str, argv: list[str]) -> dict:
    cmd = [sys.executable, __file__, "--worker", name] + argv
    p = subprocess.run(cmd, capture_output=True, text=True)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not line:
        return dict(name=name, error=(p.stderr.strip().splitlines() or ["?"])[-1])
    return json.loads(line[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lp-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", help="comma-separated config names")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved rounds; medians")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.worker:
        fn = _logprob_worker if args.worker.startswith("lp_") else _train_worker
        print(json.dumps(fn(args.worker, args)), flush=True)
        return
    argv = [a for a in sys.argv[1:]]
    names = TRAIN + LOGPROB
    if args.only:
        names = [n for n in names if n in args.only.split(",")]
    runs: dict[str, list] = {n: [] for n in names}
    print(f"# load average before: {open('/proc/loadavg').read().split()[:3]}",
          file=sys.stderr)
    for rep in range(args.repeats):
        for n in names:
            t0 = time.perf_counter()
            runs[n].append(r := _spawn(n, argv))
            print(f"# round {rep + 1}, {n}: {time.perf_counter() - t0:.0f}s "
                  f"{r.get('error', '')}", file=sys.stderr, flush=True)
    _print_tables({n: _median(rs) for n, rs in runs.items()}, args)
    print(f"\nload average after (2 shared cores): "
          f"{' '.join(open('/proc/loadavg').read().split()[:3])}")


def _median(rs: list[dict]) -> dict:
    """One row from the repeats of a configuration: the median of every timing and memory
    figure over the runs that succeeded (the first error when none did)."""
    ok = [r for r in rs if "error" not in r]
    if not ok:
        return rs[0]
    out = dict(ok[0], runs=len(ok), step_s_runs=[r["step_s"] for r in ok])
    for k in ("net_peak", "step_s", "measure_s", "apply_s"):
        if k in out:
            vals = sorted(r[k] for r in ok)
            out[k] = vals[len(vals) // 2] if len(vals) % 2 else \
                (vals[len(vals) // 2 - 1] + vals[len(vals) // 2]) / 2
    return out


def _print_tables(rows: dict, args):
    cfg = _config(args.quick)
    base = rows.get("adamw", {})
    dev = _device(args)
    print(f"\n## Training step: {cfg.num_params / 1e6:.0f}M-param Llama-shaped model "
          f"(h={cfg.hidden_size}, {cfg.num_layers} layers, vocab {cfg.vocab_size}), fp32, "
          f"batch {args.batch}x{args.seq}, recompute on, {dev}"
          f"{f', {args.threads} threads' if dev == 'cpu' else ''}, medians of "
          f"{args.repeats} interleaved run(s) of {args.steps} steps\n")
    print("| config | trainable | net peak MB | vs AdamW | step s | vs AdamW | notes |")
    print("|---|---|---|---|---|---|---|")
    for n in TRAIN:
        r = rows.get(n)
        if r is None:
            continue
        if "error" in r:
            print(f"| {n} | - | - | - | - | - | failed: {r['error'][:80]} |")
            continue
        note = r["note"]
        if len(r.get("step_s_runs", [])) > 1:
            note += "; step s per run " + " / ".join(f"{t:.2f}" for t in r["step_s_runs"])
        if "measure_s" in r and r["measure_s"] > 0:
            note += f"; norm pass {r['measure_s']:.2f}s + update pass {r['apply_s']:.2f}s"
        if "device_tier_peak" in r:
            note += (f"; device tier peak {r['device_tier_peak'] / MB:.0f} MB of "
                     f"{r['weights_bytes'] / MB:.0f} MB weights (accounting), "
                     f"prefetch hits {r['hits']} / misses {r['misses']}")
        rp = (f"{r['net_peak'] / base['net_peak']:.2f}x" if base.get("net_peak") else "-")
        rt = (f"{r['step_s'] / base['step_s']:.2f}x" if base.get("step_s") else "-")
        print(f"| {n} | {r['trainable'] / 1e6:.1f}M | {r['net_peak'] / MB:.0f} | {rp} | "
              f"{r['step_s']:.2f} | {rt} | {note} |")
    one = rows.get("adalomo_fused_1pass", {})
    if base.get("step_s") and one.get("step_s") and "error" not in base | one:
        t, m = one["step_s"] / base["step_s"], one["net_peak"] / base["net_peak"]
        two = rows.get("adalomo_fused", {})
        vs2 = (f"; two-pass (clip=global) is {two['step_s'] / one['step_s']:.2f}x the "
               f"one-pass step" if two.get("step_s") and "error" not in two else "")
        print(f"\nfull-mode default (adalomo, clip=grouped) vs AdamW: step {t:.2f}x "
              f"(target <= 1.2x: {'met' if t <= 1.2 else 'NOT met'}), net peak {m:.2f}x "
              f"(target <= 0.4x: {'met' if m <= 0.4 else 'NOT met'}){vs2}")
    what = ("torch.cuda.max_memory_allocated during the steps minus the allocation before "
            "them" if dev == "cuda" else "RSS high-water mark during the steps minus RSS "
            "before them")
    print(f"\nnet peak = {what} (weights, batch and torch are in the baseline); one fresh "
          "subprocess per config and round.")
    if not any(n in rows for n in LOGPROB):
        return
    print(f"\n## Logprob + loss (with entropy), {args.lp_tokens} tokens x hidden 768, "
          "forward + backward\n")
    print("| vocab | naive net peak MB | chunked net peak MB | naive working MB | "
          "chunked working MB | chunked/naive | naive s | chunked s |")
    print("|---|---|---|---|---|---|---|---|")
    for v in ("32k", "128k"):
        a, b = rows.get(f"lp_naive_{v}"), rows.get(f"lp_chunked_{v}")
        if not a or not b or "error" in a or "error" in b:
            print(f"| {v} | failed | | | | | | |")
            continue
        print(f"| {v} | {a['net_peak'] / MB:.0f} | {b['net_peak'] / MB:.0f} | "
              f"{a['working'] / MB:.0f} | {b['working'] / MB:.0f} | "
              f"{b['working'] / max(1, a['working']):.3f} | {a['step_s']:.2f} | "
              f"{b['step_s']:.2f} |")
    print("\nworking = net peak minus the gradients d/dhidden and d/dW that both paths must "
          "return; one tile is 1024 tokens x 8192 vocab x 4 B = 32 MB.")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
