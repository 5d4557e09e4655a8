"""Parameter residency in tiers: hot (on the compute device), warm (being prefetched),
cold (host memory).

``LayerResidency`` hooks the decoder layers. In forward, layer i is made hot before it runs
and layers i+1..i+k are prefetched (k >= 2: the layer computing plus k buffers filling;
on CUDA the copies run on a side stream and the compute stream waits on an event only
when it needs the layer); a layer is released after use. In backward (which needs
``model.recompute = True``: the recomputed layer reads its weights again, nothing saved
refers to them) the grad of layer i's output arriving means layer i is about to run its
backward: it is made hot and layers i-1..i-k are prefetched; layers whose backward is done
are released -- for trainable layers only after every parameter's gradient hook (the fused
optimizer's update) has run, and their updated hot copy is written back to the cold copy.
The embeddings, final norm and lm_head stay hot. A layer's tensors are its parameters and,
for a quantized frozen layer, its weight buffers (torchao tensor subclasses move and pin
through their components). Between uses a host-tier layer's modules hold the host copies
themselves, so whatever reads or writes weights between steps (checkpoints, exports, the
reference's re-quantization) sees the stored values.

Everything is device-agnostic; on a CPU-only host "device" and "host" are the same memory,
so the behaviour is checked through ``stats`` (bytes per tier over a step, prefetch hits
and misses, peak resident layers) and, with ``copy_on_host=True``, hot copies are distinct
buffers so the fetch / write-back path runs for real.

There is no disk tier: the layers a run puts on tiers either train (their weights change
every step; a disk copy would go stale) or belong to full mode's int8 reference, which is
re-quantized in place from the policy whenever its anchor moves (``rl/anchors.py``) and
whose int8 values are not what a checkpoint's files hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from orbitrl.errors import OrbitError
from orbitrl.model.decoder import Decoder
from orbitrl.model.quant import leaf_tensors


@dataclass
class TierStats:
    hits: int = 0              # layer needed and already hot or warm
    misses: int = 0            # layer needed while cold: a blocking fetch
    fetches: int = 0
    releases: int = 0
    bytes_from_host: int = 0   # cold(host) -> device
    bytes_written_back: int = 0  # updated trainable layers, device -> host
    peak_resident_layers: int = 0  # hot + warm
    peak_device_bytes: int = 0     # layer bytes hot + warm (+ always-hot non-layer weights)
    host_bytes: int = 0            # bytes kept in the host tier (cold-host copies)
    timeline: list = field(default_factory=list)  # (event, layer, hot, warm, device_bytes)


def _move(t: torch.Tensor, fn) -> torch.Tensor:
    """``fn`` applied to the plain tensors of ``t`` (through a subclass's flatten/unflatten,
    so the quantized reference's int8 data moves and pins as stored)."""
    if type(t) is torch.Tensor or type(t) is nn.Parameter or \
            not hasattr(t, "__tensor_flatten__"):
        return fn(t.detach())
    names, ctx = t.__tensor_flatten__()
    inner = {n: _move(getattr(t, n), fn) for n in names}
    return type(t).__tensor_unflatten__(inner, ctx, t.shape, t.stride())


def _nbytes(t: torch.Tensor) -> int:
    return sum(x.numel() * x.element_size() for x in leaf_tensors(t))


class _Layer:
    """One decoder layer's tensors: its parameters (trainable or frozen) and, for a frozen
    quantized layer, its weight buffers (``FrozenLinear.weight``)."""

    def __init__(self, idx: int, module: nn.Module):
        self.idx, self.module = idx, module
        self.params = dict(module.named_parameters())  # name -> Parameter (as built)
        self.slots = {}  # name -> (owning module, attribute), parameters and buffers
        for name, _ in [*module.named_parameters(), *module.named_buffers()]:
            owner, _, leaf = name.rpartition(".")
            self.slots[name] = (module.get_submodule(owner) if owner else module, leaf)
        self.buffers = [n for n, _ in module.named_buffers()]
        self.nbytes = sum(p.numel() * p.element_size() for p in self.params.values())
        self.nbytes += sum(_nbytes(b) for _, b in module.named_buffers())
        self.trainable = any(p.requires_grad for p in self.params.values())
        self.host: dict[str, torch.Tensor] | None = None   # cold copies in host memory
        self.hot: dict[str, torch.Tensor] | None = None
        self.state = "cold"
        self.event = None
        self.landed: set[int] = set()
        self.versions: dict[str, int] = {}  # p._version when made hot: changed = dirty

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the layer as the module holds it now, by name."""
        out = {n: o._parameters[a].detach() for n, (o, a) in self.slots.items()
               if n in self.params}
        out.update({n: self.slots[n][0]._buffers[self.slots[n][1]] for n in self.buffers})
        return out


class LayerResidency:
    """Tiers and prefetch for ``model.model.layers``.

    Args:
        model: an orbitrl ``Decoder`` whose layers are materialised in host memory (they
            become the cold tier).
        prefetch: k, layers fetched ahead of compute (>= 1; 2 or more hides the copy).
        device: compute device (default: where the model's final norm lives).
        copy_on_host: on a CPU device, make hot copies distinct buffers (tests the real
            copy/write-back path; otherwise hot aliases the host copy, zero-copy).
        keep_timeline: record one tuple per event in ``stats.timeline``.
    """

    def __init__(self, model: Decoder, *, prefetch: int = 2, device=None,
                 copy_on_host: bool = False, keep_timeline: bool = True):
        if prefetch < 1:
            raise OrbitError(f"prefetch must be >= 1, got {prefetch}")
        self.model, self.k = model, int(prefetch)
        self.device = torch.device(device) if device is not None else model.device
        self.copy = copy_on_host or self.device.type != "cpu"
        self.keep_timeline = keep_timeline
        self.stream = (torch.cuda.Stream(self.device) if self.device.type == "cuda" else None)
        self.layers = [_Layer(i, m) for i, m in enumerate(model.model.layers)]
        layer_ids = {id(p) for L in self.layers for p in L.params.values()}
        self.fixed_bytes = sum(p.numel() * p.element_size() for p in model.parameters()
                               if id(p) not in layer_ids)
        self.stats = TierStats()
        self._handles = []
        self._in_backward = False
        pin = self.device.type == "cuda"
        for L in self.layers:
            L.host = {n: _move(t, (lambda x: x.to("cpu").pin_memory()) if pin
                               else (lambda x: x.to("cpu")))
                      for n, t in L.tensors().items()}
            self.stats.host_bytes += L.nbytes
            self._set_params(L, None)
            m = L.module
            self._handles += [m.register_forward_pre_hook(self._pre(L)),
                              m.register_forward_hook(self._post(L))]
            for p in L.params.values():
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(
                        lambda p, L=L: L.landed.add(id(p))))

    # -- tier moves ---------------------------------------------------------------------
    def _set_params(self, L: _Layer, tensors):
        """Point the layer's modules at ``tensors`` (hot copies) or, with None, at the cold
        tier: the host copies themselves (checkpoints, exports and re-quantization then read
        and write the stored weights between steps)."""
        if tensors is None:
            tensors = L.host
        for n, p in L.params.items():
            t = tensors[n]
            if p.requires_grad:  # the same Parameter: the optimizer and grad hooks hold it
                p.data = t
            else:  # frozen: a fresh Parameter (works across any two devices, meta included)
                owner, attr = L.slots[n]
                owner._parameters[attr] = nn.Parameter(t, requires_grad=False)
        for n in L.buffers:
            owner, attr = L.slots[n]
            owner._buffers[attr] = tensors[n]

    def _fetch(self, L: _Layer):
        """cold -> warm: start the copy (async on CUDA)."""
        src = L.host
        if self.copy:
            self.stats.bytes_from_host += L.nbytes
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                L.hot = {n: _move(t, lambda x: x.to(self.device, non_blocking=True))
                         for n, t in src.items()}
                L.event = torch.cuda.Event()
                L.event.record(self.stream)
        elif self.copy:
            L.hot = {n: _move(t, lambda x: x.to(self.device, copy=True))
                     for n, t in src.items()}
        else:
            L.hot = {n: _move(t, lambda x: x.to(self.device)) for n, t in src.items()}
        L.state = "warm"
        self.stats.fetches += 1

    def _ensure(self, L: _Layer):
        """Make layer hot (blocking only on a miss or an unfinished async copy)."""
        if L.state == "cold":
            self.stats.misses += 1
            self._fetch(L)
        else:
            self.stats.hits += 1
        if L.state == "warm":
            if L.event is not None:
                cur = torch.cuda.current_stream(self.device)
                cur.wait_event(L.event)
                for t in L.hot.values():
                    for x in leaf_tensors(t):
                        x.record_stream(cur)
                L.event = None
            self._set_params(L, L.hot)
            L.versions = {n: p._version for n, p in L.params.items()}
            L.state = "hot"

    def _release(self, L: _Layer):
        if L.state == "cold":
            return
        if L.trainable:
            for n, p in L.params.items():
                if p.grad is not None:
                    raise OrbitError(f"layer {L.idx} {n}: gradient still present when the "
                                     "layer left the device; tiered trainable layers need a "
                                     "fused optimizer (orbitrl.train.optim)")
            dirty = any(p._version != L.versions.get(n) for n, p in L.params.items())
            if L.state == "hot" and self.copy and dirty:  # e.g. not after a norm-only pass
                for n, p in L.params.items():
                    L.host[n].copy_(p.detach())
                self.stats.bytes_written_back += L.nbytes
        self._set_params(L, None)
        L.hot, L.event, L.state = None, None, "cold"
        L.landed.clear()
        self.stats.releases += 1

    def _prefetch(self, idxs):
        for j in idxs:
            if 0 <= j < len(self.layers) and self.layers[j].state == "cold":
                self._fetch(self.layers[j])

    def _record(self, event: str, i: int):
        hot = sum(L.state == "hot" for L in self.layers)
        warm = sum(L.state == "warm" for L in self.layers)
        dev = self.fixed_bytes + sum(L.nbytes for L in self.layers if L.state != "cold")
        s = self.stats
        s.peak_resident_layers = max(s.peak_resident_layers, hot + warm)
        s.peak_device_bytes = max(s.peak_device_bytes, dev)
        if self.keep_timeline:
            s.timeline.append((event, i, hot, warm, dev))

    # -- hooks ----------------------------------------------------------------------------
    def _pre(self, L: _Layer):
        def hook(module, args):
            if torch._C._current_graph_task_id() != -1:  # recompute inside backward
                self._ensure(L)
                return
            if torch.is_grad_enabled() and not self.model.recompute:
                raise OrbitError("tiered layers in a forward with gradients need "
                                 "model.recompute = True (saved activations would refer to "
                                 "weights that leave the device)")
            self._in_backward = False
            self._ensure(L)
            self._prefetch(range(L.idx + 1, L.idx + 1 + self.k))
            self._record("forward", L.idx)
        return hook

    def _post(self, L: _Layer):
        def hook(module, args, out):
            if torch._C._current_graph_task_id() != -1:
                return
            n = len(self.layers)
            if torch.is_grad_enabled():
                out.register_hook(lambda g, i=L.idx: self._backward_event(i))
                if L.idx >= n - self.k:  # backward starts with these: keep them
                    return
            self._release(L)
        return hook

    def _backward_event(self, i: int):
        """The gradient of layer i's output is ready: layer i's backward is next."""
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        for L in self.layers[i + 1:]:
            trainable_ids = {id(p) for p in L.params.values() if p.requires_grad}
            if L.state != "cold" and (not L.trainable or trainable_ids <= L.landed):
                self._release(L)
        self._ensure(self.layers[i])
        self._prefetch(range(i - 1, i - 1 - self.k, -1))
        self._record("backward", i)

    def _end_backward(self):
        for L in self.layers:
            self._release(L)
        self._in_backward = False
        self._record("end", -1)

    # -- public -----------------------------------------------------------------------------
    def reset_stats(self):
        self.stats = TierStats(host_bytes=self.stats.host_bytes)

    def detach(self):
        """Remove the hooks and make every layer resident again."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for L in self.layers:
            self._release(L)
            self._set_params(L, {n: _move(t, lambda x: x.to(self.device))
                                 for n, t in L.host.items()})

    @classmethod
    def on_device(cls, model: Decoder, device, **kw) -> "LayerResidency":
        """Tiers for a model loaded in host memory: everything but the decoder layers
        (embeddings, final norm, lm_head) moves to ``device`` and stays hot;
        the layers stay where they are as the cold tier (pinned when ``device`` is CUDA)
        and are copied to ``device`` one at a time as they run. ``kw``: as the constructor.
        """
        device = torch.device(device)
        in_layers = {id(m) for m in model.model.layers.modules()}
        moved: dict[int, nn.Parameter] = {}  # a tied head stays tied to its embedding
        for mod in model.modules():
            if id(mod) in in_layers:
                continue
            for k, p in mod._parameters.items():
                if p is None:
                    continue
                if p.requires_grad:
                    p.data = p.data.to(device)
                else:
                    if id(p) not in moved:
                        moved[id(p)] = nn.Parameter(p.data.to(device), requires_grad=False)
                    mod._parameters[k] = moved[id(p)]
            for k, b in mod._buffers.items():
                if b is not None:
                    mod._buffers[k] = b.to(device)
        return cls(model, device=device, **kw)
