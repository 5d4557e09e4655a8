"""Ranks with unequal work: a prompt count that does not split evenly, and a rank left with
no samples at all (every group dropped) while the other trains."""

from __future__ import annotations

from dist_helpers import final_weights, max_diff, metrics, train, train_args


def test_uneven_prompt_split_matches_one_process(tiny_llama, tmp_path):
    """3 prompts on 2 ranks (2 + 1), generating on gathered whole weights: the rank with
    less work joins the others' scoring and training collectives, and the result is the
    one-process one."""
    args = train_args(tiny_llama, "full", 2, "rollout.prompts_per_step=3",
                      "dist.rollout_weights=gathered")
    train(args, 1, tmp_path / "one")
    train(args, 2, tmp_path / "two")
    d = max_diff(final_weights(tmp_path / "one", "full"), final_weights(tmp_path / "two",
                                                                         "full"))
    print(f"3 prompts, 1 process vs 2 ranks: max abs difference {d:.2e}")
    assert d < 1e-5


def test_rank_without_samples_joins_training(tiny_llama, tmp_path):
    """PPO (whitening over the global batch, a replicated value head) with rank 1's groups
    all dropped by dynamic sampling: rank 1 joins the gather, the micro-batches and the
    value head's gradient sum with nothing of its own; rank 0's groups train."""
    run = tmp_path / "run"
    train(train_args(tiny_llama, "adapter", 2, "algo.name=ppo", "algo.dynamic_sampling=true",
                     "reward.name=dist_rewards:digits_but_flat_on_rank1"), 2, run)
    rows = metrics(run)
    assert len(rows) == 2
    assert all(r["dropped_groups"] >= 2 for r in rows)  # rank 1's two groups, every step
    assert any(r["step_skipped"] == 0 and r["grad_norm"] > 0 for r in rows)
