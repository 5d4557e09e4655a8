"""Weight sync: the training leader's trainable tensors to the rollout ranks, one version
at a time.

What moves is the list of ``(HF name, tensor)`` the policy trains (``synced``): the LoRA
adapters in adapter mode (kilobytes to megabytes), every weight in full mode. Our module
tree mirrors Hugging Face's, so the names are HF checkpoint names on both sides; both sides
build the list from the same config, and the first sync checks the names agree.

Full sync: the tensors are laid end to end in buckets of at most ``bucket_bytes`` (a
tensor larger than a bucket travels alone) and broadcast from the leader over the sync
group, at most two buckets in flight: the leader packs bucket i+2 only once bucket i is
through, and the receiver unpacks each bucket as it lands. Delta sync: only the elements
that differ from the last version sent travel, as (flat index, value) pairs, in the same
bucketed, two-in-flight stream; the leader keeps a copy of what it last sent to compare
against (one more copy of the trainable weights on the leader), and the first sync of a
run is always full. The receiver applies a version between engine steps (the caller's
business), never in the middle of one.

A training pool of several ranks holds the tensors sharded (FSDP2 DTensors): before each
send every training rank gathers them whole, tensor by tensor in the list's order (the
leader in :meth:`WeightSync.send`, the others in :meth:`WeightSync.join`), so the stream is
the one a single training rank sends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as td

FULL, DELTA = 0, 1


def synced(model) -> list[tuple[str, torch.Tensor]]:
    """The ``(HF name, parameter)`` pairs a sync moves: what the policy trains."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def whole(params) -> list[torch.Tensor]:
    """The tensors whole: a sharded one is all-gathered over its mesh (every rank of it
    must call this with the same list), a plain one is itself."""
    from orbitrl.model.dtensor import is_dtensor

    with torch.no_grad():
        return [p.detach().full_tensor() if is_dtensor(p) else p.detach() for p in params]


def name_digest(pairs) -> int:
    """A 62-bit digest of the names, shapes and dtypes, in order (both sides must agree)."""
    import hashlib

    text = "|".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in pairs)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2


def buckets(sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Consecutive tensor indices grouped so each group's bytes stay within
    ``bucket_bytes`` (a larger tensor is a group of its own)."""
    out, cur, used = [], [], 0
    for i, n in enumerate(sizes):
        if cur and used + n > bucket_bytes:
            out.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    return out + ([cur] if cur else [])


@dataclass
class SyncStats:
    version: int
    bytes: int
    seconds: float
    buckets: int
    kind: str  # full | delta
    changed: int = 0  # elements sent (delta) or in the model (full)

    def metrics(self) -> dict:
        return {"sync_version": self.version, "sync_bytes": self.bytes,
                "time_sync_s": self.seconds, "sync_buckets": self.buckets,
                "sync_delta": int(self.kind == "delta"), "sync_elements": self.changed}


class _Stream:
    """Broadcasts (or receives) a list of host/device buffers, two in flight."""

    def __init__(self, group, src: int, device):
        self.group, self.src, self.device = group, src, device

    def run(self, make, take, count: int):
        """``make(i)`` -> buffer i to broadcast (the sender packs, the receiver allocates);
        ``take(i, buf)`` after it landed."""
        flight = []
        for i in range(count):
            if len(flight) == 2:
                j, buf, w = flight.pop(0)
                w.wait()
                take(j, buf)
            buf = make(i)
            flight.append((i, buf, td.broadcast(buf, self.src, group=self.group,
                                                async_op=True)))
        for j, buf, w in flight:
            w.wait()
            take(j, buf)


class WeightSync:
    """One side of the sync (the leader sends, a rollout rank receives).

    Args:
        pairs: ``synced(model)`` of this side's policy.
        group: the sync group (the leader and the rollout ranks).
        src: the leader's global rank.
        bucket_bytes: the most bytes one bucket holds.
        delta: send changed elements only (after the first, full, sync).
    """

    def __init__(self, pairs, group, src: int, bucket_bytes: int, delta: bool = False):
        self.names = [n for n, _ in pairs]
        self.params = [p for _, p in pairs]
        self.group, self.src, self.delta = group, src, delta
        self.bucket_bytes = int(bucket_bytes)
        self.digest = name_digest(pairs)
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.sizes = [p.numel() * p.element_size() for p in self.params]
        self.groups = buckets(self.sizes, self.bucket_bytes)
        self.last: list[torch.Tensor] | None = None  # the leader's copy of the last version
        sizes = [p.numel() for p in self.params]
        self.offsets = torch.tensor([0] + sizes).cumsum(0)
        self.numel = int(self.offsets[-1])

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    def kind(self) -> int:
        """What the next send is: full the first time (or without delta), delta after."""
        return DELTA if self.delta and self.last is not None else FULL

    # ---- full ---------------------------------------------------------------------------
    def _full(self, sending: list | None) -> int:
        """``sending``: the leader's whole tensors (None: receive into ``self.params``)."""
        def make(i):
            if sending is None:
                n = sum(self.sizes[k] for k in self.groups[i])
                return torch.empty(n, dtype=torch.uint8, device=self.device)
            return torch.cat([sending[k].reshape(-1).view(torch.uint8)
                              for k in self.groups[i]])

        def take(i, buf):
            if sending is not None:
                return
            off = 0
            for k in self.groups[i]:
                p, n = self.params[k], self.sizes[k]
                p.data.copy_(buf[off:off + n].view(p.dtype).view(p.shape))
                off += n
        _Stream(self.group, self.src, self.device).run(make, take, len(self.groups))
        return len(self.groups)

    # ---- delta --------------------------------------------------------------------------
    def changed(self, params) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat indices, values) of the elements of ``params`` (whole) that differ from the
        last version sent."""
        idx, vals = [], []
        for k, (p, old) in enumerate(zip(params, self.last)):
            flat = p.detach().reshape(-1)
            where = (flat != old).nonzero().squeeze(1)
            idx.append(where + int(self.offsets[k]))
            vals.append(flat[where])
        return torch.cat(idx), torch.cat(vals)

    def _delta_chunks(self, n: int, dtype) -> list[tuple[int, int]]:
        per = max(1, self.bucket_bytes // (8 + torch.empty(0, dtype=dtype).element_size()))
        return [(a, min(n, a + per)) for a in range(0, n, per)]

    def _send_delta(self, idx, vals) -> int:
        """Each chunk is one buffer: its indices (int64) then its values."""
        chunks = self._delta_chunks(idx.numel(), vals.dtype)
        _Stream(self.group, self.src, self.device).run(
            lambda i: torch.cat([idx[chunks[i][0]:chunks[i][1]].view(torch.uint8),
                                 vals[chunks[i][0]:chunks[i][1]].view(torch.uint8)]),
            lambda i, b: None, len(chunks))
        return len(chunks)

    def _recv_delta(self, n: int) -> int:
        dtype = self.params[0].dtype
        es = torch.empty(0, dtype=dtype).element_size()
        chunks = self._delta_chunks(n, dtype)

        def make(i):
            a, b = chunks[i]
            return torch.empty((b - a) * (8 + es), dtype=torch.uint8, device=self.device)

        def take(i, buf):
            a, b = chunks[i]
            self._apply(buf[:(b - a) * 8].view(torch.int64), buf[(b - a) * 8:].view(dtype))
        _Stream(self.group, self.src, self.device).run(make, take, len(chunks))
        return len(chunks)

    def _apply(self, idx: torch.Tensor, vals: torch.Tensor):
        """Write (flat index, value) pairs into the parameters (indices ascending)."""
        which = torch.searchsorted(self.offsets.to(idx.device), idx, right=True) - 1
        for k in which.unique().tolist():
            sel, p = which == k, self.params[k].data
            flat = idx[sel] - int(self.offsets[k])  # row-major, whatever p's strides
            p[torch.unravel_index(flat, p.shape)] = vals[sel]

    # ---- the two ends -------------------------------------------------------------------
    def send(self, version: int, announce) -> SyncStats:
        """Leader: announce the version to each rollout rank (``announce(kind, count)``
        sends the header), then stream it. Returns what moved and how long it took."""
        t0, kind = time.perf_counter(), self.kind()
        params = whole(self.params)  # (a gather over the training pool when sharded)
        if kind == DELTA:
            idx, vals = self.changed(params)
            announce(DELTA, idx.numel())
            nb = self._send_delta(idx, vals)
            moved, elems = idx.numel() * (8 + vals.element_size()), idx.numel()
            for k, p in enumerate(params):  # what the receivers now hold
                self.last[k].copy_(p.reshape(-1))
        else:
            announce(FULL, self.digest)
            nb, moved, elems = self._full(params), self.total_bytes, self.numel
            if self.delta:
                self.last = [p.reshape(-1).clone() for p in params]
        return SyncStats(version, moved, time.perf_counter() - t0, nb,
                         "delta" if kind == DELTA else "full", elems)

    def join(self) -> None:
        """A training rank other than the leader: its part of the leader's gathers (a
        no-op when the tensors are not sharded)."""
        whole(self.params)

    def receive(self, version: int, kind: int, count: int) -> SyncStats:
        """Rollout rank: take the version the header announced (``count``: the names'
        digest for a full sync, the element count for a delta)."""
        t0 = time.perf_counter()
        with torch.no_grad():
            if kind == FULL:
                if count != self.digest:
                    raise RuntimeError("weight sync: the rollout rank's trainable tensors "
                                       "differ from the trainer's (names, shapes or dtypes)")
                nb, moved, elems = self._full(None), self.total_bytes, self.numel
            else:
                nb = self._recv_delta(count)
                moved, elems = count * (8 + self.params[0].element_size()), count
        return SyncStats(version, moved, time.perf_counter() - t0, nb,
                         "delta" if kind == DELTA else "full", elems)
