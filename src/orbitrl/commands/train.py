"""`orbitrl train [CONFIG.yaml] [--set a.b=c ...] [--out RUN_DIR]`.

With no arguments: GRPO with LoRA on an NF4 base over the built-in tiny model and
arithmetic task; held-out accuracy is evaluated before and after.
"""

from __future__ import annotations

import time
from pathlib import Path

from orbitrl.commands._common import add_config_args, config_from_args
from orbitrl.errors import OrbitError, first_line


def add_arguments(parser):
    add_config_args(parser)
    parser.add_argument("--resume", metavar="RUN_DIR",
                        help="continue a run from its last checkpoint")


def run(args) -> int:
    if args.resume:
        run_dir = Path(args.resume)
        if not (run_dir / "config.yaml").exists():
            raise OrbitError(f"{run_dir}: not a run directory (no config.yaml to resume)")
        from orbitrl.config import load_config  # start-up: kept off --help

        cfg = load_config(run_dir / "config.yaml", args.overrides)
    else:
        cfg = config_from_args(args)
    import torch  # start-up: kept off --help

    from orbitrl.distributed.env import init_distributed, shutdown  # start-up: kept off --help
    from orbitrl.rl.run import print_summary, run_training  # start-up: kept off --help

    if cfg.train.threads > 0:
        torch.set_num_threads(cfg.train.threads)
    dist = init_distributed(cfg)  # one process unless launched by torchrun
    # every rank writes into rank 0's run directory (a timestamp could differ per rank)
    out = Path(dist.broadcast_object(
        args.resume or args.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}"))
    try:
        summary = run_training(cfg, out, resume=bool(args.resume), dist=dist)
    except OrbitError:  # (SystemExit and KeyboardInterrupt are not Exceptions)
        raise
    except Exception as e:
        if not dist.enabled or not _is_comm_error(e):
            raise
        # a peer died or hung: its collective failed here; nothing is saved now (that would
        # need the lost rank), the last complete checkpoint stays the resume point
        first = first_line(e).rsplit("] ", 1)[-1][:200]  # gloo prefixes its source location
        raise OrbitError(f"rank {dist.rank}/{dist.world}: lost another rank mid-step (it "
                         f"exited, or a collective waited past dist.timeout_s="
                         f"{dist.timeout_s:g}s): {first}; resume from the last checkpoint "
                         f"with: orbitrl train --resume {out}") from None
    if dist.is_main:
        print_summary(summary, out)
    shutdown(dist)
    return 0


def _is_comm_error(e: BaseException) -> bool:
    """Errors a failed collective raises (gloo/NCCL, timeouts, a closed connection)."""
    import torch.distributed as td  # start-up: kept off --help

    names = ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError")
    if isinstance(e, tuple(getattr(td, n) for n in names if hasattr(td, n))):
        return True
    msg = str(e).lower()
    return isinstance(e, RuntimeError) and any(w in msg for w in (
        "gloo", "nccl", "connection", "timed out", "timeout", "peer", "socket"))
