"""Learning-rate sweep for the built-in task: short RL runs side by side, one per lr (and per
full-mode clip mode and seed, when given), each reporting held-out accuracy before/after and
the reward trend. Run before judging a mechanism (a collapsed policy at a too-high lr says
nothing about the mechanism).

    python scripts/sweep_rl_lr.py --mode adapter --lrs 1e-4 3e-4 1e-3 --seconds 120
    python scripts/sweep_rl_lr.py --mode full --lrs 3e-4 1e-3 --clips grouped global \\
        --steps 150 --seeds 0 1       # one-pass vs two-pass AdaLomo, same steps and seeds

``--steps`` fixes the number of optimizer steps instead of a wall-clock budget, so modes of
different speed (one-pass vs two-pass clipping) are compared after the same number of
updates.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="adapter", choices=["adapter", "full"])
    ap.add_argument("--optimizer", default=None, help="full mode: sgd | adalomo | adamw")
    ap.add_argument("--lrs", nargs="+", type=float, required=True)
    ap.add_argument("--clips", nargs="+", default=[None], choices=["grouped", "global"],
                    help="full mode: train.clip values to compare")
    ap.add_argument("--seeds", nargs="+", type=int, default=[None], help="train.seed values")
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--steps", type=int, default=0, help="fixed steps instead of --seconds")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    a = ap.parse_args()
    budget = ([f"train.max_steps={a.steps}", "train.max_seconds=0"] if a.steps else
              [f"train.max_seconds={a.seconds}", "train.max_steps=100000"])
    results = []
    for lr, clip, seed in itertools.product(a.lrs, a.clips, a.seeds):
        tag = f"{lr:g}" + (f"-{clip}" if clip else "") + ("" if seed is None else f"-s{seed}")
        out = Path(tempfile.mkdtemp(prefix=f"sweep-{a.mode}-{tag}-"))
        sets = [f"train.mode={a.mode}", f"train.lr={lr}", *budget, "log.progress=false",
                *a.overrides]
        if a.optimizer:
            sets.append(f"train.optimizer={a.optimizer}")
        if clip:
            sets.append(f"train.clip={clip}")
        if seed is not None:
            sets.append(f"train.seed={seed}")
        cmd = [sys.executable, "-m", "orbitrl", "train", "--out", str(out)]
        for s in sets:
            cmd += ["--set", s]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        s = json.loads((out / "summary.json").read_text())
        results.append((lr, clip or "-", "-" if seed is None else seed, s))
        print(f"lr {lr:g} clip {clip or '-'} seed {seed}: held-out "
              f"{s['heldout_accuracy_before']:.3f} -> {s['heldout_accuracy_after']:.3f}, "
              f"reward {s['reward_first_20']:.3f} -> {s['reward_last_20']:.3f}, "
              f"{s['steps']} steps ({out})", flush=True)
    print("\n| lr | clip | seed | held-out before | held-out after | reward first 20 "
          "| reward last 20 | steps | skipped | seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for lr, clip, seed, s in results:
        print(f"| {lr:g} | {clip} | {seed} | {s['heldout_accuracy_before']:.3f} "
              f"| {s['heldout_accuracy_after']:.3f} | {s['reward_first_20']:.3f} "
              f"| {s['reward_last_20']:.3f} | {s['steps']} "
              f"| {s['steps'] - s['optimizer_steps']} | {s['wall_seconds']:.0f} |")
