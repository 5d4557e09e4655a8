"""A pool that runs processes a few at a time, with bounded output and hard time limits.

One thread drives every process through a selector (no thread per process): it starts a
process when a worker slot is free, reads its stdout and stderr as they come, and kills its
process group when it prints more than allowed, passes its wall-clock limit, or the whole
batch passes its deadline. The caller is therefore never blocked past the deadline plus the
time to kill and reap what is still running (milliseconds).
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

STDERR_TAIL = 2048
# how often a process whose pipes are closed, or that is silent, is checked for exit
_POLL_S = 0.02
# after a kill, how long the pool keeps reading a run's pipes while its wrapper exits (a
# wrapper that reports the kill on a full stderr pipe would otherwise block on it)
_GRACE_S = 1.0


@dataclass
class RunResult:
    """The outcome of one run.

    status: ok (exit 0), runtime_error (non-zero exit), time_limit (wall or CPU), memory
    (address space exhausted), output_limit, file_limit (a file past the size limit), signal
    (killed by another signal), deadline (the batch deadline came first), sandbox_error (the
    sandbox itself failed: the program never ran). reason: one line for logs and metrics.
    stdout: at most the output limit; stderr: its first byte and last 2 KiB.
    """

    status: str
    reason: str = ""
    returncode: int | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    wall_s: float = 0.0


@dataclass
class Launch:
    """A started process (stdout and stderr are pipes, it leads its own process group) and
    what to clean up once it is reaped.

    wrapped: the process is a namespace wrapper (bwrap, unshare) whose child is the init of
    the program's pid namespace. Such a run is killed by killing that child: the kernel then
    kills the whole namespace, and the wrapper reaps the child and exits. Killing the wrapper
    instead would orphan the child to the host's init, which may never reap it (a zombie per
    killed program in a long run).
    """

    proc: subprocess.Popen
    cleanup: Callable[[], None] | None = None
    wrapped: bool = False
    # after the process is reaped: a (status, reason) that outranks its exit code (an OOM
    # kill in its memory cgroup reads as SIGKILL otherwise), or None
    explain: Callable[[], tuple[str, str] | None] | None = None


# (returncode, stderr, time_limit_s) -> (status, reason) for a process that exited by itself
Classify = Callable[[int, bytes, float], tuple[str, str]]


class _Running:
    def __init__(self, launch: Launch, slot: int, wall_end: float):
        self.launch, self.slot, self.wall_end = launch, slot, wall_end
        self.start = time.monotonic()
        self.out = bytearray()
        self.err_head = b""
        self.err_tail = bytearray()
        self.err_total = 0
        self.open = 2
        self.verdict: tuple[str, str] | None = None  # set when we killed it
        self.killed_by = 0.0  # after a kill: when to stop waiting for the pipes to close

    def feed(self, which: str, data: bytes, max_output: int) -> bool:
        """Keep what the program wrote: stdout up to ``max_output`` (past it the program is
        killed: True), stderr as its first byte and last STDERR_TAIL bytes, counted."""
        if which == "out":
            room = max_output - len(self.out)
            self.out += data[:room]
            if len(data) > room:
                if self.verdict is None:
                    self.kill("output_limit", f"stdout past {max_output} bytes")
                return True
            return False
        if not self.err_head:
            self.err_head, data = data[:1], data[1:]
        self.err_total += len(data)
        self.err_tail += data
        del self.err_tail[:-STDERR_TAIL]
        return False

    def kill(self, status: str, reason: str) -> None:
        if self.verdict is None:
            self.verdict = (status, reason)
            self.killed_by = time.monotonic() + _GRACE_S
        pid = self.launch.proc.pid
        kids = _children(pid) if self.launch.wrapped else []
        for kid in kids:
            try:
                os.kill(kid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if not kids:  # not wrapped, or the wrapper has not started its child yet
            _killpg(pid)


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc; an empty list where that is unreadable)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        pass
    kids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    # the command name may hold spaces and parentheses: split after the last ')'
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(name))
            except (OSError, ValueError, IndexError):
                pass
    return kids


def run_pool(launchers: list[Callable[[int], Launch]], workers: int, deadline_s: float,
             time_limit_s: float, max_output: int, classify: Classify) -> list[RunResult]:
    """Run every launcher's process, at most ``workers`` at once.

    Args:
        launchers: ``f(slot) -> Launch``; ``slot`` in [0, workers) is free while it runs.
        workers: processes at once.
        deadline_s: budget of the whole batch, from now.
        time_limit_s: wall-clock limit of each process, from its start.
        max_output: bytes of stdout (and, separately, of stderr) a process may write.
        classify: status and reason of a process that exited by itself.

    Returns:
        One RunResult per launcher, in order.
    """
    end = time.monotonic() + deadline_s
    results: list[RunResult | None] = [None] * len(launchers)
    queue = deque(range(len(launchers)))
    free = list(range(workers - 1, -1, -1))
    running: dict[int, _Running] = {}
    sel = selectors.DefaultSelector()

    def finish(j: int, r: _Running) -> None:
        proc = r.launch.proc
        for pipe in (proc.stdout, proc.stderr):
            try:
                sel.unregister(pipe)
            except (KeyError, ValueError):
                pass
        if r.verdict is None and not r.launch.wrapped:  # exited: stragglers of its group go too
            _killpg(proc.pid)
        for pipe in (proc.stdout, proc.stderr):  # drained: a writer left gets EPIPE, not a block
            pipe.close()
        try:
            rc = proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:  # a wrapper that did not exit after its child died
            _killpg(proc.pid)
            rc = proc.wait()
        if r.launch.cleanup:
            r.launch.cleanup()
        stderr = r.err_head + bytes(r.err_tail)
        status, reason = r.verdict or (r.launch.explain and r.launch.explain()) \
            or classify(rc, stderr, time_limit_s)
        results[j] = RunResult(status, reason, rc, bytes(r.out), stderr,
                               time.monotonic() - r.start)
        del running[j]
        free.append(r.slot)

    try:
        while queue or running:
            while queue and free and time.monotonic() < end:
                j = queue.popleft()
                slot = free.pop()
                try:
                    launch = launchers[j](slot)
                except (OSError, subprocess.SubprocessError) as e:
                    results[j] = RunResult("sandbox_error", f"could not start: {e}"[:200])
                    free.append(slot)
                    continue
                r = _Running(launch, slot, time.monotonic() + time_limit_s)
                for pipe, which in ((launch.proc.stdout, "out"), (launch.proc.stderr, "err")):
                    os.set_blocking(pipe.fileno(), False)
                    sel.register(pipe, selectors.EVENT_READ, (r, which))
                running[j] = r
            if not running:
                break
            now = time.monotonic()
            wait = min([_POLL_S, *(r.wall_end - now for r in running.values()
                                   if r.verdict is None)])
            if now < end:  # (past it every run is killed and only waits for its wrapper)
                wait = min(wait, end - now)
            for key, _ in sel.select(max(0.0, wait)):
                r, which = key.data
                try:
                    data = os.read(key.fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not data:
                    sel.unregister(key.fileobj)
                    r.open -= 1
                else:
                    r.feed(which, data, max_output)
                    if which == "err" and r.err_total > max_output and r.verdict is None:
                        r.kill("output_limit", f"stderr past {max_output} bytes")
            now = time.monotonic()
            for j, r in list(running.items()):
                if r.verdict is None and now >= end:
                    r.kill("deadline", f"batch deadline ({deadline_s:g} s)")
                elif r.verdict is None and now >= r.wall_end:
                    r.kill("time_limit", f"wall time limit ({time_limit_s:g} s)")
                exited = r.launch.proc.poll() is not None
                if r.verdict is not None:
                    # killed: keep reading its pipes (the loop above) until the wrapper has
                    # exited and they close, so nothing it writes on the way out can block
                    if (exited and r.open == 0) or now >= r.killed_by:
                        _drain(r, max_output)
                        finish(j, r)
                elif r.open == 0 or exited:
                    _drain(r, max_output)
                    finish(j, r)
        for j in queue:
            results[j] = RunResult("deadline", f"batch deadline ({deadline_s:g} s); not started")
    finally:
        for j, r in list(running.items()):  # an exception above: leave nothing running
            r.kill("sandbox_error", "pool aborted")
            finish(j, r)
        sel.close()
    return results  # type: ignore[return-value]


def _drain(r: _Running, max_output: int) -> None:
    """Read what is already in the pipes of an exited (or killed) process, bounded."""
    for pipe, which in ((r.launch.proc.stdout, "out"), (r.launch.proc.stderr, "err")):
        for _ in range(64):  # at most 4 MiB, then give up: the pipe is being refilled
            try:
                data = os.read(pipe.fileno(), 1 << 16)
            except (BlockingIOError, ValueError, OSError):
                break
            if not data:
                break
            if r.feed(which, data, max_output):
                break
