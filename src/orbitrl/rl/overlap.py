"""Overlapped mode, one step off-policy: the rollout of step k+1 runs beside training of step k.

One process, one device, the same modules. A producer thread generates (and scores the
rewards of) step j's samples while the main thread trains on step j-1's. Its policy is a
frozen copy of the adapters (``lora.adapter_view``) published after step j-2 finished
training: exactly ``queue_size`` steps behind, never more and, so that runs are
deterministic, never less. The trainer's recomputed logprobs then serve as the proximal
policy of the PPO ratio, and the truncated importance weight exp(trainer - rollout), capped
at ``algo.tis_cap``, corrects for the stale sampler, as it corrects engine/trainer
mismatch in the sequential mode; each sample's staleness (optimizer steps between the
weights it was sampled with and those it is trained on) is logged.

Training has priority: the producer thread runs at a lower OS scheduling priority (a nice
value of 10 on Linux), and the KV governor (engine/governor.py) throttles its pool when
training's memory leaves less than ``rollout.min_available_mb`` free. The queue is bounded
by the version gate: step j's rollout starts only once step j - queue_size - 1 has been
trained, so at most ``queue_size`` finished rollouts wait.

Full-parameter mode is refused: the producer would need a second copy of the weights.
"""

from __future__ import annotations

import os
import threading
import time

from orbitrl.model.lora import adapter_view, snapshot_adapters
from orbitrl.observe.metrics import PhaseTimer


class Cancelled(Exception):
    """Raised inside the engine's step hook to stop a rollout when the run stops."""


def producer(judged, device):
    """The producer thread's ``produce(j, version, cancel)``: step j's rollout (the step
    number in its sampling seed, no mode flips: the adapter view is in place) judged by
    the verifiers, with dynamic sampling's refill rounds, timed on its own timer. Built
    from the components, not the trainer.

    Args:
        judged: the run's ``rl.refill.Refill`` (``Rollouts`` then ``Scorer.judge``, round
            after round); device: where the timer measures.
    """
    def produce(j: int, version: int, cancel):
        timer = PhaseTimer(device)
        return judged(j, version, cancel, Cancelled, timer, eval_mode=False)
    return produce


class Overlap:
    """The producer thread and the versioned adapter snapshots it samples with.

    Args:
        produce: ``produce(j, version, cancel)`` -> step j's judged Rollout, sampled with
            policy ``version``; ``cancel()`` turns True when the run stops (the rollout then
            raises :class:`Cancelled`). It runs on the producer thread with the snapshot's
            adapters in place (``adapter_view``) and must not touch the trainer.
        model: the policy whose adapters are snapshotted.
        max_steps: the run's last step (nothing is produced past it).
        queue_size: how many steps the rollout runs ahead (the staleness), >= 1.
        start: the first step to produce (the trainer's iteration, after a resume).
        version: the policy version at ``start``.
        snapshots: ``{steps trained: adapter snapshot}`` to continue from (a resume); the
            snapshot of the current weights is added.
    """

    def __init__(self, produce, model, max_steps: int, queue_size: int, start: int,
                 version: int, snapshots: dict | None = None):
        self.produce, self.model, self.max_steps = produce, model, max_steps
        self.q = int(queue_size)
        self.cond = threading.Condition()
        self.snapshots = dict(snapshots or {})
        self.snapshots.setdefault(start, (version, snapshot_adapters(model)))
        self.done = start  # steps trained
        self.ready: dict[int, dict] = {}
        self.error: BaseException | None = None
        self.stopping = False
        self.next = start
        self.thread = threading.Thread(target=self._run, name="orbitrl-rollout", daemon=True)
        self.thread.start()

    # ---- the producer ------------------------------------------------------------------
    def _source(self, j: int) -> int:
        """Which trained-step count step j samples from: exactly q behind (or the start)."""
        return max(min(self.snapshots), j - self.q)

    def _run(self):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (OSError, AttributeError):
            pass
        try:
            while True:
                j = self.next
                with self.cond:
                    while not self.stopping and (
                            j >= self.max_steps or self.done < j - self.q):
                        self.cond.wait()
                    if self.stopping:
                        return
                    version, view = self.snapshots[self._source(j)]
                with adapter_view(view):
                    batch = self.produce(j, version, lambda: self.stopping)
                with self.cond:
                    self.ready[j] = batch
                    self.next = j + 1
                    self.cond.notify_all()
        except Cancelled:
            return
        except BaseException as e:  # surfaced in the training thread by get()
            with self.cond:
                self.error = e
                self.cond.notify_all()

    # ---- the training thread's side ----------------------------------------------------
    def get(self, j: int) -> tuple[dict, float]:
        """Step j's batch and the seconds the training thread waited for it."""
        t0 = time.perf_counter()
        with self.cond:
            while j not in self.ready and self.error is None:
                self.cond.wait(timeout=1.0)
                if not self.thread.is_alive() and j not in self.ready and self.error is None:
                    raise RuntimeError("overlap: the rollout thread ended without a batch")
            if self.error is not None:
                raise self.error
            return self.ready.pop(j), time.perf_counter() - t0

    def trained(self, steps_done: int, version: int):
        """Training finished ``steps_done`` steps (policy ``version``): publish its weights
        for the producer."""
        snap = (version, snapshot_adapters(self.model))
        with self.cond:
            self.done = steps_done
            self.snapshots[steps_done] = snap
            for k in [k for k in self.snapshots if k < steps_done - self.q]:
                del self.snapshots[k]
            self.cond.notify_all()

    def pending_snapshots(self) -> dict:
        """What a checkpoint must hold to continue deterministically: the snapshots the
        next ``q`` rollouts sample from (``trained`` keeps exactly those)."""
        with self.cond:
            return dict(self.snapshots)

    def stop(self):
        """Stop the producer (a rollout in flight is cancelled) and wait for it."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.thread.join()
