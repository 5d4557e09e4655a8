"""Daemon worker threads on demand, for calls that may hang (rewards, environments).

Workers are started as work arrives, up to a maximum, and take tasks from one queue; a
worker idle for ``idle_s`` exits. A worker stuck in a task can be retired: it leaves the
pool at once (another is started in its place when work needs one) and its thread exits
if the task ever returns. Python cannot kill the thread; a daemon thread never keeps the
process alive. Users: ``rewards/runner.py`` (reward calls) and ``envs/calls.py``
(environment calls), which keep their own bookkeeping of what runs where.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

IDLE_S = 30.0  # an idle worker thread exits after this many seconds


class Worker:
    retired = False


class WorkerPool:
    """``handle(task, worker)`` runs each task put on :attr:`tasks` on a worker thread."""

    def __init__(self, handle: Callable, max_workers: int, name: str, idle_s: float = IDLE_S):
        self.handle, self.max_workers, self.name = handle, max(1, int(max_workers)), name
        self.idle_s = idle_s
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.live: set[Worker] = set()  # started, not retired, not exited
        self._lock = threading.Lock()

    def staff(self, wanted: int) -> None:
        """Start workers up to min(max_workers, wanted); call it after queueing tasks."""
        with self._lock:
            while len(self.live) < min(self.max_workers, wanted):
                w = Worker()
                self.live.add(w)
                threading.Thread(target=self._work, args=(w,), daemon=True,
                                 name=f"{self.name}-{id(w):x}").start()

    def retire(self, w: Worker) -> None:
        """Out of the pool now; its thread exits when (if) its task returns."""
        with self._lock:
            w.retired = True
            self.live.discard(w)

    def _work(self, w: Worker) -> None:
        while not w.retired:
            try:
                task = self.tasks.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:  # a caller staffs after queueing: recheck under the lock
                    if not self.tasks.empty():
                        continue
                    self.live.discard(w)
                return
            self.handle(task, w)
