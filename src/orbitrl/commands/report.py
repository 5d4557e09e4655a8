"""`orbitrl report RUN_DIR [--out DIR]`: PNG plots and report.html (default RUN_DIR/report/).
`orbitrl report RUN_A RUN_B ... --out DIR [--labels a,b] [--x step|time]`: the runs' reward
(and KL, entropy, logprob gap, alignment) curves overlaid, with compare.html."""

from __future__ import annotations

from pathlib import Path

from orbitrl.errors import OrbitError


def add_arguments(parser):
    parser.add_argument("run_dir", nargs="+", help="one run directory, or several to overlay")
    parser.add_argument("--out", help="output directory (default: RUN_DIR/report; "
                        "required with several runs)")
    parser.add_argument("--labels", help="several runs: comma-separated legend labels "
                        "(default: the directory names)")
    parser.add_argument("--x", default="step", choices=("step", "time"),
                        help="several runs: x axis, step or summed step seconds")


def run(args) -> int:
    if len(args.run_dir) > 1:
        from orbitrl.observe.compare import overlay  # start-up: kept off --help

        if not args.out:
            raise OrbitError("several run directories: give --out DIR for the comparison")
        labels = args.labels.split(",") if args.labels else None
        page = overlay([Path(d) for d in args.run_dir], Path(args.out), labels, args.x)
        print(f"wrote {page}")
        return 0
    from orbitrl.observe.report import make_report  # start-up: kept off --help

    run_dir = args.run_dir[0]
    if not Path(run_dir).is_dir():
        raise OrbitError(f"{run_dir}: not a run directory")
    page = make_report(Path(run_dir), Path(args.out) if args.out else None)
    print(f"wrote {page}")
    return 0
