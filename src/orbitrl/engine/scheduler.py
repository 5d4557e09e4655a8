"""Continuous batching: every step, running sequences first, then waiting ones, within a
token budget and a sequence budget.

One rule covers prefill, chunked prefill, decode and recompute: a scheduled sequence gets
``min(len(seq) - seq.num_computed, tokens left in the budget)`` new tokens. When blocks run
out, the newest running sequence is preempted: its blocks are freed and it is recomputed
later (``preempt="recompute"``), or its KV is copied to host memory and copied back later
(``preempt="swap"``, the default where the device is not the host).

A sequence whose params say ``keep_kv`` is parked when it finishes (a trajectory waiting for
its environment): its blocks stay referenced, outside the running queue. When blocks run
out, parked sequences are swapped to host memory first (oldest first), before any running
one is preempted: a waiting trajectory is the coldest KV there is.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from orbitrl.engine.block_pool import BlockPool
from orbitrl.engine.sequence import Sequence, Status


@dataclass
class Batch:
    items: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, num_new)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write blocks
    swap_in: list[Sequence] = field(default_factory=list)  # seqs whose KV comes back first


def _key(seq: Sequence):
    return (seq.arrival, seq.sample)


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int,
                 preempt: str = "recompute", swap_out=None):
        self.pool, self.preempt_mode, self.swap_out = pool, preempt, swap_out
        self.max_num_seqs, self.max_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: list[Sequence] = []  # sorted by priority
        self.swapped: list[Sequence] = []
        self.running: list[Sequence] = []  # sorted by priority
        self.parked: list[Sequence] = []  # finished a turn (oldest first); KV resident, or
        # on the host when ``seq.swap`` is set
        self.num_preempted = self.num_swapped = self.num_parked_evicted = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=_key)

    def add_running(self, seq: Sequence) -> None:
        seq.status = Status.RUNNING
        bisect.insort(self.running, seq, key=_key)

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        if seq.params.keep_kv:
            seq.status = Status.PARKED
            self.parked.append(seq)
        else:
            seq.status = Status.FINISHED
            self.pool.free_seq(seq)

    def evict_parked(self, seq: Sequence | None = None) -> Sequence | None:
        """Swap a parked sequence's KV to host memory and free its blocks (the oldest
        resident one when ``seq`` is None); returns it, or None when none is resident."""
        if seq is None:
            seq = next((s for s in self.parked if s.swap is None), None)
            if seq is None:
                return None
        self.swap_out(seq)
        self.num_parked_evicted += 1
        return seq

    def release(self, seq: Sequence) -> None:
        """Free a parked sequence for good (its trajectory ended)."""
        if seq in self.parked:
            self.parked.remove(seq)
        self.pool.free_seq(seq)
        seq.swap = None
        seq.status = Status.FINISHED

    def abort(self, which) -> list[Sequence]:
        """Drop the unfinished sequences ``which(seq)`` selects, parked ones included, and
        release their KV (a rollout rank's watchdog drops one order's samples, the others
        run on)."""
        dropped = [s for s in self.running + self.waiting + self.swapped + self.parked
                   if which(s)]
        for seq in dropped:
            self.pool.free_seq(seq)
            seq.swap = None
            seq.status = Status.FINISHED
            seq.finish_reason = "aborted"
        gone = {id(s) for s in dropped}
        self.running = [s for s in self.running if id(s) not in gone]
        self.waiting = [s for s in self.waiting if id(s) not in gone]
        self.swapped = [s for s in self.swapped if id(s) not in gone]
        self.parked = [s for s in self.parked if id(s) not in gone]
        return dropped

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def _preempt(self, seq: Sequence) -> None:
        self.num_preempted += 1
        if self.preempt_mode == "swap":
            self.swap_out(seq)  # host copy of its computed KV, then its blocks are freed
            seq.status = Status.SWAPPED
            self.num_swapped += 1
            bisect.insort(self.swapped, seq, key=_key)
        else:
            self.pool.free_seq(seq)
            self.add(seq)

    def schedule(self) -> Batch:
        batch, budget, pool, preempted = Batch(), self.max_tokens, self.pool, False
        queue, self.running = self.running, []
        while queue and budget > 0:
            seq = queue.pop(0)
            num_new = min(len(seq) - seq.num_computed, budget)
            while not pool.can_append(seq, num_new) and self.evict_parked():
                pass
            while not pool.can_append(seq, num_new):
                preempted = True
                if queue:
                    self._preempt(queue.pop())
                else:
                    self._preempt(seq)
                    seq = None
                    break
            if seq is None:
                break
            batch.copies += pool.append(seq, num_new)
            batch.items.append((seq, num_new))
            self.running.append(seq)
            budget -= num_new
        self.running += queue  # not scheduled this step (budget spent); keep their blocks
        width = sum(s.width for s in self.running)
        while self.swapped and not preempted and budget > 0 and width < self.max_num_seqs:
            seq = self.swapped[0]
            # a preempted sequence has one token to compute; a resumed trajectory its turn's
            num_new = max(1, min(len(seq) - seq.num_computed, budget))
            need = -(-(seq.num_computed + num_new) // pool.block_size)
            while pool.num_free < need and self.evict_parked():
                pass
            if pool.num_free < need:
                break
            self.swapped.pop(0)
            pool.allocate_fresh(seq, seq.num_computed)
            batch.swap_in.append(seq)
            batch.items.append((seq, num_new))
            batch.copies += pool.append(seq, num_new)
            self.add_running(seq)
            budget, width = budget - num_new, width + 1
        while self.waiting and not preempted and budget > 0 and not self.swapped:
            seq = self.waiting[0]
            if width and width + seq.width > self.max_num_seqs:
                break
            pool.admit(seq)  # prefix-cache hits set num_computed
            num_new = min(len(seq) - seq.num_computed, budget)
            while not pool.can_append(seq, num_new) and self.evict_parked():
                pass
            if not pool.can_append(seq, num_new):
                pool.free_seq(seq)
                break
            self.waiting.pop(0)
            batch.copies += pool.append(seq, num_new)
            batch.items.append((seq, num_new))
            self.add_running(seq)
            budget, width = budget - num_new, width + seq.width
        return batch
