"""The KV pool against free memory: throttle when it runs low, grow back when it returns.

Rollout and training share one device, and training has priority: the pool is sized at the
start from what training is predicted to leave (``kv_blocks_for_run``), and while a rollout
runs the engine calls :class:`KVGovernor` before every step. When free memory falls below
``min_available`` (training of the previous step still running beside an overlapped
rollout, another process, a leak), the pool shrinks by the deficit: the sequences holding
its last blocks are preempted (recomputed or swapped back later) and the cache tensors are
reallocated smaller, so the memory is really released. When free memory is back above the
floor with room to spare and the pool is below its cap, it grows again. The pool never
shrinks below the largest single sample's blocks, so a rollout always makes progress.

Free memory is ``torch.cuda.mem_get_info`` plus the caching allocator's unused reserve on a
GPU, and ``MemAvailable`` (capped by the cgroup limit, where one is set) on the host.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from orbitrl.observe.memory import trim_heap
from orbitrl.observe.metrics import rss_bytes


def available_memory(device) -> int:
    """Bytes this process could still allocate on ``device``."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev))
    avail = _meminfo("MemAvailable")
    cg = _cgroup_room()
    return min(avail, cg) if cg is not None else avail


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


@functools.lru_cache(maxsize=1)
def _cgroup_dir() -> Path | None:
    """This process's cgroup v2 directory (it does not change during a run)."""
    try:
        rel = Path("/proc/self/cgroup").read_text().strip().split("\n")[0].split("::")[-1]
    except (OSError, IndexError):
        return None
    return Path("/sys/fs/cgroup") / rel.lstrip("/")


def _cgroup_room() -> int | None:
    """cgroup v2 memory.max - memory.current for this process's group, if limited."""
    base = _cgroup_dir()
    if base is None:
        return None
    try:
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((base / "memory.current").read_text())
    except (OSError, ValueError):
        return None


def hand_back(device) -> int:
    """Return cached-but-unused memory to the system between phases; bytes handed back.

    GPU: the caching allocator's unused reserve (``empty_cache``). Host: glibc's
    ``malloc_trim``, which returns freed heap pages; measured as the drop in resident bytes.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        before = torch.cuda.memory_reserved(dev)
        torch.cuda.empty_cache()
        return int(before - torch.cuda.memory_reserved(dev))
    before = rss_bytes()
    if not trim_heap():
        return 0
    return max(0, before - rss_bytes())


class KVGovernor:
    """Called by the engine before each step (``engine.memory_hook = governor``).

    Args:
        min_available: bytes that must stay free; below it the pool throttles.
        max_blocks: the pool's cap (what the workload can use at most).
        available_fn: ``() -> bytes free`` (tests inject one; default ``available_memory``:
            two small file reads on the host, a few microseconds against a decode step's
            milliseconds).
    """

    def __init__(self, min_available: int, max_blocks: int, available_fn=None,
                 device="cpu"):
        self.min_available, self.max_blocks = int(min_available), int(max_blocks)
        self.available_fn = available_fn or (lambda: available_memory(device))
        self.throttle_events = self.grow_events = 0
        self.blocks_released = self.blocks_added = 0
        self.low_blocks: int | None = None  # smallest pool size reached

    def __call__(self, engine) -> None:
        pool, bb = engine.pool, engine.block_bytes
        room = self.available_fn() - self.min_available
        n = pool.num_blocks
        if room < 0:
            want = n - (-room + bb - 1) // bb
            new = engine.resize_pool(want)
            if new < n:
                self.throttle_events += 1
                self.blocks_released += n - new
                engine.stats["kv_throttle_events"] = engine.stats.get("kv_throttle_events", 0) + 1
                self.low_blocks = new if self.low_blocks is None else min(self.low_blocks, new)
            return
        cap = max(self.max_blocks, engine.max_blocks)
        # grow only with a margin (no flapping around the floor) and when the pool is short
        margin = max(self.min_available // 8, 4 * bb)
        if n < cap and room > margin and _short_of_blocks(engine):
            add = min(cap - n, (room - margin) // bb)
            if add > 0:
                engine.resize_pool(n + add)
                self.grow_events += 1
                self.blocks_added += add
                engine.stats["kv_grow_events"] = engine.stats.get("kv_grow_events", 0) + 1

    def state(self) -> dict:
        return {"kv_throttle_events": self.throttle_events, "kv_grow_events": self.grow_events,
                "kv_blocks_released": self.blocks_released, "kv_blocks_added": self.blocks_added}


def _short_of_blocks(engine) -> bool:
    """Sequences wait (or sit swapped out) while the pool has little free."""
    sch = engine.scheduler
    return bool(sch.waiting or sch.swapped) and engine.pool.num_free < engine.min_blocks()
