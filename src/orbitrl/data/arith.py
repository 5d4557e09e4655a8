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


# Supervised warm-up data is written the way scraped or distilled data often is: the right
# number in one of several surface forms. The RL reward (exact_match) wants the bare number,
# so RL has two things to improve: the arithmetic itself, and the exact answer format.
SFT_FORMATS = (("{c}", 0.25), ("{c}.", 0.35), ("{c} ok", 0.2), ("ans {c}", 0.2))


def sft_rows(limit: int | None = None, seed: int = 0) -> list[dict]:
    """The ``sft`` split with each answer in a randomly drawn surface form (fixed seed)."""
    rng = random.Random(seed)
    forms, weights = zip(*SFT_FORMATS)
    rows = []
    for r in arith_rows("sft", limit):
        form = rng.choices(forms, weights)[0]
        rows.append({"prompt": r["prompt"], "answer": form.format(c=r["answer"]),
                     "value": r["answer"]})
    return rows
