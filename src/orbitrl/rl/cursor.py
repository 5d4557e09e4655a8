"""The run's position in its training prompts: a shuffled order, reshuffled each epoch.

Every rank advances by the whole global batch (``draw``), so ranks stay in step and a resume
at any world size continues where the run was. Overlapped, the producer thread draws ahead of
training: ``trained`` records the position as of the trained steps, which is what a checkpoint
keeps (the drawn-ahead prompts come again after a resume, as the run would have drawn them).
"""

from __future__ import annotations

import random


class DataCursor:
    def __init__(self, rows: list[dict], seed: int):
        self.rows, self.seed = rows, seed
        self.order = list(range(len(rows)))
        random.Random(seed).shuffle(self.order)
        self.pos = 0
        self._trained: tuple | None = None

    def draw(self, n: int) -> list[dict]:
        """The next ``n`` rows (the order reshuffles each time it wraps)."""
        rows = []
        for _ in range(n):
            if self.pos % len(self.order) == 0 and self.pos:
                random.Random(self.seed + self.pos).shuffle(self.order)
            rows.append(self.rows[self.order[self.pos % len(self.order)]])
            self.pos += 1
        return rows

    def position(self) -> tuple:
        """(position, order) now: for ``rewind`` or ``trained``."""
        return self.pos, list(self.order)

    def rewind(self, position: tuple):
        """Back to a ``position()`` (an abandoned step's prompts come again)."""
        self.pos, self.order = position

    def trained(self, position: tuple):
        """The position as of the steps trained so far (the producer may be ahead)."""
        self._trained = position

    def state_dict(self) -> dict:
        pos, order = self._trained or (self.pos, self.order)
        return {"data_pos": pos, "order": list(order)}

    def load_state_dict(self, sd: dict):
        self.pos, self.order = sd["data_pos"], sd["order"]
        self._trained = None
