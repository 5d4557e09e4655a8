"""Environment calls on a pool of worker threads, each call with a time limit.

Calls (a ``reset`` or a ``step``) run on at most ``workers`` persistent daemon threads
that take them from one queue, so a slow environment never holds up the others and a
fast one costs no thread start-up: a worker that finishes a call takes the next at once,
while the engine decodes (a tool task's 128 calls of a turn complete within one engine
step, instead of ``workers`` per step). A hung call is abandoned at its time limit: its
result is reported as a timeout, its worker is retired (it exits if the call ever
returns) and another takes its place; Python cannot kill the thread, so it is counted in
``leaked`` (a daemon thread never keeps the process alive). A coroutine a call returns is
run to completion with ``asyncio.run`` on its worker. Exceptions are results, never raised
into the caller. An idle worker exits after ``workpool.IDLE_S``.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
import time
from dataclasses import dataclass

from orbitrl.workpool import WorkerPool


@dataclass
class CallResult:
    key: object
    value: object = None
    error: str = ""        # "" on success; "timeout" or "<Exception>: message"
    seconds: float = 0.0


class EnvCalls:
    """Runs calls concurrently (at most ``workers`` at once; the rest queue) with a time
    limit each, counted from when the call starts. One instance serves many batches:
    :meth:`cancel_all` ends a batch (its queued calls are skipped, late results dropped)
    and the workers stay for the next."""

    def __init__(self, time_limit_s: float, workers: int = 16):
        self.time_limit_s, self.workers = float(time_limit_s), max(1, int(workers))
        # tasks: (batch, key, fn, args, limit)
        self._pool = WorkerPool(self._run, self.workers, "orbitrl-env")
        self._done: queue.SimpleQueue = queue.SimpleQueue()   # (batch, CallResult)
        self._queued = 0
        self._running: dict = {}  # key -> (start time, time limit, worker)
        self._lock = threading.Lock()
        self._batch = 0
        self.leaked = 0

    def submit(self, key, fn, *args, limit_s: float | None = None) -> None:
        """Run ``fn(*args)``; ``limit_s`` overrides the time limit for this call."""
        with self._lock:
            self._queued += 1
        self._pool.tasks.put((self._batch, key, fn, args,
                              self.time_limit_s if limit_s is None else limit_s))
        self._pool.staff(self.pending)

    def _run(self, task, w) -> None:
        batch, key, fn, args, limit = task
        with self._lock:
            if batch != self._batch:  # a cancelled batch's call: skipped
                return
            self._queued -= 1
            t0 = time.perf_counter()
            self._running[key] = (t0, limit, w)
        try:
            value = fn(*args)
            if inspect.isawaitable(value):
                value = asyncio.run(_awaited(value))
            res = CallResult(key, value, "", time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001 - an environment's failure is a result
            res = CallResult(key, None, f"{type(e).__name__}: {e}"[:300],
                             time.perf_counter() - t0)
        self._done.put((batch, res))

    @property
    def pending(self) -> int:
        return self._queued + len(self._running)

    def poll(self, wait_s: float = 0.0) -> list[CallResult]:
        """Finished calls (waiting up to ``wait_s`` for the first one) and calls past their
        time limit (error "timeout"; a late result of theirs is discarded)."""
        got = []
        try:
            got.append(self._done.get(timeout=wait_s) if wait_s > 0 else self._done.get_nowait())
            while True:
                got.append(self._done.get_nowait())
        except queue.Empty:
            pass
        out = []
        with self._lock:
            for batch, r in got:
                if batch == self._batch and self._running.pop(r.key, None) is not None:
                    out.append(r)
            now = time.perf_counter()
            for key, (t0, limit, w) in list(self._running.items()):
                if now - t0 > limit:
                    del self._running[key]
                    self._pool.retire(w)  # stuck in the call: it exits if the call returns
                    self.leaked += 1
                    out.append(CallResult(key, None, "timeout", now - t0))
        self._pool.staff(self.pending)
        return out

    def cancel_all(self) -> None:
        """Forget queued and running calls (workers skip the queued ones; those running
        finish or hang on their own, counted in ``leaked``, and are replaced)."""
        with self._lock:
            self._batch += 1
            self._queued = 0
            for _, _, w in self._running.values():
                self._pool.retire(w)
            self.leaked += len(self._running)
            self._running = {}


async def _awaited(aw):
    return await aw
