"""The MFU waterfall against hand-computed numbers."""

import pytest

from orbitrl.observe.flops import measure_peak_flops, waterfall


def test_waterfall_hand_computed():
    # 1e6 params, peak 1e9 FLOP/s; rollout: 100 tokens (2e8 FLOPs = 0.2 s ideal) over 4
    # engine steps, widest 8 sequences: the 2 steps with < 4 sequences are the tail (0.3 s)
    timeline = [(8, 50, 0.4), (6, 30, 0.3), (2, 15, 0.2), (1, 5, 0.1)]
    sec = {"rollout": 1.0, "reward": 0.1, "score": 0.5, "train": 1.5}
    w = waterfall(10**6, 1e9, 100, timeline, 100, 2, 100, True, sec, 3.5)
    # useful = 2e8 + 2*1e6*100*2 (4e8) + 4*1e6*100 (4e8) = 1e9 FLOPs -> 1 s ideal of 3.5 s
    assert w["mfu"] == pytest.approx(1 / 3.5)
    assert w["mfu_ideal_s"] == pytest.approx(1.0)
    assert w["mfu_lost_long_tail_s"] == pytest.approx(0.3)
    assert w["mfu_lost_decode_s"] == pytest.approx(1.0 - 0.3 - 0.2)
    assert w["mfu_lost_score_s"] == pytest.approx(0.5 - 0.4)
    assert w["mfu_lost_train_s"] == pytest.approx(1.5 - 0.4)
    assert w["mfu_lost_idle_s"] == pytest.approx(3.5 - 3.1 + 0.1)
    parts = [w[k] for k in w if k.startswith("mfu_lost") or k == "mfu_ideal_s"]
    assert sum(parts) == pytest.approx(3.5)  # the waterfall adds up to the step


def test_peak_flops_is_positive():
    assert measure_peak_flops(64, 2) > 0
