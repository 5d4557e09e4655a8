"""The decode batch as rows of static device buffers, changed incrementally.

Each running sequence that is decoding owns one row (rows ``0 .. n-1``, compact, in the
scheduler's order): its last token, its position, its block table row (int32), context
length, stream key and token counter, completion limit, sampling parameters and stop ids.
The static decode runner reads and advances these buffers on the device; the host keeps
only what it needs to schedule without reading them back:

- ``pos_h`` and ``nblk_h`` (numpy): positions advance by one per step for every row, so the
  host knows, without a device read, which rows cross into a new KV block; only those rows
  touch the block pool, and each new block changes one element of the device block table;
  ``last_h``: the position at which a row's completion limit ends it (the engine does not
  launch a step whose every row ended before it);
- the step's changes (rows that join, rows compacted after others finished, new block
  table elements) are queued as integers and applied with one host-to-device copy
  (:meth:`flush`).

Padding rows (``n .. b-1`` of a bucket of size ``b``) have context length 0: the runner
keeps them from writing the KV of real rows and from advancing.
"""

from __future__ import annotations

import numpy as np
import torch

from orbitrl.engine.block_pool import BlockPool
from orbitrl.engine.sequence import Sequence

# scalar int64 fields of a row, in the order a packed row carries them
_INT_FIELDS = ("tokens", "positions", "context_lens", "keys", "counters", "limits", "top_k")
_FLOAT_FIELDS = ("inv_temp", "top_p")  # packed as their fp32 bits


class DecodeState:
    """Static buffers for ``capacity`` rows of at most ``max_blocks`` KV blocks each.

    Args:
        capacity: rows (the largest bucket).
        max_blocks: block-table width (``ceil(max_model_len / block_size)``).
        block_size: tokens per KV block.
        max_model_len: context length (a row's completion limit also stops it there).
        device: where the buffers live.
        stop_width: stop ids per row (grows when a request needs more; see ``grown``).
    """

    def __init__(self, capacity: int, max_blocks: int, block_size: int, max_model_len: int,
                 device, stop_width: int = 8):
        self.capacity, self.max_blocks, self.block_size = capacity, max_blocks, block_size
        self.max_model_len, self.device = max_model_len, device
        z = lambda dtype, *shape: torch.zeros(capacity, *shape, dtype=dtype, device=device)  # noqa: E731
        for name in _INT_FIELDS:
            setattr(self, name, z(torch.long))
        self.context_lens = z(torch.int32)
        self.inv_temp, self.top_p = z(torch.float32), z(torch.float32)
        self.greedy = z(torch.bool)
        self.block_tables = z(torch.int32, max_blocks)
        self.stop_width = stop_width
        self.stop_ids = torch.full((capacity, stop_width), -1, dtype=torch.long, device=device)
        self.pos_h = np.zeros(capacity, dtype=np.int64)
        self.nblk_h = np.zeros(capacity, dtype=np.int64)
        self.last_h = np.zeros(capacity, dtype=np.int64)  # the position of a row's last step
        self.seqs: list[Sequence] = []
        self.valid = False  # rows mirror the scheduler's running sequences
        self.grown = False  # a buffer was reallocated (captured graphs are stale)
        self.filtered = 0  # rows with top-k / top-p (the runner sorts only if any)
        self.stop_strings = 0  # rows with stop strings (checked on the host)
        self._stage, self._flip = None, 0  # CUDA: pinned staging buffers (_upload)
        self._clear_queue()

    # ---- host bookkeeping ------------------------------------------------------------
    @property
    def n(self) -> int:
        return len(self.seqs)

    def _clear_queue(self):
        self._moves: list[tuple[int, int]] = []
        self._vacate: tuple[int, int] | None = None
        self._rows: list[list[int]] = []
        self._elems: list[tuple[int, int, int]] = []

    def reset(self) -> None:
        """Forget every row (after a step through the general path, a preemption, a pool
        resize or an abort); :meth:`register` rebuilds them."""
        self.seqs, self.valid, self.filtered, self.stop_strings = [], False, 0, 0
        self._clear_queue()
        self.context_lens.zero_()
        self.positions.zero_()

    def register(self, seqs: list[Sequence], pool: BlockPool) -> list | None:
        """Give every sequence (all decode-ready) a row, making room in the pool for its
        next token (copy-on-write of a shared block included). Returns the block copies
        to perform, or None (rows untouched) if the pool cannot hold them."""
        self.reset()
        if sum(pool.blocks_needed(s, 1) for s in seqs) > pool.num_free:
            return None
        width = max([len(s.stop_ids) for s in seqs] + [1])
        if width > self.stop_width:
            self.stop_ids = torch.full((self.capacity, width), -1, dtype=torch.long,
                                       device=self.device)
            self.stop_width, self.grown = width, True
        copies = []
        for row, seq in enumerate(seqs):
            copies += pool.append(seq, 1)
            self._rows.append(self._pack(row, seq))
            self.pos_h[row], self.nblk_h[row] = seq.num_computed, len(seq.block_table)
            self.last_h[row] = seq.num_prompt + self._limit(seq) - 2
            self.filtered += 0 < seq.params.top_k or seq.params.top_p < 1
            self.stop_strings += bool(seq.params.stop)
        self.seqs, self.valid = list(seqs), True
        return copies

    def _limit(self, seq: Sequence) -> int:
        """The row's completion limit: the request's max_tokens, or the context's end."""
        return min(seq.params.max_tokens, self.max_model_len - seq.num_prompt)

    def _pack(self, row: int, seq: Sequence) -> list[int]:
        """One row's full state as int64s (floats as their fp32 bits)."""
        p, pos = seq.params, seq.num_computed
        limit = self._limit(seq)
        temp = np.float32(p.temperature)
        inv = np.float32(1.0) if temp == 0 else np.float32(1.0) / temp
        bits = np.array([inv, np.float32(p.top_p)], dtype=np.float32).view(np.int32)
        stops = sorted(seq.stop_ids) + [-1] * (self.stop_width - len(seq.stop_ids))
        table = seq.block_table + [0] * (self.max_blocks - len(seq.block_table))
        return ([row, seq.token_ids[pos], pos, pos + 1, seq.key, seq.num_completion, limit,
                 p.top_k, int(temp == 0), int(bits[0]), int(bits[1])] + stops + table)

    def prepare(self, pool: BlockPool) -> list | None:
        """Before a step: a new block for every row whose next token starts one (one
        block-table element each). Returns the block copies (copy-on-write) to perform,
        or None (nothing changed) if the pool has too few free blocks."""
        n = self.n
        cross = np.flatnonzero(self.pos_h[:n] // self.block_size >= self.nblk_h[:n])
        if len(cross) > pool.num_free:
            return None
        copies = []
        for row in cross.tolist():
            seq = self.seqs[row]
            copies += pool.append(seq, 1)
            col = len(seq.block_table) - 1
            self._elems.append((row, col, seq.block_table[col]))
            self.nblk_h[row] += 1
        return copies

    def advance(self) -> None:
        """After a step: every row's position moved by one."""
        self.pos_h[:self.n] += 1

    def remove(self, rows: list[int]) -> None:
        """Drop finished rows and compact the rest (order kept); the moves are queued."""
        if not rows:
            return
        assert self._vacate is None, "one removal per flush"
        gone, n = set(rows), self.n
        kept = [r for r in range(n) if r not in gone]
        self._moves += [(dst, src) for dst, src in enumerate(kept) if dst != src]
        self.pos_h[:len(kept)] = self.pos_h[kept]
        self.nblk_h[:len(kept)] = self.nblk_h[kept]
        self.last_h[:len(kept)] = self.last_h[kept]
        for r in gone:
            p = self.seqs[r].params
            self.filtered -= 0 < p.top_k or p.top_p < 1
            self.stop_strings -= bool(p.stop)
        self.seqs = [self.seqs[r] for r in kept]
        self._vacate = (len(kept), n)

    # ---- device updates ------------------------------------------------------------
    def flush(self) -> None:
        """Apply the queued changes with one host-to-device copy: compaction moves, then
        vacated rows zeroed, then new rows, then new block-table elements."""
        m, r, e = len(self._moves), len(self._rows), len(self._elems)
        if not (m or r or e or self._vacate):
            return
        flat = [x for mv in self._moves for x in mv] + [x for row in self._rows for x in row] \
            + [x for el in self._elems for x in el]
        dev = self._upload(np.asarray(flat, dtype=np.int64))
        if m:
            mv = dev[:2 * m].view(m, 2)
            for buf in self._buffers():
                buf.index_copy_(0, mv[:, 0], buf.index_select(0, mv[:, 1]))
        if self._vacate:
            lo, hi = self._vacate
            self.context_lens[lo:hi] = 0
            self.positions[lo:hi] = 0
        if r:
            self._write_rows(dev[2 * m:2 * m + r * len(self._rows[0])].view(r, -1))
        if e:
            el = dev[len(flat) - 3 * e:].view(e, 3)
            self.block_tables.index_put_((el[:, 0], el[:, 1]), el[:, 2].int())
        self._clear_queue()

    def _upload(self, arr: np.ndarray) -> torch.Tensor:
        """``arr`` on the device. On CUDA through one of two pinned staging buffers: a copy
        from pageable memory may wait for the work queued before it (the step in flight,
        which the engine's async decode overlaps with this); a buffer is refilled once its
        previous copy has run (an event)."""
        if self.device.type != "cuda":
            return torch.from_numpy(arr).to(self.device)
        k = len(arr)
        if self._stage is None or self._stage[0][0].numel() < k:
            for _, ev in self._stage or []:
                if ev is not None:
                    ev.synchronize()
            size = max(k, 4096)
            self._stage = [[torch.empty(size, dtype=torch.int64, pin_memory=True), None]
                           for _ in range(2)]
        slot = self._stage[self._flip]
        self._flip ^= 1
        if slot[1] is not None:
            slot[1].synchronize()
        host = slot[0][:k]
        host.copy_(torch.from_numpy(arr))
        dev = host.to(self.device, non_blocking=True)
        slot[1] = torch.cuda.Event()
        slot[1].record(torch.cuda.current_stream(self.device))
        return dev

    def _buffers(self):
        return [getattr(self, f) for f in _INT_FIELDS + _FLOAT_FIELDS] + [
            self.greedy, self.stop_ids, self.block_tables]

    def _write_rows(self, t: torch.Tensor) -> None:
        idx, k = t[:, 0], len(_INT_FIELDS)
        for j, name in enumerate(_INT_FIELDS):
            buf = getattr(self, name)
            buf.index_copy_(0, idx, t[:, 1 + j].to(buf.dtype))
        self.greedy.index_copy_(0, idx, t[:, 1 + k].bool())
        for j, name in enumerate(_FLOAT_FIELDS):
            bits = t[:, 2 + k + j].to(torch.int32)
            getattr(self, name).index_copy_(0, idx, bits.view(torch.float32))
        s0 = 2 + k + len(_FLOAT_FIELDS)
        self.stop_ids.index_copy_(0, idx, t[:, s0:s0 + self.stop_width])
        self.block_tables.index_copy_(0, idx, t[:, s0 + self.stop_width:].int())
