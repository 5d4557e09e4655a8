"""The built-in arithmetic task: ``a+b=`` -> ``c`` over two-digit operands.

All 10,000 pairs are shuffled once with a fixed seed and cut into disjoint splits, so
held-out problems are never seen by supervised warm-up or by RL.
"""

from __future__ import annotations

import random

SPLITS = {"heldout": (0, 500), "sft": (500, 3000), "rl": (3000, 10000)}


def _pairs() -> list[tuple[int, int]]:
    pairs = [(a, b) for a in range(100) for b in range(100)]
    random.Random(1234).shuffle(pairs)
    return pairs


def arith_rows(split: str, limit: int | None = None) -> list[dict]:
    """Rows ``{"prompt": "12+34=", "answer": "46"}`` of one split, in a fixed order."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")
    lo, hi = SPLITS[split]
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in _pairs()[lo:hi]]
    return rows[:limit] if limit else rows
