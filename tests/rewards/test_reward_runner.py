"""RewardRunner fault isolation: raising, hanging, non-numeric and NaN rewards."""

import math
import threading

import pytest

from orbitrl.rewards import RewardRunner, RewardSource

PROMPTS = ["1+1=", "2+2=", "3+3="]
COMPLETIONS = ["2", "5", "<answer>6</answer>"]
FIELDS = [{"answer": 2}, {"answer": 4}, {"answer": "<answer>6</answer>"}]


def test_weighted_sources_and_metrics():
    runner = RewardRunner([RewardSource("exact_match"), RewardSource("format", weight=0.5)])
    res = runner(PROMPTS, COMPLETIONS, FIELDS)
    assert res.per_source == {"exact_match": [1.0, 0.0, 1.0], "format": [0.0, 0.0, 1.0]}
    assert res.rewards == [1.0, 0.0, 1.5]
    assert res.metrics["reward_mean"] == pytest.approx(2.5 / 3)
    assert res.metrics["reward_exact_match_mean"] == pytest.approx(2 / 3)
    assert res.errors == [] and res.metrics["reward_errors_total"] == 0.0


def test_faults_are_scored_zero_and_counted():
    release = threading.Event()
    hung_returned = threading.Event()

    def raises(prompt, completion, **f):
        raise RuntimeError("verifier crashed")

    def hangs(prompt, completion, **f):
        if completion == "5":
            release.wait(30)  # a hung verifier; released at the end of the test
            hung_returned.set()
        return 1.0

    def bad_type(prompt, completion, **f):
        return "1.0" if completion == "2" else float("nan") if completion == "5" else 1

    runner = RewardRunner([RewardSource("exact_match"), RewardSource(raises, weight=2.0),
                           RewardSource(hangs), RewardSource(bad_type)],
                          timeout_s=0.2, max_workers=2)
    try:
        res = runner(PROMPTS, COMPLETIONS, FIELDS)
        # the batch came back while the hung verifier was still blocked: no wall-clock
        # figure needed to show the runner did not wait for it
        still_hung = not hung_returned.is_set()
    finally:
        release.set()
    assert still_hung
    assert res.per_source["raises"] == [0.0, 0.0, 0.0]
    assert res.per_source["hangs"] == [1.0, 0.0, 1.0]
    assert res.per_source["bad_type"] == [0.0, 0.0, 1.0]
    assert res.rewards == [2.0, 0.0, 3.0]  # exact_match + hangs + bad_type
    assert all(math.isfinite(r) for r in res.rewards)
    kinds = {(e.index, e.source): e.kind for e in res.errors}
    assert kinds == {(0, "raises"): "exception", (1, "raises"): "exception",
                     (2, "raises"): "exception", (1, "hangs"): "timeout",
                     (0, "bad_type"): "non_numeric", (1, "bad_type"): "non_finite"}
    assert "verifier crashed" in next(e.reason for e in res.errors if e.source == "raises")
    m = res.metrics
    assert (m["reward_raises_errors"], m["reward_raises_timeouts"]) == (3.0, 0.0)
    assert (m["reward_hangs_errors"], m["reward_hangs_timeouts"]) == (0.0, 1.0)
    assert (m["reward_bad_type_errors"], m["reward_exact_match_errors"]) == (2.0, 0.0)
    assert (m["reward_errors_total"], m["reward_timeouts_total"]) == (5.0, 1.0)
    assert runner.leaked_threads == 1
    # the stuck worker was replaced: the next batch still scores every call
    assert runner(PROMPTS, COMPLETIONS, FIELDS).per_source["hangs"][0] == 1.0


def test_workers_are_reused_across_batches():
    """Calls run on at most max_workers persistent threads, not one thread per call."""
    seen = set()

    def who(prompt, completion, **f):
        seen.add(threading.current_thread())  # (idents are reused, objects are not)
        return 1.0

    runner = RewardRunner([RewardSource(who)], timeout_s=5.0, max_workers=2)
    before = threading.active_count()
    for _ in range(3):
        assert runner(PROMPTS * 4, COMPLETIONS * 4, FIELDS * 4).rewards == [1.0] * 12
    assert len(seen) <= 2 and threading.current_thread() not in seen
    assert threading.active_count() - before <= 2


def test_inline_mode_and_kwargs():
    runner = RewardRunner([RewardSource("format", kwargs={"format_pattern": r"^\d$"})],
                          timeout_s=None)
    res = runner(PROMPTS, COMPLETIONS, FIELDS)
    assert res.rewards == [1.0, 1.0, 0.0]


def test_missing_answer_is_an_error_not_a_zero():
    res = RewardRunner(["exact_match"])(["q"], ["2"], [{"question": "q"}])
    assert res.rewards == [0.0]
    assert res.errors[0].kind == "exception" and "answer" in res.errors[0].reason
    assert res.metrics["reward_exact_match_errors"] == 1.0
