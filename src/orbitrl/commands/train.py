"""`orbitrl train [CONFIG.yaml] [--set a.b=c ...] [--out RUN_DIR]`.

With no arguments: GRPO with LoRA on an NF4 base over the built-in tiny model and
arithmetic task; held-out accuracy is evaluated before and after.
"""

from __future__ import annotations

import time
from pathlib import Path

from orbitrl.commands._common import add_config_args, config_from_args
from orbitrl.errors import OrbitError


def add_arguments(parser):
    add_config_args(parser)
    parser.add_argument("--resume", metavar="RUN_DIR",
                        help="continue a run from its last checkpoint")


def run(args) -> int:
    if args.resume:
        run_dir = Path(args.resume)
        if not (run_dir / "config.yaml").exists():
            raise OrbitError(f"{run_dir}: not a run directory (no config.yaml to resume)")
        from orbitrl.config import load_config

        cfg = load_config(run_dir / "config.yaml", args.overrides)
    else:
        cfg = config_from_args(args)
    import torch

    from orbitrl.rl.run import print_summary, run_training

    if cfg.train.threads > 0:
        torch.set_num_threads(cfg.train.threads)
    out = Path(args.resume or args.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    summary = run_training(cfg, out, resume=bool(args.resume))
    print_summary(summary, out)
    return 0
