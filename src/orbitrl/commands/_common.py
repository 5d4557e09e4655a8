"""Argument helpers shared by subcommands."""

from __future__ import annotations


def add_config_args(parser):
    parser.add_argument("config", nargs="?", help="YAML config file (default: built-in task)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a config key, e.g. train.lr=1e-4")
    parser.add_argument("--out", help="run directory (default: runs/<timestamp>)")


def config_from_args(args):
    from orbitrl.config import load_config

    return load_config(args.config, args.overrides)
