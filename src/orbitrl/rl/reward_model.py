"""A reward model as a reward source: ``rm:PATH`` in ``reward.name`` or ``reward.extra``.

PATH is a directory, a Hub id or ``builtin:NAME`` (``model/builtin.py``
``resolve_model_path``) holding a transformers sequence classifier or orbitrl's first format
(``train/reward_model.py``). It lives here, not in ``rewards/``, because rewards never
import the model. The reward runner sees a batch source (``score_batch``): called once per
batch in the caller's thread, it reads every (prompt, completion) as ``reward_ids`` does,
pads ``batch_size`` rows at a time to one forward on the run's device in the run's dtype,
and reads each row's score at its last token; its scores get the runner's error accounting
and per-source metrics like any verifier's.
"""

from __future__ import annotations

import threading
from pathlib import Path

from orbitrl.model import load_tokenizer
from orbitrl.model.builtin import resolve_model_path
from orbitrl.rewards.code import BatchScores
from orbitrl.train.reward_model import load_reward_model, reward_ids


class RewardModel:
    """Args:
        path: the reward model (a directory, a Hub id or ``builtin:NAME``).
        device, dtype: where and in what it computes (a run's ``model.device``,
            ``model.dtype``).
        batch_size: sequences per forward.
    """

    def __init__(self, path: str | Path, device="cpu", dtype="fp32", batch_size: int = 16):
        self.path = resolve_model_path(path)
        self.model = load_reward_model(self.path, dtype=dtype, device=device)
        self.tok = load_tokenizer(self.path, self.model.backbone.config.vocab_size)
        self.batch_size = batch_size
        self.lock = threading.Lock()  # one forward at a time (an overlapped rollout judges too)
        self.__name__ = f"rm:{self.path.name}"

    def score_batch(self, prompts: list[str], completions: list[str], fields=None
                    ) -> BatchScores:
        """Scores of B samples (None and an error where a sample has no tokens)."""
        rows = [reward_ids(self.tok, p, c) for p, c in zip(prompts, completions)]
        ok = [i for i, r in enumerate(rows) if r]
        with self.lock:
            got = self.model.scores([rows[i] for i in ok], self.batch_size) if ok else []
        scores: list[float | None] = [None] * len(rows)
        for i, s in zip(ok, got):
            scores[i] = s
        return BatchScores(scores, [(i, "exception", "empty prompt and completion")
                                    for i, r in enumerate(rows) if not r])

    def __call__(self, prompt: str, completion: str, **fields) -> float:
        """One sample's score (a batch of one)."""
        res = self.score_batch([prompt], [completion])
        if res.errors:
            raise ValueError(res.errors[0][2])
        return res.scores[0]
