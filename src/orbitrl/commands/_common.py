"""Argument helpers shared by subcommands."""

from __future__ import annotations

from orbitrl.errors import OrbitError


def add_config_args(parser):
    parser.add_argument("config", nargs="?", help="YAML config file (default: built-in task)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a config key, e.g. train.lr=1e-4")
    parser.add_argument("--out", help="run directory (default: runs/<timestamp>)")


def add_packed_arg(parser):
    parser.add_argument("--packed-mb", type=int, default=1024,
                        help="CPU: packed oneDNN copies of the fp32 projections, made only if "
                             "they fit this many MiB; 0 turns them off (default 1024)")


def packed_bytes(args) -> int:
    """``--packed-mb`` in bytes, checked."""
    if args.packed_mb < 0:
        raise OrbitError(f"--packed-mb {args.packed_mb}: must be 0 or more")
    return args.packed_mb << 20


def config_from_args(args):
    from orbitrl.config import load_config  # start-up: kept off --help

    return load_config(args.config, args.overrides)
