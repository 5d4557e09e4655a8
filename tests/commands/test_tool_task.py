"""The built-in tool task end to end on the built-in model: `orbitrl sft --task tool_arith`,
`orbitrl train examples/tool_arith.yaml` (two steps: the tool metrics, the trajectory log,
the report's tool plot) and `orbitrl eval --task tool_arith` (completion rate and tool use).
A few warm-start steps do not teach the model the tool; only the path is checked here (the
learning is measured in docs/envs.md)."""

import json

import pytest

from orbitrl.cli import main
from orbitrl.rl.evaluate import tool_summary

EXAMPLE = "examples/tool_arith.yaml"


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    out = tmp_path_factory.mktemp("tool_sft")
    assert main(["sft", "--task", "tool_arith", "--steps", "3", "--batch-size", "8",
                 "--out", str(out)]) == 0
    return out


def test_train_logs_tool_use(warm, tmp_path):
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / EXAMPLE
    args = ["train", str(example), "--set", f"model.path={warm}", "--set", "train.max_steps=2",
            "--set", "rollout.prompts_per_step=2", "--set", "rollout.n=2",
            "--set", "data.heldout_size=4", "--set", "log.progress=false",
            "--set", "checkpoint.every=0", "--out", str(tmp_path)]
    assert main(args) == 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        for k in ("env_tool_frac", "env_answer_hits_frac", "env_turns_mean", "env_tool_calls"):
            assert k in r, k
        assert 0.0 <= r["env_answer_hits_frac"] <= r["env_tool_frac"] <= 1.0
    logged = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert logged and all({"tool_calls", "answer_hits", "turns_text"} <= set(t) for t in logged)
    assert main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "report" / "tools.png").exists()


def test_eval_reports_tool_use(warm, tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", str(warm), "--task", "tool_arith", "--limit", "6",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "task tool_arith" in text and "tools: called in" in text
    data = json.loads(out.read_text())
    assert data["n"] == 6 and len(data["rows"]) == 6
    rows = data["rows"]
    assert data["tool_use_rate"] == sum(r["tool_calls"] > 0 for r in rows) / 6
    assert data["tool_solved_rate"] + data["solved_without_tool"] == pytest.approx(
        data["accuracy"])


def test_tool_summary_by_hand():
    rows = [  # called right and solved; called wrong; answered without a tool (right, wrong)
        {"score": 1.0, "turns": 2, "tool_calls": 1, "tool_errors": 0, "tool_correct": True},
        {"score": 0.0, "turns": 2, "tool_calls": 2, "tool_errors": 1, "tool_correct": False},
        {"score": 1.0, "turns": 1, "tool_calls": 0, "tool_errors": 0, "tool_correct": False},
        {"score": 0.0, "turns": 1, "tool_calls": 0, "tool_errors": 0, "tool_correct": False}]
    s = tool_summary(rows)
    assert s == {"tool_use_rate": 0.5, "tool_correct_rate": 0.25, "tool_solved_rate": 0.25,
                 "solved_without_tool": 0.25, "tool_errors": 1, "turns_mean": 1.5}
    assert tool_summary([{"score": 1.0}]) is None


def test_sft_limit_takes_the_first_problems(tmp_path, monkeypatch, capsys):
    """``--limit N``: the warm start sees the first N problems of the sft split, two traces
    each (the call, then the answer after the result)."""
    import orbitrl.train.sft as sft
    from orbitrl.data.tool_arith import tool_rows

    seen = {}

    def fake(model, pairs, cfg, progress=None):
        seen["pairs"] = pairs
        return [0.0]

    monkeypatch.setattr(sft, "train_sft", fake)
    assert main(["sft", "--task", "tool_arith", "--limit", "5", "--steps", "1",
                 "--out", str(tmp_path / "m")]) == 0
    assert len(seen["pairs"]) == 10 == len(tool_rows("sft", 5))
    assert main(["sft", "--task", "tool_arith", "--limit", "-1", "--out", str(tmp_path)]) == 2
    assert "--limit -1" in capsys.readouterr().err


def test_sft_chat_template_trains_the_chat_rollouts_turns(tmp_path, monkeypatch, capsys):
    """``--chat-template --task tool_arith``: the first N problems of the sft split as the
    chat rollouts' two turns each (rl/trajectory.py chat_tool_pairs, whose tokens a test in
    tests/rl/test_trajectory_chat.py follows through a rollout); --eval-every beside it
    stops with one line."""
    from chat_helpers import chat_tokenizer
    from hf_helpers import make_hf_model

    import orbitrl.train.sft as sft
    from orbitrl.config import load_config
    from orbitrl.data.tool_arith import tool_rows
    from orbitrl.rl.trajectory import chat_tool_pairs

    d = tmp_path / "chat"
    make_hf_model("qwen2", vocab_size=128, max_position_embeddings=1024).save_pretrained(d)
    chat_tokenizer().save_pretrained(d)
    seen = {}

    def fake(model, pairs, cfg, progress=None):
        seen["pairs"] = pairs
        return [0.0]

    monkeypatch.setattr(sft, "train_sft", fake)
    assert main(["sft", "--model", str(d), "--task", "tool_arith", "--chat-template",
                 "--limit", "3", "--steps", "1", "--out", str(tmp_path / "m")]) == 0
    want = chat_tool_pairs(chat_tokenizer(), load_config(None, [
        "env.name=tools", "data.chat_template=true"]), tool_rows("sft", 3, traces=False))
    assert seen["pairs"] == want and len(want) == 6
    assert main(["sft", "--task", "tool_arith", "--chat-template", "--eval-every", "1",
                 "--out", str(tmp_path / "x")]) == 2
    assert "--eval-every" in capsys.readouterr().err


def test_sft_stops_at_a_held_out_accuracy(tmp_path, capsys):
    """``--eval-every N --stop-at ACC``: the held-out rows are scored every N steps as
    ``orbitrl eval --task`` scores them, and the warm start ends (and is saved) at the first
    evaluation that reaches ACC."""
    from orbitrl.commands.eval import task_scorer
    from orbitrl.model import load_model, load_tokenizer

    out = tmp_path / "m"
    assert main(["sft", "--task", "tool_arith", "--steps", "6", "--batch-size", "4",
                 "--eval-every", "2", "--stop-at", "0", "--heldout", "6",
                 "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "sft step 2: loss" in err and "sft step 4" not in err
    line = [ln for ln in err.splitlines() if ln.startswith("sft step 2")][0]
    acc = float(line.split("held-out accuracy ")[1].split(",")[0])
    model = load_model(out)
    got, tools = task_scorer("tool_arith", model, load_tokenizer(out, model.config.vocab_size),
                             6)()
    assert abs(got - acc) < 1e-9 and tools is not None  # the saved model is the one scored
    assert main(["sft", "--task", "arith", "--steps", "4", "--batch-size", "4",
                 "--eval-every", "2", "--stop-at", "1", "--heldout", "4",
                 "--out", str(tmp_path / "n")]) == 0
    err = capsys.readouterr().err
    assert "sft step 2" in err and "sft step 4" in err  # never reached: the whole schedule
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    for bad, msg in ((["--data", str(data), "--eval-every", "2"], "--eval-every: needs --task"),
                     (["--stop-at", "0.5"], "--stop-at: needs --eval-every"),
                     (["--eval-every", "2", "--stop-at", "30"], "between 0 and 1")):
        assert main(["sft", *bad, "--out", str(tmp_path / "x")]) == 2
        assert msg in capsys.readouterr().err
