"""A rank that dies mid-run makes the other exit with a clear one-line error within the
configured timeout, and the last complete checkpoint still resumes."""

from __future__ import annotations

import signal
import time

import pytest

from dist_helpers import TIMEOUT_S, rank_env, train, train_args

import launch


@pytest.mark.parametrize("sig,timeout", [(signal.SIGKILL, 20), (signal.SIGSTOP, 5)])
def test_lost_rank_fails_the_others_and_keeps_the_checkpoint(tiny_llama, tmp_path, sig,
                                                             timeout):
    """SIGKILL: rank 1 is gone (its connections close); SIGSTOP: rank 1 hangs, and the
    collective rank 0 waits in must give up after ``dist.timeout_s``."""
    run = tmp_path / "run"
    args = train_args(tiny_llama, "full", 200, "checkpoint.every=1", f"dist.timeout_s={timeout}")
    procs = launch.start(launch.orbitrl_argv(*args, "--out", str(run)), 2, env=rank_env())
    latest = run / "checkpoints" / "latest"
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not (latest.exists() and latest.read_text().strip() >= "step-000002"):
            assert all(p.poll() is None for p in procs), "a rank exited before the kill"
            assert time.monotonic() < deadline, "no checkpoint written"
            time.sleep(0.05)
        launch.kill(procs[1], sig)  # wherever rank 1 is in its step
        t_kill = time.monotonic()
        while procs[0].poll() is None:  # rank 0 must give up: the timeout plus slack
            assert time.monotonic() - t_kill < timeout + 60, "rank 0 still waiting"
            time.sleep(0.05)
        waited = time.monotonic() - t_kill
        launch.kill(procs[1])  # a stopped rank is killed here
        res = launch.wait(procs, 30)
    finally:
        for p in procs:
            launch.kill(p)
    r0 = res[0]
    assert r0.returncode == 2, r0.stderr[-2000:]
    line = [x for x in r0.stderr.splitlines() if x.startswith("orbitrl train: error:")]
    assert line and "rank 0/2: lost another rank mid-step" in line[0], r0.stderr[-2000:]
    assert "--resume" in line[0]
    print(f"rank 0 exited {waited:.1f} s after {sig.name} to rank 1: {line[0][:200]}")
    # the checkpoint the pointer names is complete and resumes (here on one process)
    step = int(latest.read_text().strip().split("-")[1])
    assert (run / "checkpoints" / f"step-{step:06d}" / ".metadata").exists()
    if sig == signal.SIGKILL:  # (the same check for both signals would only cost time)
        train(train_args(tiny_llama, "full", step + 1), 1, run, resume=True)
        assert (run / "summary.json").exists()


def test_sigterm_stops_every_rank_after_the_same_step(tiny_llama, tmp_path):
    """torchrun forwards SIGTERM to every rank; they agree on the step to stop after,
    write one sharded checkpoint together and exit 143."""
    run = tmp_path / "run"
    procs = launch.start(launch.orbitrl_argv(*train_args(tiny_llama, "full", 500), "--out",
                                             str(run)), 2, env=rank_env())
    rows = run / "metrics.jsonl"
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not (rows.exists() and len(rows.read_text().splitlines()) >= 2):
            assert all(p.poll() is None for p in procs), "a rank exited early"
            assert time.monotonic() < deadline, "no step logged"
            time.sleep(0.05)
        for p in procs:
            p.send_signal(signal.SIGTERM)
        res = launch.wait(procs, 120)
    finally:
        for p in procs:
            launch.kill(p)
    assert [r.returncode for r in res] == [143, 143], [r.stderr[-1500:] for r in res]
    steps = len(rows.read_text().splitlines())
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step-{steps:06d}"
    assert (run / "checkpoints" / latest / ".metadata").exists()
