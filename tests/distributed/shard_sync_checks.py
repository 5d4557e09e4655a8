"""Run by test_pools.py on 3 ranks (gloo): ranks 0 and 1 are a training pool holding the
full-mode policy sharded (FSDP2 over their own group), rank 0 the leader; rank 2 a rollout
rank with whole weights. Three versions go out under delta sync (full, 1% changed, half the
buckets changed whole) while every gathered tensor (``DTensor.full_tensor``) is watched:
the elements alive at once on a training rank must stay within one bucket. Exits non-zero
on a mismatch."""

from __future__ import annotations

import weakref

import torch
import torch.distributed as td
from torch.distributed.tensor import DTensor

from orbitrl.distributed.env import Dist, exit_now
from orbitrl.distributed.fsdp import shard_model
from orbitrl.distributed.weight_sync import WeightSync, synced
from pool_checks import _policy

BUCKET = 192 << 10  # buckets of one tensor and of several


class Watch:
    """Wraps ``DTensor.full_tensor``; at each gather it adds up the bytes of the gathered
    tensors the caller still holds, views included, so ``peak`` is the most gathered bytes
    alive at once. Each result is handed out as a copy whose storage only the caller's
    tensors share (the collective's own buffer may outlive its wait for a moment on gloo's
    worker thread, which is not the caller holding it): held = its storage has users
    besides the watch's reference."""

    def __init__(self):
        self.kept: list[torch.Tensor] = []
        self.peak = self.calls = 0
        self.on = False
        users = lambda t: torch._C._storage_Use_Count(t.untyped_storage()._cdata)  # noqa: E731
        base = users(torch.empty(1))  # a tensor nothing else holds
        orig = DTensor.full_tensor

        def full_tensor(t, *a, **k):
            out = orig(t, *a, **k)
            if not self.on:
                return out
            out = out.clone()
            self.kept = [x for x in self.kept if users(x) > base] + [out.detach()]
            self.calls += 1
            self.peak = max(self.peak, sum(x.numel() * x.element_size() for x in self.kept))
            return out
        DTensor.full_tensor = full_tensor


def main():
    torch.set_num_threads(1)
    td.init_process_group("gloo")
    rank = td.get_rank()
    train = td.new_group([0, 1])
    sync = td.new_group([0, 2])
    model = _policy("full")
    if rank < 2:
        shard_model(model, Dist(rank, 2, rank, "gloo", 60.0, train))
    watch = Watch()
    ws = WeightSync(synced(model), sync if rank != 1 else None, 0, BUCKET, delta=True)
    hit = set(range(0, len(ws.groups), 2))
    gen = torch.Generator().manual_seed(10 + rank)
    stats = []
    for v in range(3):
        if rank < 2 and v > 0:  # each training rank edits its own shard
            with torch.no_grad():
                for i, ks in enumerate(ws.groups):
                    for k in ks:
                        x = ws.params[k].to_local()
                        x.add_(1e-3 if (v == 2 and i in hit) else
                               (torch.rand(x.shape, generator=gen) < 0.01).to(x.dtype))
        watch.on, watch.peak = True, 0
        if rank == 0:
            head = lambda kind, count: td.broadcast(  # noqa: E731
                torch.tensor([v, kind, count]), 0, sync)
            stats.append(ws.send(v, head))
        elif rank == 1:
            ws.join()
        else:
            head = torch.zeros(3, dtype=torch.int64)
            td.broadcast(head, 0, sync)
            stats.append(ws.receive(*head.tolist()))
        watch.on = False
        if rank < 2:
            assert watch.calls >= len(ws.params), watch.calls  # every tensor was gathered
            assert watch.peak <= max(ws.group_bytes), (v, watch.peak, ws.group_bytes)
            print(f"rank {rank}: version {v}: at most {watch.peak} gathered bytes at once "
                  f"(largest bucket {max(ws.group_bytes)}, all {ws.total_bytes})",
                  flush=True)
            watch.calls = 0
        # the rollout rank now holds the training pool's version, bit for bit
        mine = [p.full_tensor() if rank < 2 else p for p in ws.params]
        flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in mine])
        if rank != 1:
            both = [torch.zeros_like(flat), torch.zeros_like(flat)]
            td.all_gather(both, flat, group=sync)
            assert torch.equal(both[0], both[1]), f"version {v} differs after the sync"
    if rank != 1:
        assert len(ws.groups) >= 6, len(ws.groups)
        s0, s1, s2 = stats
        assert s0.kind == "full" and s0.bytes == ws.total_bytes, s0
        assert s1.kind == "delta" and s1.full_buckets == 0 and s1.bytes == 12 * s1.changed
        assert s1.bytes < 0.05 * ws.total_bytes, s1
        assert s2.kind == "delta" and s2.full_buckets == len(hit), s2
        assert all(s.bytes <= s.full_bytes == ws.total_bytes for s in stats), stats
        print(f"rank {rank}: bytes sent {[s.bytes for s in stats]} of {ws.total_bytes}")
    td.barrier()
    td.destroy_process_group()
    print(f"rank {rank}: shard_sync ok", flush=True)
    exit_now(0)  # skip the interpreter's teardown (see orbitrl.distributed.env)


if __name__ == "__main__":
    main()
