"""The built-in task visibly learns: held-out accuracy after a short run clears the accuracy
before by a wide margin, for every advantage estimator (GRPO also in the overlapped mode,
one step off-policy)."""

import pytest

from orbitrl.config import load_config
from orbitrl.observe.metrics import read_metrics
from orbitrl.rl.run import run_training


def test_overlapped_mode_learns_the_builtin_task(tmp_path):
    cfg = load_config(None, ["rollout.overlap=true", "train.max_steps=40",
                             "data.heldout_size=64", "log.progress=false",
                             "checkpoint.every=0"])
    s = run_training(cfg, tmp_path / "run", echo=lambda *a: None)
    # the untrained model rarely answers in the task's format; 40 one-step-stale GRPO steps
    # teach it (the default run's sequential mode goes from 0.045 to 0.955 in 200)
    assert s["heldout_accuracy_before"] < 0.2
    assert s["heldout_accuracy_after"] > s["heldout_accuracy_before"] + 0.5
    assert s["reward_last_20"] > s["reward_first_20"]


@pytest.mark.parametrize("algo", ["grpo", "rloo", "reinforce++", "ppo"])
def test_estimator_learns_the_builtin_task(algo, tmp_path):
    """12 sequential steps of the default run (8 prompts x 8 samples) with each estimator, on
    one core (train.workers=1: the same batch cuts on any machine), held-out accuracy over 64
    rows. Measured at seeds 0-3, with AVX-512 and AVX2 kernels alike (the same numbers):
    0.031 before, 0.89-0.95 after for each estimator (seed 0: GRPO 0.92, RLOO 0.92,
    REINFORCE++ 0.89, PPO 0.89); evaluated during the run, 0.39-0.55 after 5 steps and
    0.89-0.95 after 10. The margin, 0.6, leaves about 0.25 of room."""
    cfg = load_config(None, [f"algo.name={algo}", "train.max_steps=12", "train.workers=1",
                             "train.seed=0", "data.heldout_size=64", "log.progress=false",
                             "checkpoint.every=0"])
    s = run_training(cfg, tmp_path / "run", echo=lambda *a: None)
    assert s["algo"] == algo and s["steps"] == 12 and s["skipped_nonfinite"] == 0
    assert s["heldout_accuracy_before"] < 0.2
    assert s["heldout_accuracy_after"] > s["heldout_accuracy_before"] + 0.6
    # the training reward (sampled at temperature 1) rises too: the last four steps' mean
    # over the first four's, measured 0.17-0.23 -> 0.37-0.42 (a rise of 0.16-0.23)
    rewards = [r["reward_mean"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert len(rewards) == 12
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.1
