"""Learning-rate sweep for the built-in task: short RL runs side by side, one per lr, each
reporting held-out accuracy before/after and the reward trend. Run before judging a
mechanism (a collapsed policy at a too-high lr says nothing about the mechanism).

    python scripts/sweep_rl_lr.py --mode adapter --lrs 1e-4 3e-4 1e-3 --seconds 120
"""

from __future__ import annotations

import argparse
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
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    a = ap.parse_args()
    results = []
    for lr in a.lrs:
        out = Path(tempfile.mkdtemp(prefix=f"sweep-{a.mode}-{lr:g}-"))
        sets = [f"train.mode={a.mode}", f"train.lr={lr}", f"train.max_seconds={a.seconds}",
                "train.max_steps=100000", "log.progress=false", *a.overrides]
        if a.optimizer:
            sets.append(f"train.optimizer={a.optimizer}")
        cmd = [sys.executable, "-m", "orbitrl", "train", "--out", str(out)]
        for s in sets:
            cmd += ["--set", s]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        s = json.loads((out / "summary.json").read_text())
        results.append((lr, s))
        print(f"lr {lr:g}: held-out {s['heldout_accuracy_before']:.3f} -> "
              f"{s['heldout_accuracy_after']:.3f}, reward {s['reward_first_20']:.3f} -> "
              f"{s['reward_last_20']:.3f}, {s['steps']} steps ({out})", flush=True)
    print("\n| lr | held-out before | held-out after | reward first 20 | reward last 20 | steps |")
    print("|---|---|---|---|---|---|")
    for lr, s in results:
        print(f"| {lr:g} | {s['heldout_accuracy_before']:.3f} | {s['heldout_accuracy_after']:.3f} "
              f"| {s['reward_first_20']:.3f} | {s['reward_last_20']:.3f} | {s['steps']} |")
