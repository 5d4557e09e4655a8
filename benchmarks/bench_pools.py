"""Separate pools on this machine's CPUs: the built-in task learned in every shape, and the
planner's predicted step time against the measured one, on two workloads.

    python benchmarks/bench_pools.py                  # learning + step-time table
    python benchmarks/bench_pools.py --only tail      # the long-tailed workload only

Each run is ``orbitrl train`` with the built-in model and task; colocated runs one process
(the default run) and, for the step-time table, 2 ranks (FSDP2, the same 2 processes the
other shapes use); separated, one_step and async run 2 ranks under torchrun (1 rollout + 1
training, gloo). Per run the table gives held-out accuracy before -> after, the largest
staleness logged (asserted <= schedule.max_staleness), and the mean measured step time
(``time_step_s``) against the mean of the planner's prediction for that step
(``time_step_predicted_s``, ``observe/schedule.py``), skipping the first 3 steps (warm-up).
The ``tail`` workload was meant to be long-tailed (temperature 1.5, rollout.max_tokens 48);
measured, the built-in model's completions stay about 5 tokens with none truncated, so it is
not: a long-tailed workload still needs a task whose answers vary in length.
The ``learn`` workload (200 steps or 100 s per run) did not fit the time available on the
shared machine and has not been run to completion.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
WORKLOADS = {
    "learn": ["train.max_steps=200", "train.max_seconds=100"],
    "tail": ["train.max_steps=16", "rollout.temperature=1.5", "rollout.max_tokens=48",
             "data.heldout_size=20"],
}


def launch(shape: str, world: int, sets: list[str], out: Path) -> float:
    env = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1")
    args = ["train", "--out", str(out), "--set", "log.progress=false",
            "--set", f"schedule.shape={shape}", "--set", "rollout.queue_size=2",
            "--set", "schedule.max_staleness=2"]
    for s in sets:
        args += ["--set", s]
    cmd = [sys.executable, "-m", "orbitrl", *args] if world == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={world}", "-m", "orbitrl", *args]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"{shape} x{world} failed:\n{r.stderr[-3000:]}")
    return time.perf_counter() - t0


def summarize(out: Path, shape: str, world: int, wall: float) -> dict:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    s = json.loads((out / "summary.json").read_text())
    tail = [r for r in rows[3:] if "time_step_s" in r] or rows
    meas = sum(r["time_step_s"] for r in tail) / len(tail)
    pred = sum(r.get("time_step_predicted_s", 0.0) for r in tail) / len(tail)
    lens = [r.get("completion_len_mean", 0) for r in tail]
    stale = max(r.get("staleness_max", 0) for r in rows)
    if shape in ("separated", "one_step", "async"):
        assert stale <= 2, f"{shape}: staleness {stale} past the bound 2"
    return {"shape": shape, "ranks": world, "steps": len(rows),
            "before": s["heldout_accuracy_before"], "after": s["heldout_accuracy_after"],
            "wall_s": wall, "step_s": meas, "pred_s": pred, "err": pred / meas - 1,
            "stale_max": stale, "len_mean": sum(lens) / len(lens),
            "trunc": sum(r.get("truncated_frac", 0) for r in tail) / len(tail),
            "balance": s.get("balance", {}).get(str(world))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=list(WORKLOADS))
    args = ap.parse_args()
    runs = [("colocated", 1), ("colocated", 2), ("separated", 2), ("one_step", 2),
            ("async", 2)]
    print("| workload | shape | ranks | steps | held-out before -> after | wall s | "
          "step s measured | step s predicted | predicted/measured - 1 | staleness max | "
          "completion len mean, truncated |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for wl, sets in WORKLOADS.items():
            if args.only and wl != args.only:
                continue
            for shape, world in runs:
                out = Path(tmp) / f"{wl}-{shape}-{world}"
                wall = launch(shape, world, sets, out)
                r = summarize(out, shape, world, wall)
                print(f"| {wl} | {shape} | {world} | {r['steps']} | {r['before']:.3f} -> "
                      f"{r['after']:.3f} | {wall:.0f} | {r['step_s']:.3f} | "
                      f"{r['pred_s']:.3f} | {r['err']:+.0%} | {r['stale_max']} | "
                      f"{r['len_mean']:.1f}, {r['trunc']:.0%} |", flush=True)


if __name__ == "__main__":
    main()
