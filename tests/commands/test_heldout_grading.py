"""Held-out accuracy is judged by a strict grader, never by the training reward alone: a
reward that scores every reply reads 1.0 beside an accuracy that stays what the model
answers, and the run warns by the reward's name; eval.every puts both into metrics.jsonl."""

import json

import pytest

from orbitrl.cli import main

FAST = ["--set", "rollout.prompts_per_step=2", "--set", "rollout.n=2",
        "--set", "rollout.max_tokens=5", "--set", "data.heldout_size=40",
        "--set", "log.progress=false", "--set", "model.base_dtype=int8",
        "--set", "checkpoint.every=1"]
FOOLED = "trainer_helpers:reward_anything"


@pytest.fixture(scope="module")
def fooled_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fooled")
    assert main(["train", *FAST, "--set", "train.max_steps=2", "--set", f"reward.name={FOOLED}",
                 "--set", "eval.grader=exact", "--set", "eval.every=1",
                 "--set", "eval.rows=8", "--out", str(out)]) == 0
    return out


def test_a_fooled_reward_is_not_the_accuracy(fooled_run, capsys):
    s = json.loads((fooled_run / "summary.json").read_text())
    assert s["heldout_grader"] == "exact"
    assert s["heldout_reward_before"] == s["heldout_reward_after"] == 1.0
    assert s["heldout_accuracy_after"] < 0.5  # the model's own exact answers
    assert FOOLED in s["reward_gap_warning"] and "exploiting" in s["reward_gap_warning"]


def test_eval_every_logs_accuracy_and_reward(fooled_run):
    rows = [json.loads(x) for x in (fooled_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["heldout_rows"] == 8 and r["heldout_reward"] == 1.0
        assert 0.0 <= r["heldout_accuracy"] < 0.5


def test_eval_rows_survive_resume(fooled_run):
    """Continuing the run keeps the earlier steps' in-run evaluations and adds its own."""
    assert main(["train", "--resume", str(fooled_run), "--set", "train.max_steps=3"]) == 0
    rows = [json.loads(x) for x in (fooled_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all("heldout_accuracy" in r for r in rows)


def test_max_seconds_stops_after_the_first_chunk(tmp_path):
    assert main(["train", *FAST, "--set", "train.max_steps=1", "--set", "eval.every=1",
                 "--set", "eval.max_seconds=1e-9", "--set", "checkpoint.every=0",
                 "--out", str(tmp_path)]) == 0
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert row["heldout_rows"] == 16  # one chunk of 40 rows, then the budget is spent


def test_eval_every_refused_beside_an_overlapped_rollout(tmp_path, capsys):
    assert main(["train", *FAST, "--set", "eval.every=1", "--set", "rollout.overlap=true",
                 "--out", str(tmp_path)]) != 0
    assert "eval.every" in capsys.readouterr().err


def test_eval_command_prints_grader_and_reward(tmp_path, capsys):
    """`orbitrl eval --grader`: the built-in model answers "46 ok" forms, which the answer
    grader accepts and exact_match (the reward) does not."""
    out = tmp_path / "e.json"
    assert main(["eval", "--limit", "20", "--grader", "answer", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["grader"] == "answer" and data["accuracy"] > data["reward_mean"]
    assert "grader answer, reward 'exact_match'" in capsys.readouterr().out
