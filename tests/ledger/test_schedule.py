"""Schedule simulator properties: the long tail, pool shapes, staleness."""

import pytest

from orbitrl.ledger.schedule import LengthDist, StepWork, compare, rollout_makespan, simulate


def work(tail_fraction: float, sync_s: float = 1.0) -> StepWork:
    lengths = LengthDist(512, 1000, tail_fraction).lengths()
    return StepWork(tuple(lengths), slots_per_device=8, decode_step_s=0.01,
                    score_device_s=200.0, train_device_s=1600.0, sync_s=sync_s)


def test_lengths_and_tail():
    d = LengthDist(100, 1000, 0.75)
    xs = d.lengths()
    assert len(xs) == 100 and max(xs) == 4000 and sum(x == 4000 for x in xs) == 2
    assert max(LengthDist(100, 1000, 0.0).lengths()) == 1000
    assert LengthDist(10, 1000, 0.9, cap=2000).tail_len == 2000
    with pytest.raises(ValueError):
        LengthDist(10, 100, 1.0)


def test_more_devices_do_not_shorten_the_tail():
    xs = LengthDist(512, 1000, 0.8).lengths()
    assert rollout_makespan(xs, 64) > rollout_makespan(xs, 512) == rollout_makespan(xs, 4096) == 5000


def test_separated_slower_than_colocated_with_long_tail():
    t = compare(work(0.8), devices=64)
    assert t["separated"].step_s > t["colocated"].step_s


def test_async_faster_than_both():
    for f in (0.5, 0.8):
        t = compare(work(f), devices=64)
        assert t["async"].step_s < t["colocated"].step_s
        assert t["async"].step_s < t["separated"].step_s
        assert t["async"].staleness >= 1 and t["colocated"].staleness == 0


def test_async_advantage_grows_with_tail_fraction():
    gains = []
    for f in (0.0, 0.3, 0.6, 0.8, 0.9):
        t = compare(work(f), devices=64)
        gains.append(t["colocated"].step_s / t["async"].step_s)
    assert all(b > a for a, b in zip(gains, gains[1:])), gains


def test_utilisation_drops_with_tail_in_synchronous_shapes():
    lo = simulate("colocated", work(0.0), 64).utilisation
    hi = simulate("colocated", work(0.9), 64).utilisation
    assert 0 < hi < lo <= 1


def test_bad_shape():
    with pytest.raises(ValueError):
        simulate("nope", work(0.5), 8)
