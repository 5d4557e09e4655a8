"""``orbitrl`` console script: train | sft | rm | generate | plan | eval | export | report |
check-alignment.

Each subcommand lives in ``orbitrl.commands.<name>`` (dashes as underscores) with ``add_arguments(parser)`` and
``run(args) -> int``; those modules import torch lazily so that ``--help`` is instant.
Expected errors (:class:`OrbitError`) print one line and exit 2, without a traceback.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
import traceback

from orbitrl.errors import OrbitError

COMMANDS = {
    "train": "run RL post-training (GRPO/PPO); no arguments: the built-in task",
    "sft": "supervised fine-tuning on prompt/answer pairs",
    "rm": "train a reward model on chosen/rejected pairs (Bradley-Terry)",
    "generate": "sample completions for a JSONL file of prompts",
    "plan": "predict memory, bytes moved and step time for a model and cluster",
    "eval": "greedy accuracy of a model (plus adapter) on a task or data file",
    "export": "write a run's policy as PEFT adapters or a merged HF directory",
    "report": "plots and an HTML page for a run directory",
    "check-alignment": "compare the engine's and the trainer's next-token distributions",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orbitrl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        mod = importlib.import_module(f"orbitrl.commands.{name.replace('-', '_')}")
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod.add_arguments(p)
        p.set_defaults(_module=mod)
    return parser


def main(argv: list[str] | None = None) -> int:
    global _RAN
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        code = int(args._module.run(args) or 0)
        _RAN = args.command
        return code
    except OrbitError as e:
        print(f"orbitrl {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"orbitrl {args.command}: interrupted", file=sys.stderr)
        return 130


def entry():
    """The console script and ``python -m orbitrl``: :func:`main`, and its exit code. A
    rank of a torchrun launch (a process that created a process group) leaves through
    ``distributed.env.exit_now`` whichever way the command ended (see there)."""
    try:
        code = main()
    except BaseException as e:
        if _rank_env() is None:
            raise
        code = _exit_code(e)
    dist_env = _rank_env()
    if dist_env is not None:
        dist_env.exit_now(code)
    # the interpreter's last collections at exit walk every object torch and the command
    # left (0.4-0.5 s measured after `import torch` alone); frozen, they are skipped and
    # the rest is finalised as usual. Not with triton loaded: its nanobind bindings list
    # every object still alive at exit as a leak (cycles the skipped collection would free)
    if "triton" not in sys.modules:
        gc.freeze()
        if _RAN in LEAVE_AT_ONCE:
            # nothing of it is left to write: skip the interpreter's finalisation and
            # torch's static destructors (0.1 of 0.2 s after `orbitrl generate`)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    sys.exit(code)


# commands that have written and closed everything when they return, and start no thread
# or process that would need the interpreter's shutdown
LEAVE_AT_ONCE = ("generate",)
_RAN: str | None = None  # the command main() ran to completion


def _rank_env():
    """``orbitrl.distributed.env`` when this process created a process group, else None."""
    dist_env = sys.modules.get("orbitrl.distributed.env")
    return dist_env if dist_env is not None and dist_env.joined_group() else None


def _exit_code(e: BaseException) -> int:
    """The status the interpreter would exit with for ``e`` (a traceback printed for an
    error, as it would print it)."""
    if isinstance(e, SystemExit):
        if e.code is None or isinstance(e.code, int):
            return int(e.code or 0)
        print(e.code, file=sys.stderr)
        return 1

    traceback.print_exception(e)
    return 1


if __name__ == "__main__":
    entry()
