"""The RL loop on the built-in tiny model: invariants, guards and injected faults."""

import math

import pytest
import torch

from orbitrl.config import load_config
from orbitrl.rewards import register
from trainer_helpers import make_trainer

SMALL = ["rollout.prompts_per_step=2", "rollout.n=4", "rollout.max_tokens=4",
         "data.heldout_size=8", "algo.check=true", "model.base_dtype=int8"]


@register("test_always_raises", override=True)
def _raises(prompt, completion, **f):
    raise RuntimeError("boom")


@register("test_length", override=True)
def _length(prompt, completion, **f):
    return float(len(completion))  # varied rewards so gradients are non-zero


def make(*over):
    return make_trainer(*SMALL, *over)


def adapters(tr):
    return [p.detach().clone() for p in tr.policy.trainable]


def test_step_zero_invariants_and_metrics():
    tr = make("reward.name=test_length")
    row = tr.step()  # algo.check asserts KL == 0 and ratio == 1 inside the loop
    for k in ("step", "reward_mean", "kl", "entropy", "grad_norm", "logprob_mismatch_max",
              "tokens_per_s", "peak_memory_bytes"):
        assert k in row, k
    assert row["kl"] == pytest.approx(0.0, abs=1e-6)
    assert row["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert row["logprob_mismatch_max"] < 1e-4
    assert row["step_skipped"] == 0 and tr.step_idx == 1
    row2 = tr.step()
    assert row2["policy_version"] == 2


def test_reward_that_raises_is_counted_and_training_continues():
    tr = make("reward.name=test_always_raises")
    row = tr.step()
    assert row["reward_mean"] == 0.0
    assert row["reward_test_always_raises_errors"] == 8


def test_gradient_spike_is_skipped_before_any_state_moves():
    """A spiking step changes nothing: adapters, AdamW's moments and step count, the
    guard's running mean, the policy version; its gradients are dropped, and the next
    step trains from the last good state."""
    tr = make("reward.name=test_length")
    tr.step()
    before = adapters(tr)
    opt_before = {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
                  for p, st in tr.opt.state.items()}
    assert opt_before  # AdamW has moments after one applied step
    tr.guard.mean, tr.guard.count = 1e-12, 100  # any real norm is now a 5x spike
    row = tr.step()
    assert row["step_skipped"] == 1 and row["skipped_spike"] == 1 and tr.step_idx == 1
    assert row["spike_layer"]
    assert all(torch.equal(a, b) for a, b in zip(before, adapters(tr)))
    for p, st in tr.opt.state.items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(opt_before[id(p)][k])), k
    assert tr.guard.mean == 1e-12 and tr.guard.count == 100
    assert all(p.grad is None for p in tr.policy.trainable)
    tr.guard.mean = None  # the heartbeat forgets the spike: the next step is applied
    row = tr.step()
    assert row["step_skipped"] == 0 and tr.step_idx == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, adapters(tr)))


def test_adaptive_kl_moves_the_coefficient_by_the_step_batch_over_the_horizon():
    """Ziegler's rule counts samples: 8 per step over a horizon of 8 moves the coefficient
    by the clipped error (+-20%) each step: KL 0 at step 0 lowers it, KL above target raises
    it."""
    tr = make("reward.name=test_length", "algo.adaptive_kl=true", "algo.target_kl=1e-9",
              "algo.kl_horizon=8", "train.lr=1e-2")
    row = tr.step()
    assert row["kl"] == pytest.approx(0.0, abs=1e-9)
    assert row["kl_coef"] == pytest.approx(0.01 * 0.8)
    row = tr.step()
    assert row["kl"] > 1e-9
    assert row["kl_coef"] == pytest.approx(0.01 * 0.8 * 1.2)


def test_kl_in_reward_uses_the_configured_estimator(monkeypatch):
    """Two runs identical up to the estimator: at the second step (the policy has moved),
    the per-token KL penalty of k2 is k1^2 / 2 of the same tokens."""
    import orbitrl.rl.score as S

    seen = []
    real = S.compute_advantages
    monkeypatch.setattr(S, "compute_advantages",
                        lambda *a: seen.append(a[4].clone()) or real(*a))
    for est in ("k1", "k2"):
        tr = make("reward.name=test_length", "algo.kl_in_reward=true", "train.lr=1e-2",
                  f"algo.kl_estimator={est}")
        tr.step()
        tr.step()
    k1, k2 = seen[1], seen[3]
    assert k1.abs().sum() > 0 and (k1 < 0).any()  # k1 takes both signs, k2 does not
    torch.testing.assert_close(k2, 0.5 * k1 * k1)


@pytest.mark.parametrize("stop_at,workers", [("rollout", 1), ("train", 1), ("train", 2)])
def test_stop_request_abandons_the_step_in_flight_and_changes_nothing(stop_at, workers):
    """SIGTERM's path (run.py sets ``should_stop``): the step in flight is abandoned at the
    next decode step or micro-batch with nothing applied, the data position goes back, and
    the step then runs as if it had never started (deterministic: same row). With two
    workers the micro-batches run side by side: the poll is before them."""
    from orbitrl.rl.trainer import StepAbandoned

    over = ("reward.name=test_length", "train.deterministic=true",
            "train.micro_batch_tokens=16", f"train.workers={workers}")
    ref = make(*over)
    want = ref.step()
    tr = make(*over)
    before, pos = adapters(tr), tr.data.pos
    polls = {False: 0, True: 0}  # decode steps / micro-batches
    in_update = [False]
    update = tr.updater

    def updater(*a, **k):
        in_update[0] = True
        return update(*a, **k)

    # the second micro-batch (the first one's gradient is already accumulated: it must be
    # dropped), or before the side-by-side micro-batches
    at = {"rollout": 3, "train": 2 if workers == 1 else 1}[stop_at]

    def stop():
        polls[in_update[0]] += 1
        return polls[stop_at == "train"] == at

    tr.updater, tr.should_stop = updater, stop
    with pytest.raises(StepAbandoned):
        tr.step()
    assert polls[stop_at == "train"] == at
    assert tr.data.pos == pos and tr.iteration == 0 and tr.step_idx == 0
    assert all(torch.equal(a, b) for a, b in zip(before, adapters(tr)))
    assert all(p.grad is None for p in tr.policy.trainable)
    tr.should_stop, in_update[0] = (lambda: False), False
    got = tr.step()
    assert got["reward_mean"] == want["reward_mean"] and got["loss"] == want["loss"]
    assert all(torch.equal(a, b) for a, b in zip(adapters(ref), adapters(tr)))


def test_nan_loss_is_skipped(monkeypatch):
    import orbitrl.rl.update as U

    tr = make("reward.name=test_length")
    real = U.actor_loss

    def nan_loss(*a, **k):
        loss, *rest = real(*a, **k)
        return (loss * float("nan"), *rest)

    monkeypatch.setattr(U, "actor_loss", nan_loss)
    before = adapters(tr)
    row = tr.step()
    assert row["step_skipped"] == 1 and row["skipped_nonfinite"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, adapters(tr)))
    assert all(torch.isfinite(p).all() for p in tr.policy.trainable)


def test_stale_anchor_with_large_drift_is_refreshed():
    tr = make("reward.name=test_length", "algo.check=false", "algo.anchor_kl_threshold=0.001")
    with torch.no_grad():  # drift the policy far from the anchor
        for p in tr.policy.trainable:
            p.add_(torch.randn_like(p) * 3.0)
    row = tr.step()
    assert row["kl"] > tr.anchors.kl_threshold
    assert row["anchor_refresh"] == "kl_drift"
    assert tr.anchors.events[-1]["reason"] == "kl_drift"
    # the anchor is now the current policy: the KL measured next step is small again
    assert tr.step()["kl"] < row["kl"]


def test_full_parameter_mode_runs_with_fused_update():
    tr = make("reward.name=test_length", "train.mode=full", "train.optimizer=sgd",
              "train.lr=1e-3")
    before = [p.detach().clone() for p in tr.model.parameters()]
    row = tr.step()
    assert row["step_skipped"] == 0 and math.isfinite(row["grad_norm"])
    changed = sum(not torch.equal(a, b) for a, b in zip(before, tr.model.parameters()))
    assert changed > 0
    assert row["kl"] < 5e-2  # int8 host reference vs fp32 policy at step 0
    d = math.sqrt(sum(float((p.detach() - q).pow(2).sum())
                      for p, q in zip(tr.model.parameters(), before)))
    assert row["update_norm"] == pytest.approx(d, rel=1e-3)  # the fused step's own account
    assert 0 < row["update_rel"] < 1


def test_ppo_with_critic_trains_the_value_head():
    tr = make("reward.name=test_length", "algo.name=ppo")
    head = [p.detach().clone() for p in tr.critic.parameters()]
    row = tr.step()
    assert "value_loss" in row and math.isfinite(row["value_loss"])
    assert any(not torch.equal(a, b) for a, b in zip(head, tr.critic.parameters()))
    assert row["step_skipped"] == 0


@pytest.mark.parametrize("algo", ["rloo", "reinforce++"])
def test_other_estimators_run(algo):
    row = make("reward.name=test_length", f"algo.name={algo}").step()
    assert row["step_skipped"] == 0 and math.isfinite(row["grad_norm"])


def test_full_mode_spike_is_vetoed_before_any_update():
    tr = make("reward.name=test_length", "train.mode=full", "train.optimizer=sgd",
              "train.lr=1e-3")
    tr.step()
    tr.guard.mean, tr.guard.count = 1e-12, 100
    before = [p.detach().clone() for p in tr.model.parameters()]
    row = tr.step()
    assert row["step_skipped"] == 1 and row["skipped_spike"] == 1
    assert tr.opt.stats.vetoed == 1
    assert all(torch.equal(a, b) for a, b in zip(before, tr.model.parameters()))


@pytest.mark.parametrize("clip,passes", [("auto", 1), ("grouped", 1), ("global", 2)])
def test_full_mode_adalomo_clip_key(clip, passes):
    """Full mode's default optimizer is one-pass AdaLomo (grouped update normalization);
    train.clip=global switches to the exact two-pass global clip."""
    from orbitrl.train.optim import FusedAdaLomo

    tr = make("reward.name=test_length", "train.mode=full", "train.lr=1e-3",
              f"train.clip={clip}")
    assert isinstance(tr.opt, FusedAdaLomo) and tr.opt.two_pass == (passes == 2)
    before = [p.detach().clone() for p in tr.model.parameters()]
    row = tr.step()
    st = tr.opt.stats
    assert row["step_skipped"] == 0 and st.micro_steps > 0
    assert st.backward_passes == passes * st.micro_steps
    assert ("update_held" in row) == (passes == 1) and row.get("update_held", 0) == 0
    assert any(not torch.equal(a, b) for a, b in zip(before, tr.model.parameters()))


def test_full_mode_one_pass_spike_stops_the_update():
    """One pass: the heartbeat sees the norm so far after each tensor and stops there."""
    tr = make("reward.name=test_length", "train.mode=full", "train.lr=1e-3")
    tr.step()
    tr.guard.mean, tr.guard.count = 1e-12, 100
    before = [p.detach().clone() for p in tr.model.parameters()]
    row = tr.step()
    assert row["step_skipped"] == 1 and row["skipped_spike"] == 1 and tr.opt.stats.vetoed == 1
    assert row["update_held"] == len(before)  # stopped at the first tensor reached
    assert all(torch.equal(a, b) for a, b in zip(before, tr.model.parameters()))


@pytest.mark.parametrize("over", [["train.mode=full", "train.optimizer=sgd"],
                                  ["train.mode=adapter"]])
def test_grouped_clip_needs_adalomo(over):
    from orbitrl.errors import OrbitError

    with pytest.raises(OrbitError, match="train.clip"):
        load_config(None, over + ["train.clip=grouped"])


def test_watchdog_drops_a_rollout_past_its_limit_and_the_step_completes():
    tr = make("reward.name=test_length", "rollout.timeout_s=1e-9")
    row = tr.step()  # nothing can finish in a nanosecond: every group is dropped
    assert row["watchdog"] == 1 and row["groups_kept"] == 0 and row["step_skipped"] == 1
    tr.cfg.rollout.timeout_s = 300.0
    row = tr.step()  # the engine released everything: the next step runs normally
    assert row["watchdog"] == 0 and row["groups_kept"] == 2 and row["step_skipped"] == 0


def test_kv_budget_below_need_completes_through_preemption():
    tr = make("reward.name=test_length", "rollout.kv_budget_mb=0.05", "rollout.block_size=4")
    row = tr.step()
    assert row["step_skipped"] == 0 and row["groups_kept"] == 2
    assert tr.engine.summary()["preemptions"] > 0


def test_step_reports_mfu_waterfall_and_update_size():
    tr = make("reward.name=test_length")
    row = tr.step()
    assert 0 < row["mfu"] < 1
    parts = ["mfu_ideal_s"] + [k for k in row if k.startswith("mfu_lost_")]
    assert sum(row[k] for k in parts) >= 0.9 * (row["time_rollout_s"] + row["time_train_s"])
    assert row["update_norm"] > 0 and 0 < row["update_rel"] < 1


def test_tensorboard_asked_for_but_missing_is_one_line_error(tmp_path, monkeypatch):
    import builtins

    from orbitrl.errors import OrbitError
    from orbitrl.observe.metrics import ExternalWriters

    real = builtins.__import__

    def no_tb(name, *a, **k):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_tb)
    with pytest.raises(OrbitError, match="log.tensorboard"):
        ExternalWriters(tmp_path, tensorboard=True)


def test_overlapped_mode_is_exactly_one_step_off_policy():
    tr = make("reward.name=test_length", "rollout.overlap=true", "algo.check=false")
    try:
        rows = [tr.step() for _ in range(4)]
    finally:
        tr.close()
    assert all(r["step_skipped"] == 0 for r in rows)
    # step 0 and step 1 both sample the initial policy; from then on one step behind
    assert [r["staleness_max"] for r in rows] == [0, 1, 1, 1]
    assert [r["staleness_mean"] for r in rows] == [0, 1, 1, 1]
    assert all("time_wait_rollout_s" in r and r["time_rollout_s"] > 0 for r in rows)
    # the stale sampler shows up as the engine/trainer gap the importance weights correct
    assert rows[0]["logprob_mismatch_max"] < 1e-4 < rows[2]["logprob_mismatch_max"]


def test_overlap_needs_adapter_mode():
    from orbitrl.errors import OrbitError

    with pytest.raises(OrbitError, match="rollout.overlap"):
        make("rollout.overlap=true", "train.mode=full")


def test_kv_pool_sized_from_memory_left_after_training():
    tr = make("reward.name=test_length")  # rollout.kv_budget_mb: 0 (auto)
    plan = tr.kv_plan
    assert plan["train_need"] > 0 and plan["blocks"] == plan["cap"]  # plenty free here
    assert tr.engine.pool.num_blocks == plan["blocks"] and tr.engine.memory_hook is tr.governor
    row = tr.step()
    assert row["kv_blocks"] == plan["blocks"] and row["kv_throttle_events"] == 0


def test_kv_pool_that_cannot_fit_one_group_is_a_clear_error():
    from orbitrl.errors import OrbitError

    with pytest.raises(OrbitError, match="rollout.kv_budget_mb.*rollout.min_available_mb"):
        make("rollout.min_available_mb=1e9")


def test_memory_pressure_mid_run_throttles_the_pool_and_the_step_completes():
    tr = make("reward.name=test_length", "rollout.block_size=4")
    gov, bb = tr.governor, tr.engine.block_bytes
    calls = []

    def squeezed():  # a few blocks short of the floor from the third engine step on
        calls.append(1)
        return gov.min_available - (8 * bb if len(calls) >= 3 else -(1 << 30))

    gov.available_fn = squeezed
    before = tr.engine.pool.num_blocks
    row = tr.step()
    assert row["kv_throttle_events"] >= 1 and row["step_skipped"] == 0
    assert row["groups_kept"] == 2 and tr.engine.pool.num_blocks < before


def test_old_logprobs_from_the_update_forward_change_nothing(monkeypatch):
    """One epoch, AdamW: the update's own forward supplies the old-policy logprobs, one
    scoring pass fewer, and the run is bit for bit the one with the scoring pass."""
    import orbitrl.rl.score as S

    calls = []
    real_score = S.score
    monkeypatch.setattr(S, "score", lambda *a, **k: calls.append(1) or real_score(*a, **k))

    def run(reuse: bool):
        tr = make("reward.name=test_length", "algo.check=false")
        if not reuse:
            tr.scorer.old_from_update = lambda version, parts=1: False
        assert tr.scorer.old_from_update(tr.step_idx) is reuse
        calls.clear()
        rows = [tr.step() for _ in range(3)]
        return rows, adapters(tr), len(calls)

    rows_a, ad_a, n_a = run(True)
    rows_b, ad_b, n_b = run(False)
    assert n_b == 2 * n_a  # scoring passes: the reference only, against old + reference
    assert all(torch.equal(a, b) for a, b in zip(ad_a, ad_b))
    for ra, rb in zip(rows_a, rows_b):
        for k in ("reward_mean", "grad_norm", "kl", "entropy", "ratio_mean", "ratio_max",
                  "pg_loss", "logprob_mismatch_max", "logprob_mismatch_mean", "update_norm"):
            assert ra[k] == rb[k], k


@pytest.mark.parametrize("over", [["algo.epochs=2"], ["algo.kl_in_reward=true"],
                                  ["algo.name=ppo"]])
def test_old_logprobs_get_their_own_pass_when_the_update_cannot_give_them(over):
    tr = make("reward.name=test_length", "algo.check=false", *over)
    assert not tr.scorer.old_from_update(tr.step_idx)
    assert tr.step()["step_skipped"] == 0


def test_full_mode_reuses_the_forward_only_when_the_step_is_one_micro_batch(monkeypatch):
    """The fused update changes the weights during each backward: a step of one
    micro-batch has run its forward before any update (its old logprobs are that forward's,
    one scoring pass fewer, the same update bit for bit); a step of several needs the pass."""
    import orbitrl.rl.score as S

    calls = []
    real_score = S.score
    monkeypatch.setattr(S, "score", lambda *a, **k: calls.append(1) or real_score(*a, **k))

    def run(*over, reuse=True):
        tr = make("reward.name=test_length", "algo.check=false", "train.mode=full",
                  "algo.kl_coef=0", *over)
        assert tr.policy.reference is None  # no KL term: no int8 reference copy
        if not reuse:
            tr.scorer.old_from_update = lambda version, parts=1: False
        calls.clear()
        rows = [tr.step() for _ in range(2)]
        return rows, [p.detach().clone() for p in tr.model.parameters()], len(calls)

    rows_a, w_a, n_a = run()
    rows_b, w_b, n_b = run(reuse=False)
    assert n_a == 0 and n_b == 2  # no scoring pass at all against one per step
    assert all(torch.equal(a, b) for a, b in zip(w_a, w_b))
    for ra, rb in zip(rows_a, rows_b):
        for k in ("reward_mean", "grad_norm", "ratio_mean", "pg_loss"):
            assert ra[k] == rb[k], k
    # several micro-batches: the pass runs (a group's prompt is laid out once: 22 positions
    # per group of 4, so 24 positions hold one group)
    _, _, n_c = run("train.micro_batch_tokens=24")
    assert n_c >= 4  # (one call per micro-batch, two steps)
