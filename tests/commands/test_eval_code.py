"""The code task end to end on the built-in model: `orbitrl train` (two steps) and
`orbitrl eval` run, and the sandbox's counts reach metrics.jsonl. The tiny arithmetic model
does not solve the problems; only the path is checked
(tests/rl/test_code_learning.py shows the task learning)."""

import json

import pytest

from orbitrl.cli import main

# the built-in model's context is 64 tokens: the terse statements (data.prompt_field=short)
TINY = ["--set", "data.task=code", "--set", "data.prompt_field=short",
        "--set", "reward.name=code", "--set", "train.max_steps=2",
        "--set", "rollout.prompts_per_step=2", "--set", "rollout.n=2",
        "--set", "rollout.max_tokens=12", "--set", "data.heldout_size=2",
        "--set", "log.progress=false", "--set", "model.base_dtype=int8",
        "--set", "checkpoint.every=0", "--set", "reward.sandbox.time_limit_s=2"]


pytestmark = pytest.mark.usefixtures("needs_sandbox")


def test_train_on_code_task(tmp_path):
    assert main(["train", *TINY, "--out", str(tmp_path)]) == 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["reward_code_tests"] > 0
        for k in ("pass_rate", "passed", "time_limits", "memory_kills", "sandbox_errors",
                  "deadline_kills", "runtime_errors", "wrong"):
            assert f"reward_code_{k}" in r, k
        assert r["reward_code_sandbox_errors"] == 0 and r["reward_code_errors"] == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert 0.0 <= summary["heldout_accuracy_after"] <= 1.0


def test_eval_on_code_task(tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["eval", "--task", "code", "--prompt-field", "short", "--limit", "2",
                 "--max-tokens", "8",
                 "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["n"] == 2 and 0.0 <= data["accuracy"] <= 1.0
    assert "task code" in capsys.readouterr().out
