"""Continuous batching: every step, running sequences first, then waiting ones, within a
token budget and a sequence budget.

One rule covers prefill, chunked prefill, decode and recompute: a scheduled sequence gets
``min(len(seq) - seq.num_computed, tokens left in the budget)`` new tokens. When blocks run
out, the newest running sequence is preempted: its blocks are freed and it is recomputed
later (``preempt="recompute"``), or its KV is copied to host memory and copied back later
(``preempt="swap"``, the default where the device is not the host).
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
        self.num_preempted = self.num_swapped = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=_key)

    def add_running(self, seq: Sequence) -> None:
        seq.status = Status.RUNNING
        bisect.insort(self.running, seq, key=_key)

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        self.running.remove(seq)
        self.pool.free_seq(seq)

    def abort_all(self) -> list[Sequence]:
        """Drop every unfinished sequence and release its KV (the watchdog's exit)."""
        return self.abort(lambda seq: True)

    def abort(self, which) -> list[Sequence]:
        """Drop the unfinished sequences ``which(seq)`` selects and release their KV (a
        rollout rank's watchdog drops one order's samples, the others run on)."""
        dropped = [s for s in self.running + self.waiting + self.swapped if which(s)]
        for seq in dropped:
            self.pool.free_seq(seq)
            seq.swap = None
            seq.status = Status.FINISHED
            seq.finish_reason = "aborted"
        self.running = [s for s in self.running if not which(s)]
        self.waiting = [s for s in self.waiting if not which(s)]
        self.swapped = [s for s in self.swapped if not which(s)]
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
            if pool.num_free < -(-(seq.num_computed + 1) // pool.block_size):
                break
            self.swapped.pop(0)
            pool.allocate_fresh(seq, seq.num_computed)
            batch.swap_in.append(seq)
            batch.items.append((seq, 1))
            batch.copies += pool.append(seq, 1)
            self.add_running(seq)
            budget, width = budget - 1, width + 1
        while self.waiting and not preempted and budget > 0 and not self.swapped:
            seq = self.waiting[0]
            if width and width + seq.width > self.max_num_seqs:
                break
            pool.admit(seq)  # prefix-cache hits set num_computed
            num_new = min(len(seq) - seq.num_computed, budget)
            if not pool.can_append(seq, num_new):
                pool.free_seq(seq)
                break
            self.waiting.pop(0)
            batch.copies += pool.append(seq, num_new)
            batch.items.append((seq, num_new))
            self.add_running(seq)
            budget, width = budget - num_new, width + seq.width
        return batch
