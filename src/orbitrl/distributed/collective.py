"""What the RL step asks of the other ranks, in one place: a ``Collective`` evens the ranks
out (every rank runs the same forwards, micro-batches and reductions, whatever share of the
batch it holds) and is the identity on one process, so the step's code has no rank branches.

It wraps the process's :class:`Dist` (rank, world, reductions) and the sharded-model
operations of ``fsdp.py`` and ``batch.py``; each method says what it does with one process.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from orbitrl.distributed.batch import join_empty, on_global_batch
from orbitrl.distributed.env import Dist
from orbitrl.distributed.fsdp import gathered, idle_backward, lockstep, rollout_weights, \
    shard_policy, sum_grads
from orbitrl.distributed.metrics import reduce_row
from orbitrl.train.optim import is_fused


class Collective:
    def __init__(self, dist: Dist | None = None):
        self.dist = dist or Dist()

    # ---- who we are -------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.dist.enabled

    @property
    def world(self) -> int:
        return self.dist.world

    @property
    def is_main(self) -> bool:
        return self.dist.is_main

    def share(self, n: int) -> tuple[int, int]:
        """[start, end) of this rank's share of ``n`` items ((0, n) on one process)."""
        return self.dist.share(n)

    # ---- reductions (identity on one process) -----------------------------------------
    def all_sum(self, x):
        return self.dist.all_sum(x)

    def all_max(self, x):
        return self.dist.all_max(x)

    def any(self, flag: bool) -> bool:
        return self.dist.any(flag)

    def gather(self, items: list) -> list:
        """Every rank's list, concatenated in rank order (``items`` on one process)."""
        return [x for xs in self.dist.gather_objects(items) for x in xs]

    def gather_objects(self, obj) -> list:
        return self.dist.gather_objects(obj)

    def barrier(self):
        self.dist.barrier()

    # ---- the model ----------------------------------------------------------------------
    def shard(self, policy, cfg) -> None:
        """Shard the policy's weights over the ranks (FSDP2); nothing on one process."""
        if self.enabled:
            shard_policy(policy, self.dist, cfg)

    def attach(self, opt) -> None:
        """A fused optimizer on shards all-reduces its norms and factored moments."""
        if self.enabled and is_fused(opt):
            opt.reduce_sum = self.dist.all_sum

    def lockstep(self, model):
        """A data-dependent number of forwards, matched by idle ones on ranks done first."""
        return lockstep(model, self.dist)

    def rollout_weights(self, model, mode: str, reshard_after_forward: bool):
        """The weights generation runs on (``dist.rollout_weights``): lockstep otherwise."""
        return rollout_weights(model, self.dist, mode, reshard_after_forward)

    @contextmanager
    def gathered(self, model):
        """The whole weights on every rank for the block (the model itself on one process)."""
        if not self.enabled:
            yield model
            return

        with gathered(model):
            yield model

    # ---- evening out ----------------------------------------------------------------------
    def on_global_batch(self, fn, *tensors):
        """``fn`` over every rank's rows, this rank's rows back (``fn(*tensors)`` on one)."""
        return on_global_batch(self.dist, fn, *tensors)

    def join_scoring(self, model, n_tensors: int | None, device) -> None:
        """A rank that kept no samples joins the others' scoring forwards and, when the
        advantages are batch-wide (``n_tensors`` given), their gather; a no-op on one
        process."""
        if not self.enabled:
            return
        with self.lockstep(model):
            pass
        if n_tensors:
            join_empty(self.dist, n_tensors, device)

    def micro_batches(self, n: int) -> int:
        """The micro-batch count every rank runs (each is a collective): the most any has."""
        return int(self.all_max(n))

    def idle_backward(self, model) -> torch.Tensor:
        """A zero-loss forward + backward for a rank out of micro-batches."""
        return idle_backward(model)

    def sum_grads(self, params) -> None:
        """Sum replicated parameters' gradients over ranks (nothing on one process)."""
        sum_grads(params, self.dist)

    def reduce_row(self, row: dict) -> dict:
        """The run's metrics row from every rank's (``row`` on one process)."""
        return reduce_row(row, self.dist)
