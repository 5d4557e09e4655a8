"""`orbitrl train [CONFIG.yaml] [--set a.b=c ...] [--out RUN_DIR]`."""

from orbitrl.commands._common import add_config_args, config_from_args
from orbitrl.errors import OrbitError


def add_arguments(parser):
    add_config_args(parser)
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")


def run(args) -> int:
    config_from_args(args)  # validates the file and overrides first
    raise OrbitError("'orbitrl train' is not yet available in this release")
