"""`orbitrl report RUN_DIR [--out DIR]`: PNG plots and report.html (default RUN_DIR/report/)."""

from __future__ import annotations

from pathlib import Path

from orbitrl.errors import OrbitError


def add_arguments(parser):
    parser.add_argument("run_dir")
    parser.add_argument("--out", help="output directory (default: RUN_DIR/report)")


def run(args) -> int:
    from orbitrl.observe.report import make_report

    if not Path(args.run_dir).is_dir():
        raise OrbitError(f"{args.run_dir}: not a run directory")
    page = make_report(Path(args.run_dir), Path(args.out) if args.out else None)
    print(f"wrote {page}")
    return 0
