"""KV block pool: fixed-size blocks, reference counts, chained prefix hashes, copy-on-write.

A sequence's KV lives in the blocks of its ``block_table``; token position p sits in slot
``block_table[p // block_size] * block_size + p % block_size`` of the cache tensors.

Sharing, two ways:
- fork: the n samples of one prompt copy the parent's block table and bump every block's
  refcount, so the prompt's KV exists once. The first write into a shared (partial) block
  copies it first (copy-on-write); full blocks are never written again, so never copied.
- prefix hashes: once a block is full and computed its hash, chained through the previous
  block's (``hash((prev_hash, tokens))``), is registered; a new sequence whose leading full
  blocks hash the same reuses them. Freed blocks keep their hash until they are handed out
  again (least recently freed first), so a preempted sequence often finds its prefix still
  cached when it is recomputed.
"""

from __future__ import annotations

from collections import OrderedDict

from orbitrl.engine.sequence import Sequence


class BlockPool:
    """Counters (the tests and the summary read them): ``allocated`` fresh blocks handed
    out, ``prefix_hits`` blocks reused through a hash, ``cow`` copy-on-write copies,
    ``peak_used`` most blocks referenced at once."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref = [0] * num_blocks
        self.hash: list[int | None] = [None] * num_blocks
        self.tokens: list[tuple | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[int, int] = {}  # prefix hash -> block id
        self.allocated = self.prefix_hits = self.cow = self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def _take(self) -> int:
        b, _ = self.free.popitem(last=False)
        if self.hash[b] is not None and self.cached.get(self.hash[b]) == b:
            del self.cached[self.hash[b]]
        self.hash[b] = self.tokens[b] = None
        self.ref[b] = 1
        self.allocated += 1
        self.peak_used = max(self.peak_used, self.num_used)
        return b

    def _span(self, seq: Sequence, num_new: int) -> tuple[int, int]:
        bs = self.block_size
        return seq.num_computed // bs, -(-(seq.num_computed + num_new) // bs)

    def _needs_cow(self, seq: Sequence, num_new: int) -> bool:
        first, _ = self._span(seq, num_new)
        return first < len(seq.block_table) and self.ref[seq.block_table[first]] > 1

    def blocks_needed(self, seq: Sequence, num_new: int) -> int:
        first, last = self._span(seq, num_new)
        return max(0, last - len(seq.block_table)) + self._needs_cow(seq, num_new)

    def can_append(self, seq: Sequence, num_new: int) -> bool:
        return self.blocks_needed(seq, num_new) <= len(self.free)

    def append(self, seq: Sequence, num_new: int) -> list[tuple[int, int]]:
        """Make room for ``num_new`` more tokens. Returns (src, dst) block copies that the KV
        cache must perform before the step writes (copy-on-write)."""
        copies = []
        if self._needs_cow(seq, num_new):
            i = seq.num_computed // self.block_size
            old, new = seq.block_table[i], self._take()
            self.ref[old] -= 1
            seq.block_table[i] = new
            copies.append((old, new))
            self.cow += 1
        _, last = self._span(seq, num_new)
        while len(seq.block_table) < last:
            seq.block_table.append(self._take())
        return copies

    def admit(self, seq: Sequence) -> None:
        """Reuse cached blocks for the leading full blocks of a new sequence's tokens (never
        the last token: its logits are needed, so it is always computed)."""
        assert not seq.block_table and seq.num_computed == 0
        bs, prev = self.block_size, None
        for i in range((len(seq) - 1) // bs):
            toks = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = hash((prev, toks))
            b = self.cached.get(h)
            if b is None or self.tokens[b] != toks:
                break
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1
            seq.block_table.append(b)
            self.prefix_hits += 1
            prev = h
        seq.num_computed = len(seq.block_table) * bs
        seq.num_hashed = len(seq.block_table)
        self.peak_used = max(self.peak_used, self.num_used)

    def commit(self, seq: Sequence, upto: int | None = None) -> None:
        """Register hashes of blocks that became full and computed this step: those within
        the sequence's first ``upto`` tokens (default ``num_computed``; the engine's
        decode steps, when one more step of the sequence is already launched, pass the
        tokens computed by the step whose results it reads)."""
        bs = self.block_size
        upto = seq.num_computed if upto is None else upto
        for i in range(seq.num_hashed, upto // bs):
            b = seq.block_table[i]
            if self.hash[b] is None:
                prev = self.hash[seq.block_table[i - 1]] if i else None
                toks = tuple(seq.token_ids[i * bs:(i + 1) * bs])
                self.hash[b], self.tokens[b] = hash((prev, toks)), toks
                self.cached.setdefault(self.hash[b], b)
        seq.num_hashed = max(seq.num_hashed, upto // bs)

    def reset_prefix_cache(self) -> None:
        """Forget every prefix hash (cached KV is stale once the weights change)."""
        self.cached.clear()
        self.hash = [None] * self.num_blocks
        self.tokens = [None] * self.num_blocks

    def fork(self, child: Sequence) -> None:
        """``child`` copied its parent's block table: share every block."""
        for b in child.block_table:
            self.ref[b] += 1

    def trim(self, seq: Sequence, num_blocks: int) -> None:
        """Drop the sequence's blocks past its first ``num_blocks`` (claimed for a token
        whose step was discarded)."""
        while len(seq.block_table) > num_blocks:
            b = seq.block_table.pop()
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None

    def free_seq(self, seq: Sequence) -> None:
        """Drop the sequence's references; blocks that reach zero become free (hash kept)."""
        for b in reversed(seq.block_table):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
        seq.block_table = []
        seq.num_computed = seq.num_hashed = 0

    def resize(self, num_blocks: int) -> None:
        """Grow the pool, or shrink it once no block at or past ``num_blocks`` is referenced
        (the engine preempts their holders first). Counters are kept."""
        if num_blocks <= 0:
            raise ValueError("the KV pool needs at least one block")
        old = self.num_blocks
        if num_blocks >= old:
            add = num_blocks - old
            self.ref += [0] * add
            self.hash += [None] * add
            self.tokens += [None] * add
            for b in range(old, num_blocks):
                self.free[b] = None
        else:
            held = [b for b in range(num_blocks, old) if self.ref[b]]
            if held:
                raise RuntimeError(f"cannot shrink the KV pool: blocks {held[:4]} in use")
            for b in range(num_blocks, old):
                del self.free[b]
                h = self.hash[b]
                if h is not None and self.cached.get(h) == b:
                    del self.cached[h]
            del self.ref[num_blocks:], self.hash[num_blocks:], self.tokens[num_blocks:]
        self.num_blocks = num_blocks

    def allocate_fresh(self, seq: Sequence, num_tokens: int) -> None:
        """Private blocks for ``num_tokens`` tokens of a sequence coming back from host."""
        assert not seq.block_table
        while len(seq.block_table) * self.block_size < num_tokens:
            seq.block_table.append(self._take())
