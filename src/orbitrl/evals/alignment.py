"""``orbitrl check-alignment``'s part of the evaluation suite: its built-in prompts, and the
measurement it runs, which lives in ``rl/alignment.py`` (training runs the same check every
``log.align_every`` steps, and rl never imports evals) and is re-exported here:
:func:`measure` samples with the engine, recomputes with the trainer and compares
(observe/alignment.py); :func:`engine_samples`, :func:`trainer_logits` and
:func:`training_row` as documented there.
"""

from __future__ import annotations

from orbitrl.rl.alignment import engine_samples, measure, trainer_logits, training_row

__all__ = ["DEFAULT_PROMPTS", "engine_samples", "measure", "trainer_logits", "training_row"]

DEFAULT_PROMPTS = ["12+34=", "7+58=", "90+9=", "The capital of France is",
                   "def add(a, b):", "Once upon a time", "Question: what is 3 times 4?",
                   "import math\n"]
