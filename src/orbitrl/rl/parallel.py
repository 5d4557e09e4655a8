"""Micro-batches on several CPU cores at once: one Python thread per core, one intra-op
thread each (``train.workers``).

A small model's scoring and training forwards are bound by their kernels, not by Python
(the GEMMs over a packed [rows, tokens] batch), and torch releases the GIL inside every
kernel; so two micro-batches on two threads take about the time of one, where two intra-op
threads on one GEMM of that size mostly wait on each other (and on a shared machine, on a
busy core). The engine's decode steps stay on one thread: they are Python-bound.

Results come back in item order, and the update sums its micro-batches' gradients in that
order on the calling thread (:func:`accumulate`), so a run is bit for bit the one that runs
the same micro-batches one after another. The batch is cut into at least as many
micro-batches as workers (:func:`split_parts`), so a run with two workers is not the
one-worker run of the default ``micro_batch_tokens`` (a different cut rounds differently,
about 1e-6 in the adapters after a step).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Sequence

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from orbitrl.observe.metrics import count_ops_here


def resolve_workers(cfg, device: torch.device, distributed: bool, fused: bool,
                    critic: bool, mixture: bool = False) -> int:
    """``train.workers`` (0 = auto), or 1 where micro-batches cannot run side by side or
    should not: a device (one stream); several processes (their collectives run in
    lockstep); a fused optimizer (it updates the weights during backward); PPO's critic
    (it steps between micro-batches); intra-op threads already using the cores; LoRA dropout
    (draws from the one random generator in thread order); full mode (two micro-batches'
    activations and whole-model gradients at once, which the memory ledger does not price);
    a mixture (its router losses are per-micro-batch means, so a cut would weigh them
    again); the overlapped mode (its rollout thread already takes the second core). Else
    auto takes the cores, at most 2."""
    w = cfg.train.workers
    serial = (device.type != "cpu" or distributed or fused or critic
              or cfg.train.threads != 1 or cfg.lora.dropout > 0 or cfg.train.mode != "adapter"
              or mixture or cfg.rollout.overlap)
    if serial:
        return 1
    if w == 0:
        return max(1, min(2, cores()))
    return w


def cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else (os.cpu_count() or 1)


@contextmanager
def intra_op_threads(n: int):
    """The calling thread's intra-op threads set to ``n`` inside (0: left as they are),
    restored after."""
    if n <= 0:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Workers:
    """Runs ``fn`` over items on ``n`` threads (the caller's among them)."""

    def __init__(self, n: int, threads: int = 1):
        self.n = n  # ``threads``: intra-op threads per worker (train.threads)
        self.pool = ThreadPoolExecutor(n - 1, thread_name_prefix="orbitrl-mb",
                                       initializer=torch.set_num_threads,
                                       initargs=(threads,)) if n > 1 else None

    def map(self, fn: Callable, items: Sequence) -> list:
        """[fn(item) for item in items], up to ``n`` at a time; the first error is raised
        once every running item is done. ``fn`` runs under the caller's grad mode on every
        thread (grad mode is per thread, and carried over here); inference mode is not
        carried: enter it inside ``fn``."""
        if self.pool is None or len(items) < 2:
            return [fn(x) for x in items]
        grad = torch.is_grad_enabled()
        counting = _get_current_dispatch_mode()  # ORBITRL_COUNT_OPS: count every thread's ops

        def call(x):
            with torch.set_grad_enabled(grad), count_ops_here(counting):
                return fn(x)

        out: list = [None] * len(items)
        for start in range(0, len(items), self.n):
            chunk = list(range(start, min(start + self.n, len(items))))
            futs = [(i, self.pool.submit(call, items[i])) for i in chunk[1:]]
            err = None
            try:
                out[chunk[0]] = call(items[chunk[0]])
            except BaseException as e:  # noqa: BLE001 - the others finish first
                err = e
            for i, f in futs:
                try:
                    out[i] = f.result()
                except BaseException as e:  # noqa: BLE001
                    err = err or e
            if err is not None:
                raise err
        return out

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None


def accumulate(params: Sequence[torch.Tensor], grads: Sequence[Sequence]) -> None:
    """Add each micro-batch's gradients (``torch.autograd.grad`` results, None for a
    parameter it did not reach) into ``.grad``, micro-batch by micro-batch in order: the
    sums ``backward()`` would have made running them one after another, in the parameter's
    own layout as ``backward()`` keeps it."""
    for gs in grads:
        for p, g in zip(params, gs):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g if g.stride() == p.stride() else torch.empty_like(p).copy_(g)
            else:
                p.grad.add_(g)


def split_parts(groups: list[list[int]], samples, parts: int) -> list[list[int]]:
    """Cut the largest micro-batch in two until there are ``parts`` (or none can be cut),
    at the prompt boundary nearest its middle token (a prompt's samples stay together, so
    a packed prompt copy still serves its whole group) or, with one prompt, at the middle
    sample."""
    groups = [list(g) for g in groups]

    def tokens(i):
        s = samples[i]
        return len(s.prompt_ids) + len(s.completion_ids)

    while len(groups) < parts:
        k = max(range(len(groups)), key=lambda j: sum(tokens(i) for i in groups[j]))
        g = groups[k]
        if len(g) < 2:
            break
        cuts = [j for j in range(1, len(g)) if samples[g[j]].group != samples[g[j - 1]].group]
        cuts = cuts or list(range(1, len(g)))
        half = sum(tokens(i) for i in g) / 2
        run = [sum(tokens(i) for i in g[:j]) for j in range(len(g) + 1)]
        cut = min(cuts, key=lambda j: abs(run[j] - half))
        groups[k:k + 1] = [g[:cut], g[cut:]]
    return groups
