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
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
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
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 143, out[-2000:]
    assert f"orbitrl train --resume {run}" in out
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert (run / "checkpoints" / latest / "state.pt").exists()


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
