"""Start N ranks of a command on this machine, as torchrun would, with a hard timeout.

For tests and benchmarks: each rank is a subprocess in its own process group with the
variables torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT`` on a free port), one thread per rank. Past ``timeout_s`` every rank's
process group is killed and :class:`LaunchTimeout` raised with each rank's output tail, so
a hang fails the caller instead of stalling it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass


@dataclass
class RankResult:
    rank: int
    returncode: int
    stdout: str
    stderr: str


class LaunchTimeout(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def start(argv: list[str], nprocs: int, env: dict | None = None, cwd=None) -> list:
    """Start the ranks; returns their ``Popen`` objects (stdout/stderr to temp files)."""
    import tempfile

    port = free_port()
    procs = []
    for r in range(nprocs):
        out = tempfile.TemporaryFile(mode="w+")
        err = tempfile.TemporaryFile(mode="w+")
        p = subprocess.Popen(argv, env=rank_env(r, nprocs, port, env), cwd=cwd, stdout=out,
                             stderr=err, start_new_session=True)
        p.out, p.err = out, err
        procs.append(p)
    return procs


def kill(p, sig=signal.SIGKILL):
    """Signal one rank's whole process group (the rank and anything it started)."""
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def wait(procs: list, timeout_s: float) -> list[RankResult]:
    """Wait for every rank; past ``timeout_s`` kill them all and raise LaunchTimeout."""
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            for p in procs:
                kill(p)
            for p in procs:
                p.wait()
            res = _collect(procs)
            tails = " | ".join(f"rank {r.rank}: {r.stderr[-600:]}" for r in res)
            raise LaunchTimeout(f"ranks still running after {timeout_s:.0f}s: {tails}")
        time.sleep(0.1)
    return _collect(procs)


def _collect(procs) -> list[RankResult]:
    out = []
    for r, p in enumerate(procs):
        p.out.seek(0)
        p.err.seek(0)
        out.append(RankResult(r, p.returncode, p.out.read(), p.err.read()))
        p.out.close()
        p.err.close()
    return out


def run(argv: list[str], nprocs: int, timeout_s: float, env: dict | None = None,
        cwd=None) -> list[RankResult]:
    """Start ``nprocs`` ranks of ``argv`` and wait for them (see :func:`wait`)."""
    return wait(start(argv, nprocs, env, cwd), timeout_s)


def orbitrl_argv(*args: str) -> list[str]:
    """``python -m orbitrl ARGS`` with this interpreter."""
    return [sys.executable, "-m", "orbitrl", *args]
