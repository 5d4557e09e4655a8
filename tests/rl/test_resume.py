"""Checkpoint and resume: SIGKILL at any point, then --resume, ends bit for bit equal."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

SETS = ["train.max_steps=6", "rollout.prompts_per_step=2", "rollout.n=4",
        "rollout.max_tokens=5", "data.heldout_size=8", "log.progress=false",
        "model.base_dtype=int8", "checkpoint.every=1", "train.deterministic=true",
        "train.lr=1e-3"]


def cmd(*extra):
    out = [sys.executable, "-m", "orbitrl", "train"]
    for s in SETS:
        out += ["--set", s]
    return out + list(extra)


def steps_logged(run):
    f = run / "metrics.jsonl"
    return [json.loads(x)["step"] for x in f.read_text().splitlines()] if f.exists() else []


def final_state(run):
    return load_file(run / "checkpoints" / "final" / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("ref")
    subprocess.run(cmd("--out", str(run)), check=True, capture_output=True, timeout=600)
    return run


def kill_then_resume(run, kill_after_steps: int, *extra: str):
    """Start a run, SIGKILL it once ``kill_after_steps`` steps are logged, resume it."""
    p = subprocess.Popen(cmd("--out", str(run), *extra), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while len(steps_logged(run)) < kill_after_steps and time.time() < deadline \
            and p.poll() is None:
        time.sleep(0.05)
    # the kill must land on a live run that has not finished its steps
    assert p.poll() is None, f"the run exited ({p.returncode}) before it could be killed"
    assert kill_after_steps <= len(steps_logged(run)) < 6, steps_logged(run)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL
    r = subprocess.run(cmd("--resume", str(run)), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert steps_logged(run) == list(range(6))


@pytest.mark.parametrize("kill_after_steps", [1, 3])
def test_sigkill_then_resume_is_bit_exact(reference, tmp_path, kill_after_steps):
    run = tmp_path / "run"
    kill_then_resume(run, kill_after_steps)
    a, b = final_state(reference), final_state(run)
    assert a.keys() == b.keys()
    assert all(a[k].equal(b[k]) for k in a)
    s = json.loads((run / "summary.json").read_text())
    ref = json.loads((reference / "summary.json").read_text())
    assert s["heldout_accuracy_after"] == ref["heldout_accuracy_after"]


def test_sigterm_writes_checkpoint_and_exits(tmp_path):
    run = tmp_path / "run"
    p = subprocess.Popen(cmd("--out", str(run)) + ["--set", "checkpoint.every=0"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.time() + 300
    while len(steps_logged(run)) < 2 and time.time() < deadline:
        time.sleep(0.05)
    assert p.poll() is None
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 143, out[-2000:]
    assert f"orbitrl train --resume {run}" in out
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert (run / "checkpoints" / latest / "state.pt").exists()
    # the checkpoint is the state after the last logged step (a step in flight was
    # abandoned or finished, never half-applied)
    from orbitrl.rl.checkpoint import Checkpointer

    state = Checkpointer.load(run / "checkpoints" / latest)
    assert state["iteration"] == len(steps_logged(run)) >= 2


def test_torn_checkpoint_leaves_previous_intact(tmp_path):
    """A crash mid-write (a leftover .tmp dir) is ignored; latest still loads."""
    from orbitrl.rl.checkpoint import Checkpointer

    run = tmp_path / "run"
    subprocess.run(cmd("--out", str(run)) + ["--set", "train.max_steps=2"], check=True,
                   capture_output=True, timeout=600)
    ck = Checkpointer(run / "checkpoints")
    good = ck.latest()
    torn = run / "checkpoints" / "step-000099.tmp"
    torn.mkdir()
    (torn / "state.pt").write_bytes(b"\x00" * 100)
    assert ck.latest() == good
    assert Checkpointer.load(good)["iteration"] == 2


@pytest.fixture(scope="module")
def reference_overlapped(tmp_path_factory):
    run = tmp_path_factory.mktemp("ref-overlap")
    subprocess.run(cmd("--out", str(run), "--set", "rollout.overlap=true"), check=True,
                   capture_output=True, timeout=600)
    return run


def test_overlapped_sigkill_then_resume_is_bit_exact(reference_overlapped, tmp_path):
    """Overlapped, a rollout is in flight when the kill lands; the checkpoint holds the
    adapter snapshot it samples from, so the resumed run regenerates it identically."""
    run = tmp_path / "run"
    kill_then_resume(run, 3, "--set", "rollout.overlap=true")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["staleness_max"] for r in rows][2:] == [1] * 4
    a, b = final_state(reference_overlapped), final_state(run)
    assert all(a[k].equal(b[k]) for k in a)


def test_progress_under_a_time_budget_counts_time_and_shows_what_is_left():
    """With train.max_seconds the bar fills with the nearer limit and shows the time left;
    the step count goes in the postfix (a 100000-step bar at 0% said nothing)."""
    import io

    from orbitrl.rl.run import Progress

    bar = Progress(100000, 60.0, 0, disable=False)
    bar.bar.fp = io.StringIO()
    bar.t0 -= 15.0  # a quarter of the budget spent
    bar.update(3, reward="0.5")
    line = str(bar.bar)
    assert "25%" in line and "step=3/100000" in line and "<" in line and "?" not in line
    assert bar.bar.total == Progress.SCALE
    steps = Progress(10, 0.0, 2, disable=False)  # no budget: steps against max_steps
    steps.bar.fp = io.StringIO()
    steps.update(5)
    assert steps.bar.n == 5 and steps.bar.total == 10
