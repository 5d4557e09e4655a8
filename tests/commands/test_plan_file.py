"""Plans that execute: `orbitrl plan --out` writes a plan file, `orbitrl train --plan` runs it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orbitrl.cli import main

MODEL = ["--model", "builtin:tiny-arith", "--device-memory-gb", "1", "--prompt-len", "32"]
FAST = ["--set", "train.max_steps=2", "--set", "rollout.prompts_per_step=2", "--set", "rollout.n=4",
        "--set", "data.heldout_size=8", "--set", "log.progress=false"]


def write_plan(tmp_path, *extra, name="plan.json") -> tuple[Path, dict]:
    out = tmp_path / name
    assert main(["plan", *MODEL, *extra, "--out", str(out)]) == 0
    return out, json.loads(out.read_text())


def one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_plan_out_adapter(tmp_path, capsys):
    path, doc = write_plan(tmp_path, "--devices", "1", "--strategy", "adapter", "--base-dtype",
                           "nf4", "--adapter-rank", "8", "--recompute", "off",
                           "--completion-len", "4")
    capsys.readouterr()
    assert doc["format"] == "orbitrl-plan" and doc["version"] == 1 and doc["devices"] == 1
    assert {r["role"] for r in doc["roles"]} >= {"actor", "reference", "reward"}
    assert doc["settings"] == {"model.path": "builtin:tiny-arith", "train.mode": "adapter",
                               "train.optimizer": "adamw", "model.base_dtype": "nf4",
                               "lora.rank": 8, "train.recompute": False,
                               "rollout.max_tokens": 4, "schedule.shape": "colocated"}
    pred = doc["predicted"]
    assert pred["peak_bytes_per_device"] > 0 and pred["step_s"] > 0
    assert pred["role_bytes"]["actor"] > 0
    # atomic: nothing but the file itself is left beside it
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_plan_out_stateless_critic_separated(tmp_path, capsys):
    _, doc = write_plan(tmp_path, "--devices", "2", "--strategy", "stateless", "--critic",
                        "--schedule", "separated")
    s = doc["settings"]
    assert s["train.mode"] == "full" and s["train.optimizer"] == "adalomo"
    assert s["algo.name"] == "ppo" and s["critic.kind"] == "model"
    assert s["schedule.shape"] == "separated" and s["schedule.rollout_ranks"] == 1
    assert "lora.rank" not in s and "model.base_dtype" not in s
    assert "critic" in {r["role"] for r in doc["roles"]}
    assert doc["predicted"]["step_s"] == pytest.approx(
        json.loads(_plan_json(capsys, "--devices", "2", "--strategy", "stateless", "--critic"))
        ["schedule"]["shapes"]["separated"]["step_s"])


def _plan_json(capsys, *extra) -> str:
    capsys.readouterr()
    assert main(["plan", *MODEL, *extra, "--json"]) == 0
    return capsys.readouterr().out


def test_plan_out_replaces_an_existing_file(tmp_path):
    (tmp_path / "plan.json").write_text("old")
    _, doc = write_plan(tmp_path, "--devices", "1")
    assert doc["format"] == "orbitrl-plan"


def test_schedule_needs_two_devices(tmp_path, capsys):
    err = one_line_error(capsys, ["plan", *MODEL, "--devices", "1", "--schedule", "async",
                                  "--out", str(tmp_path / "p.json")])
    assert "--schedule" in err
    assert not (tmp_path / "p.json").exists()


def test_train_runs_the_plan(tmp_path, capsys):
    plan, doc = write_plan(tmp_path, "--devices", "1", "--strategy", "adapter", "--base-dtype",
                           "int8", "--adapter-rank", "4", "--recompute", "off",
                           "--completion-len", "4")
    run = tmp_path / "run"
    # an explicit --set still overrides the plan's key
    assert main(["train", "--plan", str(plan), *FAST, "--set", "lora.rank=6",
                 "--out", str(run)]) == 0
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["train"]["mode"] == "adapter" and cfg["train"]["optimizer"] == "adamw"
    assert cfg["model"]["base_dtype"] == "int8" and cfg["train"]["recompute"] is False
    assert cfg["rollout"]["max_tokens"] == 4 and cfg["schedule"]["shape"] == "colocated"
    assert cfg["lora"]["rank"] == 6
    s = json.loads((run / "summary.json").read_text())["plan"]
    assert s["file"] == str(plan) and s["devices"] == 1
    peak, step = s["peak_bytes_per_device"], s["step_s"]
    assert peak["predicted"] == doc["predicted"]["peak_bytes_per_device"]
    assert peak["measured"] > 0 and peak["ratio"] == pytest.approx(
        peak["measured"] / peak["predicted"])
    assert step["predicted"] == doc["predicted"]["step_s"] and step["steps"] == 2
    assert step["measured"] > 0 and step["ratio"] == pytest.approx(
        step["measured"] / step["predicted"])
    # per role: the plan's bytes beside what the role held; the actor's weights and AdamW
    # moments, the engine's KV pool (an adapter run has no reference copy of its own)
    roles = s["role_bytes"]
    whole = json.loads((run / "summary.json").read_text())["role_bytes"]
    assert roles["actor"]["measured"] == whole["actor"] > 0
    assert roles["rollout_kv"]["measured"] == whole["rollout_kv"] > 0
    assert whole["reference"] == 0 and whole["critic"] == 0
    assert roles["actor"]["predicted"] == doc["predicted"]["role_bytes"]["actor"]
    out = capsys.readouterr().out
    assert "plan step time (planned -> measured)" in out


def _plan_doc(**over) -> dict:
    doc = {"format": "orbitrl-plan", "version": 1, "devices": 1, "roles": [],
           "settings": {"train.mode": "full"}, "predicted": {}}
    doc.update(over)
    return doc


@pytest.mark.parametrize("content, words", [
    ("{not json", ["not JSON"]),
    (json.dumps(_plan_doc(format="something")), ["not an orbitrl plan"]),
    (json.dumps(_plan_doc(version=7)), ["version 7"]),
    (json.dumps(_plan_doc(settings={"train.nonsense": 1})), ["'train.nonsense'", "not a config key"]),
    (json.dumps(_plan_doc(settings={"train": 1})), ["'train'", "not a config key"]),
    (json.dumps(_plan_doc(settings={"train.mode": "sideways"})), ["settings", "train.mode"]),
    (json.dumps(_plan_doc(devices=2)), ["2 devices", "has 1"]),
])
def test_bad_plans_one_line(tmp_path, capsys, content, words):
    p = tmp_path / "plan.json"
    p.write_text(content)
    err = one_line_error(capsys, ["train", "--plan", str(p), "--out", str(tmp_path / "run")])
    assert str(p) in err
    for w in words:
        assert w in err, err
    assert not (tmp_path / "run").exists()


def test_missing_plan_file(tmp_path, capsys):
    p = tmp_path / "nope.json"
    err = one_line_error(capsys, ["train", "--plan", str(p)])
    assert str(p) in err and "cannot read" in err


def test_two_device_plan_refused_on_one_process(tmp_path, capsys):
    plan, _ = write_plan(tmp_path, "--devices", "2", "--schedule", "separated")
    capsys.readouterr()
    err = one_line_error(capsys, ["train", "--plan", str(plan), *FAST])
    assert "for 2 devices" in err and "has 1" in err


def test_world_size_from_the_launch(tmp_path):
    """The launch's size is torchrun's WORLD_SIZE (refused before any process group starts)."""
    plan, _ = write_plan(tmp_path, "--devices", "2", "--schedule", "separated")
    env = dict(os.environ, WORLD_SIZE="3")
    r = subprocess.run([sys.executable, "-m", "orbitrl", "train", "--plan", str(plan)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "for 2 devices" in r.stderr and "has 3" in r.stderr


def test_two_rank_plan_separated(tmp_path, capsys):
    """A devices=2 plan with the separated shape on two gloo ranks: one rollout rank, one
    training rank, the weights synced between them, the summary comparing with the plan."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
    try:
        import launch  # tests/distributed/launch.py: ranks as torchrun starts them
    finally:
        sys.path.pop(0)
    plan, _ = write_plan(tmp_path, "--devices", "2", "--strategy", "adapter", "--base-dtype",
                         "int8", "--completion-len", "4", "--schedule", "separated")
    assert json.loads(plan.read_text())["settings"]["schedule.rollout_ranks"] == 1
    run = tmp_path / "run"
    argv = launch.orbitrl_argv("train", "--plan", str(plan), "--out", str(run), *FAST,
                               "--set", "data.heldout_size=4", "--set", "dist.timeout_s=60")
    res = launch.run(argv, 2, 300)
    assert [r.returncode for r in res] == [0, 0], [r.stderr[-2000:] for r in res]
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["schedule"]["shape"] == "separated" and cfg["schedule"]["rollout_ranks"] == 1
    s = json.loads((run / "summary.json").read_text())
    assert s["schedule_shape"] == "separated" and s["world_size"] == 2
    assert s["plan"]["devices"] == 2 and s["plan"]["step_s"]["steps"] == 2
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["sync_bytes"] > 0 for r in rows)  # weights went from training to rollout


def test_example_plan_runs(tmp_path):
    """examples/plan_builtin.json (written by `orbitrl plan --out`) runs as given."""
    plan = Path(__file__).resolve().parents[2] / "examples" / "plan_builtin.json"
    run = tmp_path / "run"
    assert main(["train", "--plan", str(plan), *FAST, "--out", str(run)]) == 0
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    settings = json.loads(plan.read_text())["settings"]
    assert cfg["model"]["base_dtype"] == settings["model.base_dtype"]
    assert cfg["rollout"]["max_tokens"] == settings["rollout.max_tokens"]
    assert "plan" in json.loads((run / "summary.json").read_text())
