"""Run by test_pools.py on 2 ranks (gloo): rank 0 is the training leader, rank 1 a rollout
rank. Each check exits non-zero on a mismatch."""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
import torch.distributed as td

from orbitrl.distributed.channel import FINISH, WEIGHTS, Channel
from orbitrl.distributed.env import exit_now
from orbitrl.distributed.weight_sync import WeightSync, synced


def _policy(mode: str):
    from orbitrl.config import load_config
    from orbitrl.rl.policy import build_policy

    cfg = load_config(overrides=[f"train.mode={mode}", "model.base_dtype=fp32"])
    torch.manual_seed(0)
    return build_policy(cfg, torch.device("cpu")).model


def _sync(model, bucket: int, delta: bool, ch: Channel, group, rank: int, edits):
    """Three versions from rank 0 to rank 1; ``edits(params, v)`` changes rank 0's weights
    before version v. Returns each version's stats on this rank."""
    ws = WeightSync(synced(model), group, 0, bucket, delta)
    out = []
    for v in range(3):
        if rank == 0:
            with torch.no_grad():
                edits(ws.params, v)

            def announce(kind, count):
                ch.send_header(1, WEIGHTS, v, kind, count)
            out.append(ws.send(v, announce))
        else:
            (_, ver, kind, count), _ = ch.wait()
            out.append(ws.receive(ver, kind, count))
        # both sides now hold the same version, bit for bit (-0.0 is not 0.0 here)
        flat = torch.cat([p.detach().reshape(-1).view(torch.uint8) for p in ws.params])
        both = [torch.zeros_like(flat), torch.zeros_like(flat)]
        td.all_gather(both, flat, group=group)
        assert torch.equal(both[0], both[1]), f"version {v} differs after the sync"
        assert out[-1].bytes <= out[-1].full_bytes == ws.total_bytes, out[-1]
    return ws, out


def check_adapter_bytes(rank, ch, group):
    """Adapter mode moves the LoRA tensors only: bytes == the adapters' size."""
    model = _policy("adapter")
    lora = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if "lora_" in n)
    assert lora > 0

    def edit(params, v):
        for p in params:
            p.add_(0.01 * (v + 1))
    ws, stats = _sync(model, 512 << 20, False, ch, group, rank, edit)
    assert all("lora_" in n for n in ws.names), ws.names[:3]
    assert [s.bytes for s in stats] == [lora] * 3, ([s.bytes for s in stats], lora)
    assert all(s.buckets == 1 for s in stats)


def check_full_buckets(rank, ch, group):
    """Full mode in small buckets: every weight once per version, split in several
    buckets (two in flight)."""
    model = _policy("full")
    total = sum(p.numel() * p.element_size() for p in model.parameters())

    def edit(params, v):
        for p in params:
            p.mul_(1.0 + 1e-3 * (v + 1))
    ws, stats = _sync(model, 256 << 10, False, ch, group, rank, edit)
    assert [s.bytes for s in stats] == [total] * 3
    assert stats[0].buckets == len(ws.groups) >= 3, stats[0].buckets


def check_full_delta(rank, ch, group):
    """Delta sync: the first version in full, then only the changed elements (1% here,
    a column-major head included), bytes = elements x (8 + 4)."""
    model = _policy("full")
    n = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(1)

    def edit(params, v):
        if v == 0:
            return
        for p in params:
            m = torch.rand(p.shape, generator=gen) < 0.01
            p.add_(m.to(p.dtype) * 0.5)
    ws, stats = _sync(model, 64 << 10, True, ch, group, rank, edit)
    assert stats[0].kind == "full" and stats[0].bytes == 4 * n
    for s in stats[1:]:
        assert s.kind == "delta" and 0 < s.changed < 0.02 * n, (s.changed, n)
        assert s.bytes == 12 * s.changed and s.full_buckets == 0, s
        assert s.metrics()["sync_full_bytes"] == 4 * n


def check_bucket_choice(rank, ch, group):
    """Delta sync decides per bucket: a bucket whose every element changed goes whole
    (4 bytes an element, not 12), one with 1% changed goes as (index, value) pairs, so a
    sync moves at most a full copy. Version 2 changes one element from +0.0 to -0.0 (equal
    as floats, not as bits): it still travels, 12 bytes."""
    model = _policy("full")
    ws0 = WeightSync(synced(model), None, 0, 64 << 10)
    hit = [i for i in range(len(ws0.groups)) if i % 2 == 0]  # buckets changed whole
    gen = torch.Generator().manual_seed(2)

    def edit(params, v):
        if v == 1:
            for i, ks in enumerate(ws0.groups):
                for k in ks:
                    p = params[k]
                    if i in hit:
                        p.add_(1e-3)
                    else:
                        p.add_((torch.rand(p.shape, generator=gen) < 0.01).to(p.dtype))
            params[ws0.groups[1][0]].view(-1)[0] = 0.0
        if v == 2:
            params[ws0.groups[1][0]].view(-1)[0] = -0.0
    ws, stats = _sync(model, 64 << 10, True, ch, group, rank, edit)
    assert ws.groups == ws0.groups and len(ws.groups) >= 4, len(ws.groups)
    whole_bytes = sum(ws.group_bytes[i] for i in hit)
    whole_elems = sum(ws.params[k].numel() for i in hit for k in ws.groups[i])
    s = stats[1]
    assert s.kind == "delta" and s.full_buckets == len(hit), s
    assert s.bytes == whole_bytes + 12 * (s.changed - whole_elems), s
    assert whole_elems < s.changed < whole_elems + 0.02 * (ws.numel - whole_elems), s
    assert s.bytes < s.full_bytes, s
    assert (stats[2].kind, stats[2].changed, stats[2].bytes, stats[2].full_buckets) == \
        ("delta", 1, 12, 0), stats[2]


def check_adapter_delta(rank, ch, group):
    """Adapters under delta sync: every element changes at each version, so every bucket
    goes whole and each sync moves exactly the adapters' size, never 3x it."""
    model = _policy("adapter")

    def edit(params, v):
        for p in params:
            p.add_(0.01 * (v + 1))
    ws, stats = _sync(model, 256 << 10, True, ch, group, rank, edit)
    assert [s.kind for s in stats] == ["full", "delta", "delta"]
    assert [s.bytes for s in stats] == [ws.total_bytes] * 3
    assert all(s.full_buckets == s.buckets == len(ws.groups) for s in stats)


def check_idle_beats(rank, ch, group):
    """A rollout rank idle for 4x the channel's timeout is kept alive by the leader's
    beats; a leader that stops beating (hung) fails the rollout rank's wait within it."""
    import time

    idle = Channel(td.new_group([0, 1], backend="gloo"), 1.0)
    silent = Channel(td.new_group([0, 1], backend="gloo"), 1.0)
    store = td.distributed_c10d._get_default_store()
    if rank == 0:
        idle.beat_to([1])
        time.sleep(4.0)  # a long evaluation, say
        idle.close()
        idle.send_header(1, FINISH)
        # hung: alive and silent on ``silent`` until rank 1 says it noticed (so what it
        # noticed cannot be this process exiting)
        store.wait(["noticed"], timedelta(seconds=120))
        return
    idle.listen(0)
    # a FINISH, not a timeout: the beats kept the wait alive through 4 of its timeouts
    assert idle.wait()[0][0] == FINISH
    silent.listen(0)
    try:
        silent.wait()
    except RuntimeError as e:
        assert "timeout" in str(e).lower() or "timed out" in str(e).lower(), e
    else:
        raise AssertionError("a silent leader was not noticed")
    finally:
        store.set("noticed", "1")  # whatever happened: the leader may go


if __name__ == "__main__":
    torch.set_num_threads(1)
    td.init_process_group("gloo")
    rank = td.get_rank()
    group = td.new_group([0, 1])
    ch = Channel(td.new_group([0, 1], backend="gloo"), 60)
    if rank == 1:
        ch.listen(0)
    for name in sys.argv[1:]:
        globals()[f"check_{name}"](rank, ch, group)
        print(f"rank {rank}: {name} ok", flush=True)
    if rank == 0:
        ch.send_header(1, FINISH)
    else:
        assert ch.wait()[0][0] == FINISH
    td.barrier()
    td.destroy_process_group()
    exit_now(0)  # skip the interpreter's teardown (see orbitrl.distributed.env)
