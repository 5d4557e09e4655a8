"""`orbitrl train [CONFIG.yaml] [--set a.b=c ...] [--out RUN_DIR]`.

With no arguments: GRPO with LoRA on an NF4 base over the built-in tiny model and
arithmetic task; held-out accuracy is evaluated before and after.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from orbitrl.commands._common import add_config_args, config_from_args
from orbitrl.errors import OrbitError, first_line


def add_arguments(parser):
    add_config_args(parser)
    parser.add_argument("--resume", metavar="RUN_DIR",
                        help="continue a run from its last checkpoint")
    parser.add_argument("--plan", metavar="PLAN.json",
                        help="run a plan written by `orbitrl plan --out`: its settings apply "
                             "first, the config file and --set override them")


def _load_plan(args):
    """(plan document, config base layer) for --plan, checked against this launch."""
    from orbitrl.config import load_config  # start-up: kept off --help
    from orbitrl.ledger.plan_file import (  # start-up: kept off --help
        check_world, read_plan, settings_layer)

    if args.resume:
        raise OrbitError(f"--plan {args.plan}: not with --resume (the run's config.yaml "
                         f"already holds its settings)")
    doc = read_plan(args.plan)
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        world = 1
    check_world(doc, args.plan, world)
    base = settings_layer(doc)
    try:  # a bad value names the plan file, not the config layers over it
        load_config(None, None, base=base)
    except OrbitError as e:
        raise OrbitError(f"--plan {args.plan}: settings: {e}") from None
    return doc, base


def run(args) -> int:
    plan_doc = base = None
    if getattr(args, "plan", None):
        plan_doc, base = _load_plan(args)
    if args.resume:
        run_dir = Path(args.resume)
        if not (run_dir / "config.yaml").exists():
            raise OrbitError(f"{run_dir}: not a run directory (no config.yaml to resume)")
        from orbitrl.config import load_config  # start-up: kept off --help

        cfg = load_config(run_dir / "config.yaml", args.overrides)
    elif base is not None:
        from orbitrl.config import load_config  # start-up: kept off --help

        cfg = load_config(args.config, args.overrides, base=base)
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
    if dist.is_main and plan_doc is not None and summary:
        _add_plan_entry(summary, plan_doc, args.plan, out)
    if dist.is_main:
        print_summary(summary, out)
    shutdown(dist)
    return 0


def _add_plan_entry(summary: dict, doc: dict, path: str, out: Path):
    """summary.json's ``plan``: the plan's predictions beside the run's measurements."""
    from orbitrl.ledger.plan_file import (  # start-up: kept off --help
        compare, measured_step_seconds)

    step_s, steps = measured_step_seconds(out / "metrics.jsonl")
    summary["plan"] = compare(doc, path, summary, step_s, steps)
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, out / "summary.json")


def _is_comm_error(e: BaseException) -> bool:
    """Errors a failed collective raises (gloo/NCCL, timeouts, a closed connection)."""
    import torch.distributed as td  # start-up: kept off --help

    names = ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError")
    if isinstance(e, tuple(getattr(td, n) for n in names if hasattr(td, n))):
        return True
    msg = str(e).lower()
    return isinstance(e, RuntimeError) and any(w in msg for w in (
        "gloo", "nccl", "connection", "timed out", "timeout", "peer", "socket"))
