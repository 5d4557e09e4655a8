"""The planner's per-step prediction from measured rates (observe/schedule.py), by hand."""

from __future__ import annotations

import pytest

from orbitrl.ledger.schedule import measured_split
from orbitrl.observe.schedule import StepPredictor

M = dict(engine_step_s=0.05, width=2.0, score_s=0.1, train_s=0.2, sync_s=0.0, other_s=0.05,
         gen_tokens=8, gen_tok_s=20.0)


def test_colocated_rollout_is_calibrated_on_the_measured_phase():
    p = StepPredictor("colocated", 1, 1, 1, slots=8)
    # two 4-token samples on 8 slots: a makespan of 4 iterations in 0.4 s -> 0.1 s each
    first = p((4, 4), rollout_s=0.4, **M)
    assert first["time_step_predicted_s"] == pytest.approx(0.4 + 0.1 + 0.2 + 0.05)
    # the next step's lengths at the previous steps' rates: 8 iterations
    nxt = p((8, 2), rollout_s=9.9, **M)
    assert nxt["time_rollout_predicted_s"] == pytest.approx(0.8)
    assert nxt["time_step_predicted_s"] == pytest.approx(0.8 + 0.35)


def test_separated_and_async_shapes():
    sep = StepPredictor("separated", 2, 1, 0, slots=8)
    out = sep((4, 4), rollout_s=0.4, **{**M, "sync_s": 0.01})
    assert out["time_step_predicted_s"] == pytest.approx(0.4 + 0.01 + 0.35)
    # async: throughput of the slots an engine step carried (width 2) at the engine's rate
    asy = StepPredictor("async", 2, 1, 2, slots=8)
    out = asy((4, 4), rollout_s=5.0, **{**M, "engine_step_s": 0.1})
    assert out["time_rollout_predicted_s"] == pytest.approx(8 * 0.1 / 2)
    assert out["time_step_predicted_s"] == pytest.approx(max(0.4, 0.35))


def test_balance_is_measured_split():
    p = StepPredictor("async", 2, 1, 2, slots=8, ranks=2, train_ranks=1)
    p((4, 4), rollout_s=1.0, **M)
    b = p.balance(8)
    assert (b["rollout"], b["train"]) == measured_split(8, 8, 20.0, 0.2)
    assert StepPredictor("async", 2, 1, 2, slots=8).balance(8) is None  # nothing measured
