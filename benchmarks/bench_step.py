"""Wall time of one built-in GRPO step, phase by phase, against the raw math of its batch.

    python benchmarks/bench_step.py               # CPU, then CUDA where one is available
    python benchmarks/bench_step.py --steps 10 --warmup 2 --device cpu   # a smoke test

Method. The default config (``orbitrl train`` with no arguments: GRPO, LoRA r16 on an NF4
base of the built-in 0.8M-parameter Qwen2-shaped model, 8 prompts x 8 samples, max_tokens
8) builds an ``RLTrainer`` on the built-in task, as the command does (``train.threads``
intra-op threads). After ``--warmup`` steps, ``--steps`` steps are timed one by one; each
step's metrics row is also written to a ``metrics.jsonl`` in a temporary directory as
``orbitrl train`` writes it. Per phase (the row's ``time_<phase>_s``): rollout (the engine),
reward (the reward runner), score (old and reference logprobs, advantages), train (loss,
backward, optimizer, guards); "other" is the rest of the step (bookkeeping, metric probes,
the memory hand-back, writing the row). Mean and median ms per step, and the phase's share
of the mean step.

Floor. On the last step's own samples, the same model (NF4 base + LoRA) runs only the math
a step cannot avoid, with nothing around it: the rollout's tokens in one no-grad forward of
the packed batch (generation computes those tokens one at a time, so its real floor is
higher; this is the compute), one no-grad forward per scoring pass the step runs (the
reference; the old policy too where the update cannot supply its logprobs),
and one forward + backward of the loss-free sum of the completion logprobs. "step / floor"
says how many times the math the step costs; "overhead" is the step minus the floor.

``--compare-workers N`` (default 10) then alternates the same trainer's steps between one
worker and ``train.workers`` (scoring and update micro-batches side by side on CPU threads,
``rl/parallel.py``) and prints both, interleaved so both see the same load.

Page faults and system time per step are printed too: on the host, the memory probe's heap
trims (``log.memory_every``; ``--set log.memory_every=1`` probes every step) hand pages back
that the next phase faults in again, one fault per 4 KiB.

Timings on shared cores are noisy: compare phases within one run, and prefer medians. The
step's process CPU time (every thread of the process) is printed beside its wall time: on
cores other processes share, wall time grows with their load and CPU time much less.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch

PHASES = ("rollout", "reward", "score", "train")


def build(device: str, threads: int, overrides: list[str]):
    from orbitrl.config import load_config
    from orbitrl.rl.run import load_data
    from orbitrl.rl.trainer import RLTrainer

    cfg = load_config(None, [f"model.device={device}", f"train.threads={threads}",
                             *overrides])
    if cfg.train.threads > 0:
        torch.set_num_threads(cfg.train.threads)
    train, held = load_data(cfg)
    return RLTrainer(cfg, train, held)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(trainer, warmup: int, steps: int) -> tuple[list[dict], list]:
    """Per step: ms per phase (and 'other', 'step'); the last step's samples."""
    from orbitrl.observe.metrics import MetricsWriter

    last: list = []
    rollouts = trainer.rollouts

    def keep(*args, **kw):  # the step's rollout, for the floor
        ro = rollouts(*args, **kw)
        last[:] = ro.samples
        return ro

    trainer.rollouts = keep
    with tempfile.TemporaryDirectory() as tmp:
        writer = MetricsWriter(Path(tmp) / "metrics.jsonl")
        rows = []
        for i in range(warmup + steps):
            _sync(trainer.device)
            t0, c0 = time.perf_counter(), time.process_time()
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            row = trainer.step()
            writer.write(row)
            _sync(trainer.device)
            total, cpu = time.perf_counter() - t0, time.process_time() - c0
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            if i >= warmup:
                ms = {p: 1000 * row.get(f"time_{p}_s", 0.0) for p in PHASES}
                ms["step"] = 1000 * total
                ms["other"] = ms["step"] - sum(ms[p] for p in PHASES)
                ms["cpu"] = 1000 * cpu
                ms["sys"] = 1000 * (r1.ru_stime - r0.ru_stime)
                ms["faults"] = r1.ru_minflt - r0.ru_minflt
                rows.append(ms)
        writer.close()
    trainer.rollouts = rollouts
    return rows, last


def floor(trainer, samples, repeat: int) -> dict:
    """Median ms of the bare math of one step's batch (see the module doc)."""
    from orbitrl.rl.batch import pack, score

    model, dev = trainer.model, trainer.device
    batch = pack(samples, dev)
    T = trainer.cfg.rollout.temperature or 1.0
    need_ref = trainer.kl_ctl.value > 0 or trainer.cfg.algo.kl_in_reward

    def fwd():
        with torch.no_grad():
            score(model, batch, T)

    def ref():
        with torch.no_grad(), trainer.anchors.anchored() as ref_model:
            score(ref_model, batch, T)

    # the scoring passes the step runs: the old policy's unless the update supplies it
    old_pass = not trainer.scorer.old_from_update(trainer.step_idx)

    def scoring():
        if old_pass:
            fwd()
        if need_ref:
            ref()

    def fwd_bwd():
        model.train()
        lp = score(model, batch, T)
        (lp * batch.mask).sum().backward()
        model.eval()
        for p in trainer.policy.trainable:
            p.grad = None

    out = {}
    for name, fn in (("generate", fwd), ("score", scoring), ("train", fwd_bwd)):
        fn()
        times = []
        for _ in range(repeat):
            _sync(dev)
            t0 = time.perf_counter()
            fn()
            _sync(dev)
            times.append(1000 * (time.perf_counter() - t0))
        out[name] = statistics.median(times)
    out["total"] = out["generate"] + out["score"] + out["train"]
    out["score_passes"] = int(old_pass) + int(need_ref)
    return out


def compare_workers(trainer, steps: int) -> str:
    """The same trainer's steps alternating between one worker and ``train.workers``
    (``rl/parallel.py``), interleaved so both see the same machine load: median ms per
    phase and the ratio."""
    from orbitrl.rl.parallel import Workers

    many = trainer.updater.workers
    if many.n < 2:
        return "train.workers resolves to 1 here (see rl/parallel.py): no comparison"
    one = Workers(1)
    res: dict = {1: [], many.n: []}
    for i in range(2 * steps):
        w = (one, many)[(i + i // 2) % 2]  # 1, n, n, 1, 1, n, ...: neither always first
        trainer.scorer.workers = trainer.updater.workers = w
        _sync(trainer.device)
        t0 = time.perf_counter()
        row = trainer.step()
        _sync(trainer.device)
        ms = {p: 1000 * row.get(f"time_{p}_s", 0.0) for p in ("rollout", "score", "train")}
        ms["step"] = 1000 * (time.perf_counter() - t0)
        res[w.n].append(ms)
    trainer.scorer.workers = trainer.updater.workers = many
    lines = [f"train.workers 1 against {many.n}, {steps} interleaved steps each (median ms):",
             f"| phase | 1 worker | {many.n} workers | ratio |", "|---|---:|---:|---:|"]
    for p in ("rollout", "score", "train", "step"):
        a = statistics.median(r[p] for r in res[1])
        b = statistics.median(r[p] for r in res[many.n])
        lines.append(f"| {p} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")
    return "\n".join(lines)


def report(device: str, rows: list[dict], fl: dict, threads: int) -> str:
    step_mean = statistics.fmean(r["step"] for r in rows)
    lines = [f"device {device}, train.threads={threads}, {len(rows)} timed steps",
             f"| phase | mean ms | median ms | share of step |",
             f"|---|---:|---:|---:|"]
    for p in (*PHASES, "other", "step"):
        v = [r[p] for r in rows]
        m = statistics.fmean(v)
        lines.append(f"| {p} | {m:.1f} | {statistics.median(v):.1f} | "
                     f"{100 * m / step_mean:.0f}% |")
    cpu = [r["cpu"] for r in rows]
    lines.append(f"| step, process CPU time | {statistics.fmean(cpu):.1f} | "
                 f"{statistics.median(cpu):.1f} | |")
    lines.append(f"| of it, system time | {statistics.fmean(r['sys'] for r in rows):.1f} | "
                 f"{statistics.median(r['sys'] for r in rows):.1f} | |")
    lines.append(f"| page faults per step (count) | "
                 f"{statistics.fmean(r['faults'] for r in rows):.0f} | "
                 f"{statistics.median(r['faults'] for r in rows):.0f} | |")
    med = statistics.median(r["step"] for r in rows)
    lines += ["", "| floor (same batch, same model) | median ms |", "|---|---:|",
              f"| generate: one no-grad forward of the rollout's tokens | {fl['generate']:.1f} |",
              f"| score: the step's no-grad scoring forwards ({fl['score_passes']}) | "
              f"{fl['score']:.1f} |",
              f"| train: forward + backward | {fl['train']:.1f} |",
              f"| total | {fl['total']:.1f} |", "",
              f"step / floor: {med / fl['total']:.2f}x (median step {med:.1f} ms, overhead "
              f"{med - fl['total']:.1f} ms); rollout / generate floor "
              f"{statistics.median(r['rollout'] for r in rows) / fl['generate']:.2f}x, "
              f"score / floor {statistics.median(r['score'] for r in rows) / fl['score']:.2f}x, "
              f"train / floor {statistics.median(r['train'] for r in rows) / fl['train']:.2f}x"]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=10, help="floor repetitions")
    ap.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    ap.add_argument("--threads", type=int, default=1, help="train.threads (0: torch's)")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    metavar="KEY=VALUE", help="a config override, as for orbitrl train")
    ap.add_argument("--json", help="also write the per-step timings here")
    ap.add_argument("--compare-workers", type=int, default=10, metavar="N",
                    help="then N interleaved steps each with one worker and with "
                         "train.workers (0: skip)")
    a = ap.parse_args()
    devices = ["cpu", "cuda"] if a.device == "all" else [a.device]
    if "cuda" in devices and not torch.cuda.is_available():
        devices.remove("cuda")
        print("no CUDA device: CPU only")
    dump = {}
    for dev in devices:
        trainer = build(dev, a.threads, a.overrides)
        rows, samples = time_steps(trainer, a.warmup, a.steps)
        fl = floor(trainer, samples, a.repeat)
        print(report(dev, rows, fl, a.threads) + "\n", flush=True)
        if a.compare_workers:
            print(compare_workers(trainer, a.compare_workers) + "\n", flush=True)
        dump[dev] = dict(steps=rows, floor=fl)
        trainer.close()
        del trainer
    if a.json:
        Path(a.json).write_text(json.dumps(dump, indent=1))


if __name__ == "__main__":
    main()
