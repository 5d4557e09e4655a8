"""Environment calls in worker threads, each with a time limit.

Every call (a ``reset`` or a ``step``) runs in its own daemon thread, so a slow
environment never holds up the others, and a hung one is abandoned at its time limit: its
result is reported as a timeout and its thread, which Python cannot kill, is left behind
(counted in ``leaked``; a daemon thread never keeps the process alive). A coroutine a call
returns is run to completion with ``asyncio.run`` in that thread. Exceptions are results,
never raised into the caller.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
import time
from dataclasses import dataclass


@dataclass
class CallResult:
    key: object
    value: object = None
    error: str = ""        # "" on success; "timeout" or "<Exception>: message"
    seconds: float = 0.0


class EnvCalls:
    """Runs calls concurrently (at most ``workers`` at once; the rest queue) with a time
    limit each, counted from when the call starts."""

    def __init__(self, time_limit_s: float, workers: int = 16):
        self.time_limit_s, self.workers = float(time_limit_s), max(1, int(workers))
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._queued: list = []
        self._running: dict = {}  # key -> (start time, time limit)
        self.leaked = 0

    def submit(self, key, fn, *args, limit_s: float | None = None) -> None:
        """Run ``fn(*args)``; ``limit_s`` overrides the time limit for this call."""
        self._queued.append((key, fn, args, self.time_limit_s if limit_s is None else limit_s))
        self._start()

    def _start(self) -> None:
        while self._queued and len(self._running) < self.workers:
            key, fn, args, limit = self._queued.pop(0)
            self._running[key] = (time.perf_counter(), limit)
            threading.Thread(target=self._run, args=(key, fn, args), daemon=True,
                             name="orbitrl-env").start()

    def _run(self, key, fn, args) -> None:
        t0 = time.perf_counter()
        try:
            value = fn(*args)
            if inspect.isawaitable(value):
                value = asyncio.run(_awaited(value))
            self._done.put(CallResult(key, value, "", time.perf_counter() - t0))
        except BaseException as e:  # noqa: BLE001 - an environment's failure is a result
            self._done.put(CallResult(key, None, f"{type(e).__name__}: {e}"[:300],
                                      time.perf_counter() - t0))

    @property
    def pending(self) -> int:
        return len(self._queued) + len(self._running)

    def poll(self, wait_s: float = 0.0) -> list[CallResult]:
        """Finished calls (waiting up to ``wait_s`` for the first one) and calls past their
        time limit (error "timeout"; a late result of theirs is discarded)."""
        out = []
        try:
            out.append(self._done.get(timeout=wait_s) if wait_s > 0 else self._done.get_nowait())
            while True:
                out.append(self._done.get_nowait())
        except queue.Empty:
            pass
        out = [r for r in out if self._running.pop(r.key, None) is not None]
        now = time.perf_counter()
        for key, (t0, limit) in list(self._running.items()):
            if now - t0 > limit:
                del self._running[key]
                self.leaked += 1
                out.append(CallResult(key, None, "timeout", now - t0))
        self._start()
        return out

    def cancel_all(self) -> None:
        """Forget queued and running calls (their threads finish or hang on their own)."""
        self.leaked += len(self._running)
        self._queued, self._running = [], {}


async def _awaited(aw):
    return await aw
