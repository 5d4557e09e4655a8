"""Metrics: one JSON row per step (flushed as written), memory readings, phase timers."""

from __future__ import annotations

import json
import math
import os
import resource
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from orbitrl.errors import OrbitError


def rss_bytes() -> int:
    """Current resident set size of this process."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """High-water resident set size of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def device_peak_bytes(device) -> int:
    """Peak bytes on the device: the CUDA allocator's high-water, else process peak RSS."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return peak_rss_bytes()


# ``ORBITRL_COUNT_OPS=1``: every phase also counts the framework ops it dispatches
# (metrics.jsonl ``ops_{phase}``), for the planner's calibration of the host's cost per op
# (observe/calibrate.py); counting slows each op down, so such a run's times are not its own
COUNT_OPS_ENV = "ORBITRL_COUNT_OPS"


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0
        self.lock = threading.Lock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def count_ops_here(parent):
    """In a worker thread, count into ``parent`` (the caller's counting mode, or None: a
    no-op); a dispatch mode is per thread."""
    if not isinstance(parent, _OpCounter) or _get_current_dispatch_mode() is parent:
        yield  # not counting, or on the caller's thread, where ``parent`` counts already
        return
    child = _OpCounter()
    try:
        with child:
            yield
    finally:
        with parent.lock:
            parent.n += child.n


class PhaseTimer:
    """Seconds and memory at the end of each named phase of one step (and, under
    ``ORBITRL_COUNT_OPS=1``, the ops each dispatched: ``ops``)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.seconds: dict[str, float] = {}
        self.memory: dict[str, int] = {}
        self.ops: dict[str, int] | None = {} if os.environ.get(COUNT_OPS_ENV) == "1" else None

    @contextmanager
    def phase(self, name: str):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        counter = _OpCounter() if self.ops is not None else nullcontext()
        t0 = time.perf_counter()
        try:
            with counter:
                yield
        finally:
            if self.ops is not None:
                self.ops[name] = self.ops.get(name, 0) + counter.n
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                self.memory[name] = torch.cuda.max_memory_allocated(self.device)
            else:
                self.memory[name] = rss_bytes()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (1e308 if v > 0 else -1e308)
    if isinstance(v, torch.Tensor):
        return _clean(v.item())
    return v


class MetricsWriter:
    """Appends rows to ``metrics.jsonl``; each row is fsynced so a killed run keeps every
    step it logged, and goes out in one ``write`` of the whole line: a text file object
    cut rows longer than its buffer into several, and a reader following the file (a
    dashboard, ``tail -f``, a test) could read half a row."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, row: dict):
        data = (json.dumps({k: _clean(v) for k, v in row.items()}) + "\n").encode()
        while data:  # (one write for a regular file; a short one continues)
            data = data[os.write(self._fd, data):]
        os.fsync(self._fd)

    def close(self):
        if self._fd >= 0:  # (closing twice is harmless, as for a file object)
            os.close(self._fd)
            self._fd = -1


def read_metrics(path: Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a torn last line from a killed writer
    return rows


class ExternalWriters:
    """TensorBoard and wandb writers, when asked for (``log.tensorboard``, ``log.wandb``)
    and installed; asking for one that is not installed is a one-line error."""

    def __init__(self, run_dir: Path, tensorboard: bool = False, wandb: bool = False,
                 config: dict | None = None):
        self.tb = self.wb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # optional: tensorboard
            except ImportError:
                raise OrbitError("config key 'log.tensorboard': needs the tensorboard package "
                                 "(pip install tensorboard)") from None
            self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        if wandb:
            try:
                import wandb as wb  # optional: wandb
            except ImportError:
                raise OrbitError("config key 'log.wandb': needs the wandb package "
                                 "(pip install wandb)") from None
            self.wb = wb.init(project="orbitrl", dir=str(run_dir), config=config or {},
                              name=Path(run_dir).name)

    def write(self, row: dict):
        step = int(row.get("step", 0))
        nums = {k: float(v) for k, v in row.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        if self.tb is not None:
            for k, v in nums.items():
                self.tb.add_scalar(k, v, step)
        if self.wb is not None:
            self.wb.log(nums, step=step)

    def close(self):
        if self.tb is not None:
            self.tb.close()
        if self.wb is not None:
            self.wb.finish()
