"""Dynamic sampling's refill (rl/refill.py): flat groups replaced by fresh prompts' groups,
round by round up to ``algo.dynamic_sampling_rounds``, on the built-in tiny model.

The rewards here are batch sources that score by a sample's position in its group (0, 1,
..., n-1: always informative) or flat (1.0 for the whole group), so which groups are flat
depends on the script or the prompt alone, never on what the model generated."""

import zlib
from types import SimpleNamespace

import pytest
import torch

from orbitrl.config import load_config
from orbitrl.errors import OrbitError
from orbitrl.rewards import register
from orbitrl.rl.refill import merge_metrics, merge_rewards
from trainer_helpers import make_trainer

N, P = 4, 2
SMALL = [f"rollout.prompts_per_step={P}", f"rollout.n={N}", "rollout.max_tokens=4",
         "data.heldout_size=8", "model.base_dtype=int8", "algo.dynamic_sampling=true"]


def _scores(flat_groups, count: int) -> SimpleNamespace:
    """Batch scores: group g flat (1.0) when ``flat_groups(g)``, else 0..n-1 by position."""
    return SimpleNamespace(scores=[1.0 if flat_groups(i // N) else float(i % N)
                                   for i in range(count)], errors=[], details=[], metrics={})


class Scripted:
    """The k-th batch judged (one refill round each): its first ``flat[k]`` groups flat
    (past the script none); ``rounds`` records each batch's group count."""

    def __init__(self, flat):
        self.flat, self.rounds = list(flat), []

    def __call__(self, prompt, completion, **fields):
        raise AssertionError("scored as a batch")

    def score_batch(self, prompts, completions, rows):
        k = len(self.rounds)
        self.rounds.append(len(prompts) // N)
        flat = self.flat[k] if k < len(self.flat) else 0
        return _scores(lambda g: g < flat, len(prompts))


class ByPrompt:
    """Flat for about half the prompts (a hash of the prompt text), whatever the round:
    the same step gives the same rewards after a stop or a resume."""

    def __call__(self, prompt, completion, **fields):
        raise AssertionError("scored as a batch")

    def score_batch(self, prompts, completions, rows):
        return _scores(lambda g: zlib.crc32(prompts[g * N].encode()) % 2 == 0, len(prompts))


register("test_ds_by_prompt", override=True)(ByPrompt())


@register("test_ds_constant", override=True)
def _constant(prompt, completion, **fields):
    return 1.0


def make(*over):
    return make_trainer(*SMALL, *over)


def scripted(flat, *over):
    reward = register("test_ds_scripted", override=True)(Scripted(flat))
    return make("reward.name=test_ds_scripted", *over), reward


class Watched:
    """A phase object that records what it is called with (``note``) and otherwise is
    the one it wraps."""

    def __init__(self, inner, note):
        self.inner, self.note = inner, note

    def __call__(self, x, *a):
        self.note(x)
        return self.inner(x, *a)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def watch(tr) -> dict:
    """Record the judged rollout each step scores and the batch each update trains."""
    seen = {"rollouts": [], "trained": []}
    tr.scorer = Watched(tr.scorer, seen["rollouts"].append)
    tr.updater = Watched(tr.updater, lambda b: seen["trained"].append(sum(b.sizes)))
    return seen


def adapters(tr):
    return [p.detach().clone() for p in tr.policy.trainable]


def test_flat_groups_are_refilled_from_fresh_prompts_up_to_the_batch():
    tr, reward = scripted([1])  # round 0: one of the two groups flat; fresh ones informative
    seen = watch(tr)
    row = tr.step()
    assert reward.rounds == [2, 1]  # one extra round, drawing just the missing group
    assert row["dynamic_sampling_rounds"] == 1 and row["prompts_sampled"] == 3
    assert row["informative_groups"] == P and row["dropped_groups"] == 1
    assert row["groups_kept"] == 3 and row["step_skipped"] == 0 and tr.step_idx == 1
    assert tr.data.pos == 3  # the fresh prompt came from the cursor
    assert seen["trained"] == [P * N]  # a full batch of informative groups trained
    ro = seen["rollouts"][0]
    assert [s.group for s in ro.samples] == [g for g in range(3) for _ in range(N)]
    assert ro.data_after[0] == 3 and len(ro.rewards.rewards) == 3 * N
    # the refill's group is a new prompt, sampled with its own seed
    assert ro.samples[8].fields["prompt"] not in {s.fields["prompt"] for s in ro.samples[:8]}


def test_the_bound_stops_the_refill_and_the_step_trains_on_what_it_kept():
    tr, reward = scripted([2, 1, 1], "algo.dynamic_sampling_rounds=2")
    seen = watch(tr)
    row = tr.step()
    # round 0: both flat (draw 2); round 1: one of 2 flat (draw 1); round 2: flat; bound
    assert reward.rounds == [2, 2, 1]
    assert row["dynamic_sampling_rounds"] == 2 and row["prompts_sampled"] == 5
    assert row["informative_groups"] == 1 and row["dropped_groups"] == 4
    assert seen["trained"] == [N] and row["step_skipped"] == 0 and tr.data.pos == 5


def test_a_constant_reward_runs_exactly_the_bound_then_skips_the_step():
    tr = make("reward.name=test_ds_constant", "algo.dynamic_sampling_rounds=2")
    before = adapters(tr)
    row = tr.step()
    assert row["dynamic_sampling_rounds"] == 2 and row["prompts_sampled"] == 3 * P
    assert row["informative_groups"] == 0 and row["dropped_groups"] == 3 * P
    assert row["step_skipped"] == 1 and tr.step_idx == 0 and tr.data.pos == 3 * P
    assert all(torch.equal(a, b) for a, b in zip(before, adapters(tr)))


def test_zero_rounds_drops_only_as_before():
    tr, reward = scripted([1], "algo.dynamic_sampling_rounds=0")
    seen = watch(tr)
    row = tr.step()
    assert reward.rounds == [2] and tr.data.pos == P
    assert row["dynamic_sampling_rounds"] == 0 and row["prompts_sampled"] == P
    assert row["informative_groups"] == 1 and row["dropped_groups"] == 1
    assert row["groups_kept"] == P and seen["trained"] == [N]


def test_without_dynamic_sampling_nothing_is_dropped_or_refilled():
    tr, reward = scripted([1], "algo.dynamic_sampling=false")
    seen = watch(tr)
    row = tr.step()
    assert reward.rounds == [2] and seen["trained"] == [P * N]
    assert not {"dropped_groups", "dynamic_sampling_rounds", "prompts_sampled",
                "informative_groups"} & set(row)


def test_a_spent_watchdog_limit_starts_no_refill_round():
    """The rounds share the step's ``rollout.timeout_s``: past it, no round starts."""
    tr = make("reward.name=test_ds_constant", "rollout.timeout_s=1e-9")
    row = tr.step()  # nothing finishes in a nanosecond: every group dropped, none refilled
    assert row["watchdog"] == 1 and row["groups_kept"] == 0 and row["step_skipped"] == 1
    assert row["dynamic_sampling_rounds"] == 0 and row["prompts_sampled"] == P
    assert tr.data.pos == P


def test_stop_during_a_refill_round_rewinds_every_round_and_the_step_reruns_the_same():
    from orbitrl.rl.trainer import StepAbandoned

    over = ("reward.name=test_ds_by_prompt", "train.deterministic=true")
    ref = make(*over)
    want = ref.step()
    assert want["dynamic_sampling_rounds"] >= 1  # (the data order makes round 0 flat)
    tr = make(*over)
    tr.should_stop = lambda: tr.data.pos > P  # polled in the refill round's engine steps
    with pytest.raises(StepAbandoned):
        tr.step()
    assert tr.data.pos == 0 and tr.iteration == 0 and tr.step_idx == 0
    tr.should_stop = lambda: False
    got = tr.step()
    for k in ("dynamic_sampling_rounds", "prompts_sampled", "informative_groups",
              "reward_mean", "loss"):
        assert got[k] == want[k], k
    assert all(torch.equal(a, b) for a, b in zip(adapters(ref), adapters(tr)))


def test_resume_continues_the_refilled_steps_bit_for_bit(tmp_path):
    from orbitrl.rl.checkpoint import Checkpointer, resume_from

    over = ("reward.name=test_ds_by_prompt", "train.deterministic=true",
            "rollout.prompts_per_step=3")
    ref = make(*over)
    want = [ref.step() for _ in range(2)]
    assert sum(r["dynamic_sampling_rounds"] for r in want) >= 1
    assert ref.data.pos == sum(r["prompts_sampled"] for r in want)
    first = make(*over)
    first.step()
    ck = Checkpointer(tmp_path / "checkpoints")
    ck.save(first, {}, block=True)
    tr = make(*over)
    resume_from(tr, ck.latest())
    got = tr.step()
    for k in ("dynamic_sampling_rounds", "prompts_sampled", "informative_groups",
              "reward_mean", "loss"):
        assert got[k] == want[1][k], k
    assert tr.data.pos == ref.data.pos
    assert all(torch.equal(a, b) for a, b in zip(adapters(ref), adapters(tr)))


def test_overlapped_producer_refills_and_the_checkpoint_keeps_the_trained_position():
    tr = make("reward.name=test_ds_by_prompt", "rollout.overlap=true")
    try:
        rows = [tr.step() for _ in range(3)]
        trained = tr.data.state_dict()["data_pos"]
    finally:
        tr.close()
    assert sum(r["dynamic_sampling_rounds"] for r in rows) >= 1
    assert all(r["informative_groups"] <= P for r in rows)
    assert trained == sum(r["prompts_sampled"] for r in rows)


def test_refill_rounds_with_separate_pools_are_refused_at_load():
    base = ["algo.dynamic_sampling=true", "schedule.shape=one_step"]
    with pytest.raises(OrbitError, match="algo.dynamic_sampling_rounds.*schedule.shape"):
        load_config(None, base)
    assert load_config(None, base + ["algo.dynamic_sampling_rounds=0"])
    assert load_config(None, ["schedule.shape=async"])  # without dynamic sampling: fine
    with pytest.raises(OrbitError, match="algo.dynamic_sampling_rounds"):
        load_config(None, ["algo.dynamic_sampling_rounds=-1"])


def test_merged_rounds_keep_indices_and_weigh_means_by_samples():
    from orbitrl.rewards.runner import RewardError, RewardResult

    a = RewardResult([1.0, 0.0], {"x": [1.0, 0.0]}, [RewardError(1, "x", "timeout", "t")],
                     {"reward_mean": 0.5, "reward_x_errors": 0.0, "reward_x_timeouts": 1.0},
                     {"x": ["ok", "t"]})
    b = RewardResult([1.0] * 4, {"x": [1.0] * 4}, [RewardError(0, "x", "exception", "e")],
                     {"reward_mean": 1.0, "reward_x_errors": 1.0, "reward_x_timeouts": 0.0},
                     {})
    m = merge_rewards(a, 2, b, 4)
    assert m.rewards == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0] and m.per_source["x"] == m.rewards
    assert [(e.index, e.kind) for e in m.errors] == [(1, "timeout"), (2, "exception")]
    assert m.details == {"x": ["ok", "t", None, None, None, None]}
    assert m.metrics == {"reward_mean": pytest.approx(5 / 6), "reward_x_errors": 1.0,
                         "reward_x_timeouts": 1.0}
    assert merge_rewards(None, 0, b, 4) is b and merge_rewards(a, 2, None, 0) is a
    env = merge_metrics({"env_tool_frac": 1.0, "env_tool_calls": 3, "kv_wait_host_bytes": 5,
                         "staleness_max": 1}, 1,
                        {"env_tool_frac": 0.0, "env_tool_calls": 2, "kv_wait_host_bytes": 9,
                         "staleness_max": 0}, 3)
    assert env == {"env_tool_frac": 0.25, "env_tool_calls": 5, "kv_wait_host_bytes": 9,
                   "staleness_max": 1}


def test_multi_turn_rounds_merge_their_trajectory_columns():
    tr, reward = scripted([1], "env.name=tools", "env.max_turns=2")
    seen = watch(tr)
    row = tr.step()
    assert reward.rounds == [2, 1] and row["informative_groups"] == P
    assert seen["trained"] == [P * N]
    assert [s.group for s in seen["rollouts"][0].samples] == [g for g in range(3)
                                                              for _ in range(N)]
    assert 1 <= row["env_turns_mean"] <= 2 and row["env_dropped"] == 0
    assert len(tr.last_trajectories) == tr.cfg.env.log_trajectories
