"""Schedule simulator properties: the long tail, pool shapes, staleness, async's costs, and
the source material's 64-card measurements."""

import doctest
import math
from dataclasses import replace

import pytest

from orbitrl.ledger import schedule
from orbitrl.ledger.schedule import (LengthDist, StepWork, balance_ratio, compare, measured_split,
                                      rollout_makespan, simulate)


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


# --- first-come-first-served admission, the source material's table, async's costs ---------

# The third article's 64-card phases (seconds) and what it measures per shape.
ARTICLE = {"generation": 602.0, "tail": 196.0, "score": 72.0, "train": 136.0}
ARTICLE_STEPS = {"colocated": 810.0, "separated": 1501.0, "one_step": 764.0, "async": 619.0}
ARTICLE_GAIN = {0.1: 1.07, 0.7: 2.55}  # colocated / async by tail share of generation


def article_work(tail_share_of_generation: float | None = None) -> StepWork:
    """The article's phases; with a tail share, its curve: the body, scoring and training
    fixed, the tail = body x share / (1 - share)."""
    a = ARTICLE
    if tail_share_of_generation is None:
        return StepWork.from_phases(a["generation"], a["tail"], a["score"], a["train"], 64)
    body = a["generation"] - a["tail"]
    gen = body / (1 - tail_share_of_generation)
    return StepWork.from_phases(gen, gen - body, a["score"], a["train"], 64)


def test_arrival_order_runs_the_tail_after_the_body():
    xs = [2, 2, 2, 2, 10]  # by hand: two slots take 2+2 each, the long answer starts at 4
    assert rollout_makespan(xs, 2, "arrival") == 14
    assert rollout_makespan(xs, 2) == rollout_makespan(xs, 2, "longest_first") == 10
    assert rollout_makespan(xs, 8, "arrival") == 10  # one wave: everyone starts at once
    with pytest.raises(ValueError):
        rollout_makespan(xs, 2, "random")


def test_from_phases_reproduces_the_colocated_phases():
    w = article_work()
    c = simulate("colocated", w, 64)
    assert c.rollout_s == pytest.approx(602.0, rel=2e-3) and c.step_s == pytest.approx(810.0, rel=2e-3)
    ordinary = [x for x in w.lengths if x < max(w.lengths)]
    body = rollout_makespan(ordinary, 64 * w.slots_per_device, "arrival") * w.decode_step_s
    assert c.rollout_s - body == pytest.approx(196.0, rel=0.01)  # the tail runs alone after it
    # the body is throughput, the tail latency: on half the devices the body doubles (all but
    # its last partial wave, 3% short of the article's 2 x 406), the tail stays
    half = rollout_makespan(w.lengths, 32 * w.slots_per_device, "arrival") * w.decode_step_s
    assert 0.95 * (2 * 406 + 196) < half < 2 * 406 + 196


def test_the_articles_step_times():
    t = compare(article_work(), 64, staleness=8)
    one = t["one_step"]
    sep_on_one_step_pools = simulate("separated", article_work(), 64, one.rollout_devices)
    print("\nshape       article  simulated  error   devices r/t")
    for s, ref in ARTICLE_STEPS.items():
        x = t[s]
        print(f"{s:10s} {ref:8.0f} {x.step_s:10.0f} {100 * (x.step_s / ref - 1):+6.1f}%   "
              f"{x.rollout_devices}/{x.train_devices}")
    print(f"separated on the one_step pools: {sep_on_one_step_pools.step_s:.0f}")
    for s, ref in ARTICLE_STEPS.items():
        assert t[s].step_s == pytest.approx(ref, rel=0.15), s
    assert sep_on_one_step_pools.step_s == pytest.approx(ARTICLE_STEPS["separated"], rel=0.05)
    a = t["async"]
    assert a.reprefill_s > 0 and a.wait_s == 0 and a.proximal_s == 0 and a.staleness <= 8


def test_the_articles_tail_curve():
    gains = {}
    for share in (0.1, 0.3, 0.5, 0.7):
        t = compare(article_work(share), 64, staleness=8)
        gains[share] = t["colocated"].step_s / t["async"].step_s
    print("\ntail share -> async gain:", {k: round(v, 2) for k, v in gains.items()})
    for share, ref in ARTICLE_GAIN.items():
        assert gains[share] == pytest.approx(ref, rel=0.20), share
    xs = list(gains.values())
    assert all(b > a for a, b in zip(xs, xs[1:]))


def test_reprefill_is_littles_law_over_the_contexts_in_flight():
    # 64 sequences of 100 tokens, prompts of 20, one slot each on 4 rollout devices
    w = StepWork((100,) * 64, 16, 0.01, 0.0, 300.0, prompt_len=20, forward_device_s=60.0)
    a = simulate("async", w, 8, rollout_devices=4)
    train = 300.0 / 4
    thru = 64 * 100 * 0.01 / 64
    assert a.train_s == pytest.approx(train) and a.step_s == pytest.approx(train)
    # in flight: 64 x 1 s / 75 s sequences, each a 20-token prompt and 50 tokens done
    tokens = 64 * 1.0 / train * (20 + 50)
    per_token = 60.0 / (64 * 120)
    assert a.reprefill_s == pytest.approx(tokens * per_token / 4)
    assert a.rollout_s == pytest.approx(thru + a.reprefill_s)
    keep = simulate("async", w, 8, rollout_devices=4, partial="keep_kv")
    assert keep.reprefill_s == 0 and keep.rollout_s == pytest.approx(thru)


def test_reprefill_fixed_point_when_rollout_bounds_the_step():
    w = StepWork((1000,) * 64, 1, 0.01, 0.0, 10.0, forward_device_s=50.0)
    a = simulate("async", w, 8, rollout_devices=4)
    # step = thru + b / step, b = dt x sum(l^2/2) x per_token / Dr
    thru = 64 * 1000 * 0.01 / 4
    b = 0.01 * 64 * 1000 ** 2 / 2 * (50.0 / (64 * 1000)) / 4
    assert a.step_s == pytest.approx((thru + math.sqrt(thru ** 2 + 4 * b)) / 2)


def test_proximal_pass_costs_a_forward_unless_scoring_recomputes():
    base = StepWork((100,) * 64, 16, 0.01, 40.0, 300.0)
    own = simulate("async", base, 8, rollout_devices=2)
    extra = simulate("async", replace(base, scoring_recomputes=False), 8, rollout_devices=2)
    assert own.proximal_s == 0 and extra.proximal_s == pytest.approx(100.0 / 6)
    assert extra.train_s == pytest.approx(own.train_s + 100.0 / 6)


def test_staleness_bound_waits_or_drops():
    xs = tuple([100] * 63 + [5000])  # one answer 50x the rest
    w = StepWork(xs, 64, 0.01, 0.0, 80.0)
    wait = simulate("async", w, 4, rollout_devices=2, staleness=1)
    assert wait.step_s == pytest.approx(50.0) and wait.wait_s > 0 and wait.dropped_share == 0
    drop = simulate("async", w, 4, rollout_devices=2, staleness=1, overflow="drop")
    assert drop.dropped_share == pytest.approx(1 / 64) and drop.wait_s == 0
    assert drop.step_s < wait.step_s and drop.staleness == 1
    loose = simulate("async", w, 4, rollout_devices=2, staleness=8)
    assert loose.wait_s == 0 and loose.step_s == pytest.approx(40.0)
    with pytest.raises(ValueError):
        simulate("async", w, 4, overflow="never")


def test_measured_split_balances_measured_rates():
    assert measured_split(8, 512 * 1024, 2000.0, 131.0) == (5, 3)
    # generation 100 rank-s, training 100 rank-s: an even split; a tie goes to fewer rollout ranks
    assert measured_split(4, 1000, 10.0, 100.0) == (2, 2)
    assert measured_split(3, 1000, 10.0, 100.0) == (1, 2)
    assert measured_split(2, 1e9, 1.0, 1.0) == (1, 1)
    assert balance_ratio(ranks=8, tokens_per_step=512 * 1024, gen_tokens_per_s=2000.0,
                         train_rank_s=131.0) == (5, 3)
    assert balance_ratio({}) is None
    with pytest.raises(ValueError):
        measured_split(1, 1000, 10.0, 100.0)
    with pytest.raises(ValueError):
        measured_split(4, 1000, 0.0, 100.0)
    failures, _ = doctest.testmod(schedule)
    assert failures == 0
