"""Weight sync: the training leader's trainable tensors to the rollout ranks, one version
at a time.

What moves is the list of ``(HF name, tensor)`` the policy trains (``synced``): the LoRA
adapters in adapter mode (kilobytes to megabytes), every weight in full mode. Our module
tree mirrors Hugging Face's, so the names are HF checkpoint names on both sides; both sides
build the list from the same config, and each sync checks the names agree (a digest in the
header).

The tensors are laid end to end in buckets of at most ``bucket_bytes`` (a tensor larger
than a bucket travels alone) and broadcast from the leader over the sync group, at most two
buckets in flight: the leader packs bucket i+2 only once bucket i is through, and the
receiver unpacks each bucket as it lands. Full sync: every bucket's bytes. Delta sync
(after the first sync of a run, which is full): each bucket goes as whichever encoding is
smaller, its changed elements (flat index int64 + value: 12 bytes an element in fp32, so a
bucket with more than a third of its elements changed goes whole) or its whole bytes, so a
sync never moves more payload than a full copy; a 16-byte word ``[changed, bytes]`` ahead
of each bucket tells the receiver which (control, like the header, not counted in
``SyncStats.bytes``). "Changed" compares bits, so -0.0 against 0.0 or a NaN's payload
travel too and the receiver ends bit-equal. The leader keeps a copy of what it last sent
to compare against (one more copy of the trainable weights on the leader). The receiver
applies a version between engine steps (the caller's business), never in the middle of one.

A training pool of several ranks holds the tensors sharded (FSDP2 DTensors): every training
rank gathers them whole one bucket at a time, as the leader packs that bucket (the leader
in :meth:`WeightSync.send`, the others in :meth:`WeightSync.join`, the same per-tensor
all-gathers in the same order), so no rank holds more than one bucket of gathered tensors
beside the two buffers in flight, and the stream is the one a single training rank sends.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as td

from orbitrl.model.dtensor import is_dtensor

FULL, DELTA = 0, 1
# "changed" compares bit patterns: an integer view of each element size
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def synced(model) -> list[tuple[str, torch.Tensor]]:
    """The ``(HF name, parameter)`` pairs a sync moves: what the policy trains."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def whole(params) -> list[torch.Tensor]:
    """The tensors whole: a sharded one is all-gathered over its mesh (every rank of it
    must call this with the same list), a plain one is itself."""
    with torch.no_grad():
        return [p.detach().full_tensor() if is_dtensor(p) else p.detach() for p in params]


def name_digest(pairs) -> int:
    """A 62-bit digest of the names, shapes and dtypes, in order (both sides must agree)."""
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
    bytes: int  # payload bytes moved (bucket contents; the headers are control)
    seconds: float
    buckets: int
    kind: str  # full | delta (a delta sync may still send some buckets whole)
    changed: int = 0  # elements written on the receiver (changed ones, or whole buckets')
    full_bytes: int = 0  # what a full copy of the same tensors takes
    full_buckets: int = 0  # buckets sent whole

    def metrics(self) -> dict:
        return {"sync_version": self.version, "sync_bytes": self.bytes,
                "time_sync_s": self.seconds, "sync_buckets": self.buckets,
                "sync_delta": int(self.kind == "delta"), "sync_elements": self.changed,
                "sync_full_bytes": self.full_bytes, "sync_buckets_full": self.full_buckets}


class _Stream:
    """Broadcasts (or receives) a list of host/device buffers, two in flight. An empty
    buffer (a delta bucket with nothing changed; both sides know its size) is not sent."""

    def __init__(self, group, src: int):
        self.group, self.src = group, src

    def run(self, make, take, count: int):
        """``make(i)`` -> buffer i to broadcast (the sender packs, the receiver allocates);
        ``take(i, buf)`` after it landed. Bucket i is made once bucket i-2 landed (and
        was dropped), so only bucket i-1's buffer is alive beside it."""
        flight = []
        for i in range(count):
            if len(flight) == 2:
                self._land(*flight.pop(0), take)
            flight.append(self._post(i, make(i)))
        while flight:
            self._land(*flight.pop(0), take)

    def _post(self, i: int, buf: torch.Tensor) -> tuple:
        return i, buf, None if buf.numel() == 0 else td.broadcast(
            buf, self.src, group=self.group, async_op=True)

    @staticmethod
    def _land(i: int, buf: torch.Tensor, work, take):
        if work is not None:
            work.wait()
        take(i, buf)


def _as(buf: torch.Tensor, dtype) -> torch.Tensor:
    """Bytes ``buf`` (uint8 [n]) read as ``dtype``, copied first if misaligned for it."""
    if buf.storage_offset() % torch.empty(0, dtype=dtype).element_size():
        buf = buf.clone()
    return buf.view(dtype)


class WeightSync:
    """One side of the sync (the leader sends, a rollout rank receives).

    Args:
        pairs: ``synced(model)`` of this side's policy.
        group: the sync group (the leader and the rollout ranks).
        src: the leader's global rank.
        bucket_bytes: the most bytes one bucket holds.
        delta: after the first (full) sync, send each bucket as its changed elements when
            that is smaller than the bucket.
    """

    def __init__(self, pairs, group, src: int, bucket_bytes: int, delta: bool = False):
        self.names = [n for n, _ in pairs]
        self.params = [p for _, p in pairs]
        self.group, self.src, self.delta = group, src, delta
        self.bucket_bytes = int(bucket_bytes)
        self.digest = name_digest(pairs)
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.sharded = any(is_dtensor(p) for p in self.params)
        self.sizes = [p.numel() * p.element_size() for p in self.params]
        self.groups = buckets(self.sizes, self.bucket_bytes)
        self.group_bytes = [sum(self.sizes[k] for k in g) for g in self.groups]
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

    def gather(self, i: int) -> list[torch.Tensor]:
        """Bucket ``i``'s tensors whole and flat (row-major): a sharded one all-gathered
        over the training pool (every training rank calls this for the same buckets in the
        same order), a plain one a view of itself."""
        return [t.reshape(-1) for t in whole([self.params[k] for k in self.groups[i]])]

    # ---- the leader ---------------------------------------------------------------------
    def _pack(self, i: int, kind: int, acc: list) -> torch.Tensor:
        """Bucket ``i``'s buffer (uint8): its tensors' bytes end to end (full), or the
        changed elements' flat indices (int64 [c]) then their values, tensor by tensor in
        each one's dtype (delta), whichever is smaller; a delta bucket's ``[c, nbytes]``
        (c = -1: whole) goes ahead of it on the sync group. ``acc``: [bytes, elements,
        whole buckets] so far."""
        flat, ks = self.gather(i), self.groups[i]
        if kind == DELTA:
            where = [(f.view(_BITS[f.element_size()]) != self.last[k].view(
                _BITS[f.element_size()])).nonzero().squeeze(1) for k, f in zip(ks, flat)]
            c = sum(w.numel() for w in where)
            n = sum(w.numel() * (8 + f.element_size()) for w, f in zip(where, flat))
            whole_ = n >= self.group_bytes[i]
            td.broadcast(torch.tensor([-1 if whole_ else c, self.group_bytes[i] if whole_
                                       else n], device=self.device), self.src, self.group)
            if not whole_:
                idx = torch.cat([w + int(self.offsets[k]) for k, w in zip(ks, where)])
                buf = torch.cat([idx.view(torch.uint8)] + [f[w].view(torch.uint8)
                                                           for f, w in zip(flat, where)])
                for k, f in zip(ks, flat):  # what the receivers now hold
                    self.last[k].copy_(f)
                acc[0], acc[1] = acc[0] + n, acc[1] + c
                return buf
        # a plain tensor alone is sent as itself (the send returns only once the stream is
        # through); gathered ones are copied out, so they are freed as soon as packed
        buf = flat[0].view(torch.uint8) if len(flat) == 1 and not self.sharded else \
            torch.cat([f.view(torch.uint8) for f in flat])
        if self.delta:
            for k, f in zip(ks, flat):
                if self.last[k] is None:
                    self.last[k] = f.clone()
                else:
                    self.last[k].copy_(f)
        acc[0] += self.group_bytes[i]
        acc[1] += sum(f.numel() for f in flat)
        acc[2] += 1
        return buf

    def send(self, version: int, announce) -> SyncStats:
        """Leader: announce the version to each rollout rank (``announce(kind, digest)``
        sends the header), then stream it bucket by bucket, each bucket gathered (when
        sharded) only as it is packed: at most one bucket of gathered tensors at a time.
        Returns what moved and how long it took."""
        t0, kind = time.perf_counter(), self.kind()
        announce(kind, self.digest)
        if self.delta and self.last is None:
            self.last = [None] * len(self.params)
        acc = [0, 0, 0]
        with torch.no_grad():
            _Stream(self.group, self.src).run(lambda i: self._pack(i, kind, acc),
                                              lambda i, b: None, len(self.groups))
        return SyncStats(version, acc[0], time.perf_counter() - t0, len(self.groups),
                         "delta" if kind == DELTA else "full", acc[1], self.total_bytes,
                         acc[2])

    def join(self) -> None:
        """A training rank other than the leader: its part of the leader's gathers, bucket
        by bucket as the leader packs them (a no-op when the tensors are not sharded)."""
        for i in range(len(self.groups)):
            self.gather(i)

    # ---- a rollout rank -----------------------------------------------------------------
    def _write(self, k: int, buf: torch.Tensor):
        p = self.params[k]
        p.data.copy_(_as(buf, p.dtype).view(p.shape))

    def _apply(self, i: int, idx: torch.Tensor, vals: torch.Tensor):
        """Write bucket ``i``'s (flat index, value) pairs (indices ascending; ``vals`` the
        values' bytes, tensor by tensor) into the parameters."""
        which = torch.searchsorted(self.offsets.to(idx.device), idx, right=True) - 1
        off = 0
        for k in self.groups[i]:
            sel = which == k
            m = int(sel.sum())
            if not m:
                continue
            p = self.params[k].data
            n = m * p.element_size()
            flat = idx[sel] - int(self.offsets[k])  # row-major, whatever p's strides
            p[torch.unravel_index(flat, p.shape)] = _as(vals[off:off + n], p.dtype)
            off += n

    def receive(self, version: int, kind: int, count: int) -> SyncStats:
        """Rollout rank: take the version the header announced (``count``: the names'
        digest)."""
        if count != self.digest:
            raise RuntimeError("weight sync: the rollout rank's trainable tensors differ "
                               "from the trainer's (names, shapes or dtypes)")
        t0 = time.perf_counter()
        plan: dict[int, int] = {}  # bucket -> changed elements (-1: whole)
        acc = [0, 0, 0]

        def make(i):
            n = self.group_bytes[i]
            if kind == DELTA:
                head = torch.empty(2, dtype=torch.int64, device=self.device)
                td.broadcast(head, self.src, self.group)
                plan[i], n = head.tolist()
            else:
                plan[i] = -1
            acc[0] += n
            return torch.empty(n, dtype=torch.uint8, device=self.device)

        def take(i, buf):
            c = plan.pop(i)
            if c >= 0:
                self._apply(i, buf[:8 * c].view(torch.int64), buf[8 * c:])
                acc[1] += c
                return
            off = 0
            for k in self.groups[i]:
                self._write(k, buf[off:off + self.sizes[k]])
                off += self.sizes[k]
            acc[1] += sum(self.params[k].numel() for k in self.groups[i])
            acc[2] += 1
        with torch.no_grad():
            _Stream(self.group, self.src).run(make, take, len(self.groups))
        return SyncStats(version, acc[0], time.perf_counter() - t0, len(self.groups),
                         "delta" if kind == DELTA else "full", acc[1], self.total_bytes,
                         acc[2])
