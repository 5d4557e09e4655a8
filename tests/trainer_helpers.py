"""An RLTrainer on the built-in task, for tests that step one."""

from __future__ import annotations

from orbitrl.config import load_config
from orbitrl.rl.run import load_data
from orbitrl.rl.trainer import RLTrainer


def make_trainer(*overrides: str) -> RLTrainer:
    """The trainer ``orbitrl train --set ...`` would build with these overrides."""
    cfg = load_config(None, list(overrides))
    train, held = load_data(cfg)
    return RLTrainer(cfg, train, held)


def reward_anything(prompt: str, completion: str, **fields) -> float:
    """A reward a policy fools at once: every reply scores 1 (for the grader tests)."""
    return 1.0
