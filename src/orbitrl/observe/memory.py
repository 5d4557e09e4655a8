"""Predicted against measured peak memory, per phase of an RL step.

The runtime calls :func:`orbitrl.ledger.runtime.runtime_prediction` once (the planner's own
arithmetic, fed the run's model config, strategy and batch shape) and measures each phase's
peak next to it:

- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus the
  bytes allocated before the model was loaded (the allocator counts tensors only).
- CPU: there is no allocator counter, so the peak is the process's resident high-water mark
  (``VmHWM`` in ``/proc/self/status``), reset at the start of each phase by writing ``5`` to
  ``/proc/self/clear_refs`` (Linux resets the peak to the current RSS; glibc's free heap is
  trimmed first), minus a baseline. The baseline is first the RSS just before the model is
  loaded; once the run is set up (:meth:`MemoryProbe.settle`) it becomes the RSS then minus
  the bytes of every tensor storage the run holds (model, reference, KV cache, optimizer
  state), counted from the storages themselves: what is resident and not a tensor of the run
  (libraries imported lazily by the load, torchao's kernels, the checkpoint's mapped page
  cache) is excluded, as the CUDA allocator counts tensors only. Shared-library code paged
  in later (first use of a kernel) is subtracted too. Where ``clear_refs`` cannot be
  written the mark is not reset and the reading is the peak so far (``rss-cumulative``).
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager

import torch

from orbitrl.ledger.runtime import runtime_prediction
from orbitrl.model.dtensor import is_dtensor, local
from orbitrl.observe.metrics import PhaseTimer, rss_bytes


def _status_bytes(field: str) -> int | None:
    """A ``kB`` field of /proc/self/status, in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


_MALLOC_TRIM: list = []


def trim_heap() -> bool:
    """Hand freed heap back to the OS (glibc keeps it otherwise, and RSS would count it);
    False where there is no glibc."""
    if not _MALLOC_TRIM:
        try:
            _MALLOC_TRIM.append(ctypes.CDLL("libc.so.6").malloc_trim)
        except (OSError, AttributeError):
            _MALLOC_TRIM.append(None)
    if _MALLOC_TRIM[0] is None:
        return False
    _MALLOC_TRIM[0](0)
    return True


_LIB_CACHE: list = [None, 0]  # (file-backed RSS when last parsed, library RSS then)


def library_rss_bytes() -> int:
    """Resident pages of mapped shared libraries (code paged in on first use).

    Parsing smaps costs tens of milliseconds, and this is read at the end of every phase:
    library pages are file-backed, so while the process's file-backed RSS (one line of
    /proc/self/status) is unchanged the last parse still holds.
    """
    rss_file = _status_bytes("RssFile")
    if rss_file is not None and rss_file == _LIB_CACHE[0]:
        return _LIB_CACHE[1]
    total = _parse_library_rss()
    _LIB_CACHE[:] = [rss_file, total]
    return total


def _parse_library_rss() -> int:
    total = 0
    lib = False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                    parts = line.split()
                    lib = len(parts) > 5 and ".so" in parts[5]
                elif lib and line.startswith("Rss:"):
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total


def _reset_rss_peak() -> bool:
    trim_heap()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class MemoryProbe:
    """Net peak bytes of a phase; construct it just before the model is loaded (baseline)."""

    def __init__(self, device, quantized: bool = True):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
            self.method = "cuda-allocator"
        else:
            # a library the load imports lazily (the quantizer's, for a quantized base) is
            # not the run's bytes: imported before the baseline (only then: its import
            # takes a second)
            if quantized:
                try:
                    import torchao  # noqa: F401; start-up: torchao, only for a quantized base
                except Exception:
                    pass
            trim_heap()
            self.baseline = rss_bytes()
            self.lib_baseline = library_rss_bytes()
            self.method = "rss-hwm" if _reset_rss_peak() and _status_bytes("VmHWM") else \
                "rss-cumulative"
        self.prediction: dict | None = None
        # the ledger at a step's own shape: micro-batch positions -> {phase: bytes}
        self.predict_at = None
        self.peaks: dict[str, int] = {}  # largest net peak per phase over the run
        self.at_shape: dict[str, int] = {}  # largest at-shape prediction per phase

    def settle(self, *holders) -> int:
        """CPU: re-base on what the run holds once it is set up (see the module doc).

        ``holders``: modules, optimizers, objects with tensor attributes (the KV cache).
        The new baseline is the resident size now minus the bytes of every tensor storage
        they hold, counted once each: everything resident that is not a tensor of the run
        (libraries the load imported lazily, the interpreter's heap, page cache of the
        checkpoint's mapping) is excluded, like the CUDA allocator, which counts tensors only.
        """
        held = tensor_bytes(*holders, touch=not self.cuda)
        if not self.cuda:
            trim_heap()
            self.baseline = rss_bytes() - held
            self.lib_baseline = library_rss_bytes()
            self.method = self.method.replace("rss", "rss-settled")
        self.held_bytes = held
        return held

    def reset(self):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_rss_peak()

    def read(self) -> int:
        """Net peak bytes since the last :meth:`reset`."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = _status_bytes("VmHWM") or rss_bytes()
            # library code paged in since the baseline is torch's, not the run's
            peak -= max(0, library_rss_bytes() - self.lib_baseline)
        return max(0, peak - self.baseline)

    @contextmanager
    def phase(self, name: str, out: dict):
        self.reset()
        try:
            yield
        finally:
            b = self.read()
            out[name] = b
            self.peaks[name] = max(self.peaks.get(name, 0), b)

    def timer(self) -> "ProbedPhaseTimer":
        return ProbedPhaseTimer(self.device, self)

    def step_metrics(self, timer: "ProbedPhaseTimer", positions: int = 0) -> dict:
        """``mem_<phase>_predicted_bytes`` / ``mem_<phase>_measured_bytes`` of one step;
        with ``positions`` (the most a step's micro-batches hold at once over the workers:
        ``mem_train_positions``, ``rl/score.py``) also ``mem_<phase>_predicted_at_shape_bytes``:
        the same ledger priced at the replies this step drew instead of every reply at the
        cap."""
        out = {}
        at = self.predict_at(positions) if positions and self.predict_at and \
            timer.measured else {}
        for name, b in timer.measured.items():
            out[f"mem_{name}_measured_bytes"] = b
            if self.prediction and name in self.prediction:
                out[f"mem_{name}_predicted_bytes"] = self.prediction[name]
            if name in at:
                out[f"mem_{name}_predicted_at_shape_bytes"] = at[name]
                self.at_shape[name] = max(self.at_shape.get(name, 0), at[name])
        return out

    def summary(self) -> dict:
        """``predicted_peak_bytes`` against ``measured_peak_bytes`` (largest phase of the run)."""
        pred = self.prediction or {}
        measured = max(self.peaks.values()) if self.peaks else 0
        out = {"predicted_peak_bytes": pred.get("peak"), "measured_peak_bytes": measured,
               "memory_probe": self.method}
        for ph in ("rollout", "score", "train"):
            if ph in pred:
                out[f"predicted_{ph}_bytes"] = pred[ph]
            if ph in self.peaks:
                out[f"measured_{ph}_bytes"] = self.peaks[ph]
        if pred.get("peak") and measured:
            out["peak_prediction_error"] = pred["peak"] / measured - 1
        if self.at_shape and measured:  # over the steps whose phases were measured
            at = max(self.at_shape.values())
            out["predicted_peak_at_shape_bytes"] = at
            out["peak_at_shape_error"] = at / measured - 1
        return out


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, torch.nn.Module):
        for t in list(obj.parameters()) + list(obj.buffers()):
            yield t
        for m in obj.modules():  # tensors kept as plain attributes (quantized weights)
            for v in vars(m).values():
                if isinstance(v, torch.Tensor):
                    yield v
    elif isinstance(obj, torch.optim.Optimizer):
        for st in obj.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    yield v
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
    elif obj is not None and hasattr(obj, "__dict__"):
        for v in vars(obj).values():
            if isinstance(v, torch.Tensor):
                yield v


def _storages(t: torch.Tensor):
    """(data_ptr, nbytes, storage) of the plain storages behind ``t`` (subclasses unpacked)."""
    inner = t.data if isinstance(t, torch.nn.Parameter) else t
    if is_dtensor(inner):  # its shard
        yield from _storages(local(inner))
        return
    if type(inner) is not torch.Tensor and hasattr(inner, "__tensor_flatten__"):
        names, _ = inner.__tensor_flatten__()
        for n in names:
            if isinstance(getattr(inner, n), torch.Tensor):
                yield from _storages(getattr(inner, n))
        return
    if inner.device.type == "meta":
        return
    st = inner.untyped_storage()
    yield st.data_ptr(), st.nbytes(), st


def tensor_bytes(*holders, touch: bool = False, device=None) -> int:
    """Bytes of the distinct tensor storages ``holders`` hold (tensor subclasses such as
    torchao's NF4/int8 weights counted by their inner tensors).

    ``touch``: read one byte per page of each CPU storage, so that storages still backed by
    a not-yet-read file mapping (weights loaded zero-copy from safetensors) are resident
    when the caller reads the RSS: otherwise they would be subtracted without being there.
    ``device``: count only storages on that kind of device (a GPU's own bytes, leaving out
    the host tier of a model whose layers are pulled in as they run).
    """
    kind = torch.device(device).type if device is not None else None
    seen: dict[int, int] = {}
    for h in holders:
        for t in _tensors(h):
            for ptr, n, st in _storages(t):
                if kind is not None and st.device.type != kind:
                    continue
                if ptr not in seen and touch and n and st.device.type == "cpu":
                    b = torch.empty(0, dtype=torch.uint8).set_(st)
                    int(b[::4096].sum())
                seen[ptr] = max(seen.get(ptr, 0), n)
    return sum(seen.values())


def role_bytes(roles: dict) -> dict[str, int]:
    """Bytes of the tensor storages each role holds, ``roles`` mapping a role to its holders
    (modules, optimizers, objects with tensor attributes) in order: a storage two roles share
    (an adapter critic's frozen base is the actor's) counts for the first that holds it."""
    out, seen = {}, []
    for role, holders in roles.items():
        before = tensor_bytes(*seen) if seen else 0
        seen += [h for h in holders if h is not None]
        out[role] = tensor_bytes(*seen) - before
    return out


class ProbedPhaseTimer(PhaseTimer):
    """:class:`PhaseTimer` that also records each phase's net peak through a probe."""

    def __init__(self, device, probe: MemoryProbe):
        super().__init__(device)
        self.probe = probe
        self.measured: dict[str, int] = {}

    @contextmanager
    def phase(self, name: str):
        with self.probe.phase(name, self.measured), super().phase(name):
            yield


def run_prediction(cfg, model, engine, prompt_len: int, devices: int = 1,
                   workers: int = 1, positions: int = 0) -> dict:
    """The ledger's prediction for this run (see ``ledger.runtime.runtime_prediction``):
    the model's config.json, the KV pool as the engine allocated it, ``prompt_len`` the
    longest prompt of the task in tokens, ``devices`` the ranks the weights are sharded
    over (the prediction is per rank), ``workers`` the micro-batches run side by side,
    ``positions`` those of a step's micro-batches live at once (0: every reply at the cap)."""
    return runtime_prediction(cfg, model.config.hf, prompt_len,
                              kv_blocks=engine.pool.num_blocks,
                              device=torch.device(model.device).type,
                              recompute=bool(getattr(model, "recompute", False)),
                              devices=devices, workers=workers,
                              packed_bytes=engine.packed.planned_bytes,
                              packing_workspace=engine.packed.workspace_bytes,
                              positions=positions)
