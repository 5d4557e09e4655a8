"""Environment calls on a persistent worker pool: workers reused across batches, a batch's
calls all run without the caller polling between them, a hung call times out and its
worker is replaced, a cancelled batch's queued calls never run."""

import threading
import time

from orbitrl.envs.calls import EnvCalls


def _drain(calls: EnvCalls, limit_s: float = 10.0) -> list:
    out, t0 = [], time.monotonic()
    while calls.pending and time.monotonic() - t0 < limit_s:
        out += calls.poll(wait_s=0.05)
    return out


def test_workers_are_reused_across_batches():
    calls = EnvCalls(time_limit_s=5.0, workers=3)
    seen = set()

    def who(i):
        seen.add(threading.current_thread())  # objects kept: no reuse of ids
        return i

    for batch in range(3):
        for i in range(20):
            calls.submit(("step", i), who, i)
        got = _drain(calls)
        assert sorted(r.value for r in got) == list(range(20))
        assert not any(r.error for r in got)
        calls.cancel_all()
    assert len(seen) <= 3 and calls.leaked == 0


def test_a_batch_runs_through_without_polling():
    """A worker that finishes a call takes the next at once: all 64 calls of a turn run
    while the caller is busy elsewhere (the engine decoding), not ``workers`` per poll."""
    calls = EnvCalls(time_limit_s=5.0, workers=4)
    ran, lock, all_ran = [0], threading.Lock(), threading.Event()

    def count(i):
        with lock:
            ran[0] += 1
            if ran[0] == 64:
                all_ran.set()
        return i

    for i in range(64):
        calls.submit(("step", i), count, i)
    assert all_ran.wait(10.0), f"only {ran[0]} of 64 calls ran without a poll"
    assert len(_drain(calls)) == 64


def test_hung_call_times_out_and_its_worker_is_replaced():
    calls = EnvCalls(time_limit_s=0.3, workers=2)
    release = threading.Event()
    calls.submit(("step", "hung"), release.wait)
    for i in range(6):
        calls.submit(("step", i), lambda i=i: i)
    got = {r.key[1]: r for r in _drain(calls)}
    release.set()
    assert got["hung"].error == "timeout" and calls.leaked == 1
    assert all(got[i].value == i and not got[i].error for i in range(6))
    calls.submit(("step", "after"), lambda: "ok")  # the pool still serves
    assert [r.value for r in _drain(calls)] == ["ok"]


def test_cancelled_batch_queued_calls_never_run():
    calls = EnvCalls(time_limit_s=5.0, workers=1)
    release, ran = threading.Event(), []
    calls.submit(("step", 0), release.wait)
    for i in range(1, 4):
        calls.submit(("step", i), ran.append, i)
    time.sleep(0.05)
    calls.cancel_all()  # the running call is abandoned, the queued ones skipped
    assert calls.pending == 0 and calls.leaked == 1
    calls.submit(("step", "next"), lambda: "ok")
    assert [r.value for r in _drain(calls)] == ["ok"]
    release.set()
    time.sleep(0.1)
    assert ran == [] and calls.poll() == []  # late results of the old batch are dropped
