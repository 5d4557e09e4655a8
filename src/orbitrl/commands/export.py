"""`orbitrl export` (not yet available in this release)."""

from orbitrl.errors import OrbitError


def add_arguments(parser):
    parser.add_argument("rest", nargs="*", help="(not yet available)")


def run(args) -> int:
    raise OrbitError("'orbitrl export' is not yet available in this release")
