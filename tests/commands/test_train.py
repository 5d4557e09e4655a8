"""The run contract end to end on the built-in model: train -> files -> report/export/eval."""

import json
import struct

import pytest

from orbitrl.cli import main

FAST = ["--set", "train.max_steps=3", "--set", "rollout.prompts_per_step=2",
        "--set", "rollout.n=4", "--set", "rollout.max_tokens=5", "--set", "data.heldout_size=8",
        "--set", "log.progress=false", "--set", "model.base_dtype=int8"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    assert main(["train", *FAST, "--out", str(out)]) == 0
    return out


def test_run_directory_contract(run_dir):
    assert (run_dir / "config.yaml").exists() and (run_dir / "checkpoints").is_dir()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for k in ("step", "reward_mean", "kl", "entropy", "grad_norm", "logprob_mismatch_max",
              "tokens_per_s", "peak_memory_bytes"):
        assert all(k in r for r in rows), k
    s = json.loads((run_dir / "summary.json").read_text())
    for k in ("heldout_accuracy_before", "heldout_accuracy_after", "steps", "wall_seconds"):
        assert k in s
    assert s["steps"] == 3


def _is_png(p):
    head = p.read_bytes()[:24]
    return head[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", head[16:24])[0] > 0


def test_report_renders(run_dir):
    import re

    assert main(["report", str(run_dir)]) == 0
    page = run_dir / "report" / "report.html"
    imgs = re.findall(r"<img src='([^']+)'", page.read_text())
    assert len(imgs) >= 5
    for name in imgs:
        assert _is_png(run_dir / "report" / name), name


def test_export_and_eval(run_dir, tmp_path, capsys):
    assert main(["export", str(run_dir), "--format", "peft", "--out", str(tmp_path / "peft")]) == 0
    assert (tmp_path / "peft" / "adapter_config.json").exists()
    assert main(["export", str(run_dir), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").exists()
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", "builtin:tiny-arith", "--adapter", str(tmp_path / "peft"),
                 "--base-dtype", "fp32", "--limit", "16", "--out", str(out)]) == 0
    a = json.loads(out.read_text())["accuracy"]
    assert main(["eval", "--model", str(tmp_path / "hf"), "--limit", "16"]) == 0
    assert f"accuracy {a:.4f}" in capsys.readouterr().out  # merged == fp32 base + adapter


def test_adapters_state_their_base_and_eval_uses_it(run_dir, tmp_path, capsys):
    """The run trained over an int8 base: its adapters (and their export) say so, the export
    notes it, and `orbitrl eval --adapter` evaluates over the same base, so it reproduces the
    run's own evaluation (`eval --run`) on the same rows and settings."""
    from orbitrl.model.adapters import trained_base

    final = run_dir / "checkpoints" / "final"
    assert trained_base(final) == "int8"
    assert main(["export", str(run_dir), "--format", "peft", "--out", str(tmp_path / "p")]) == 0
    assert trained_base(tmp_path / "p") == "int8"
    assert "trained over a int8 base" in capsys.readouterr().out
    assert main(["eval", "--run", str(run_dir), "--out", str(tmp_path / "run.json")]) == 0
    assert main(["eval", "--model", "builtin:tiny-arith", "--adapter", str(tmp_path / "p"),
                 "--max-tokens", "5", "--limit", "8", "--out", str(tmp_path / "a.json")]) == 0
    assert "were trained over a int8 base: evaluating over the same" in \
        capsys.readouterr().out
    ran = json.loads((tmp_path / "run.json").read_text())["rows"]
    got = json.loads((tmp_path / "a.json").read_text())["rows"]
    assert [r["completion"] for r in got] == [r["completion"] for r in ran[:8]]


def _autopeft_against_ours(adapter_dir):
    """Logits of peft's AutoPeftModelForCausalLM loaded from the directory alone, and of our
    model over the full-precision base with the same adapters."""
    import torch
    from peft import AutoPeftModelForCausalLM

    import orbitrl
    from orbitrl.model.adapters import load_adapters
    from orbitrl.model.builtin import resolve_model_path

    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    base = resolve_model_path("builtin:tiny-arith").resolve()
    assert cfg["base_model_name_or_path"] == str(base)
    assert (adapter_dir / "tokenizer_config.json").exists()
    pm = AutoPeftModelForCausalLM.from_pretrained(str(adapter_dir), dtype=torch.float32).eval()
    ours = orbitrl.load_model(base)
    ours.attention_fp64 = False  # transformers' fp32 attention order, as the parity tests
    ids = torch.randint(0, 20, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = ours(ids)
        load_adapters(ours, adapter_dir)
        after = ours(ids)
    assert (after - before).abs().max().item() > 1e-4  # the run's adapters moved the model
    with torch.no_grad():
        return pm(ids).logits, after


@pytest.mark.parametrize("where", ["final", "export"])
def test_peft_directory_loads_alone(run_dir, tmp_path, where):
    from transformers import AutoTokenizer

    d = run_dir / "checkpoints" / "final"
    if where == "export":
        assert main(["export", str(run_dir), "--format", "peft", "--out", str(tmp_path / "p")]) == 0
        d = tmp_path / "p"
    theirs, ours = _autopeft_against_ours(d)
    assert (theirs - ours).abs().max().item() < 1e-5
    assert AutoTokenizer.from_pretrained(str(d))("12+34=")["input_ids"]


def test_export_fills_base_and_tokenizer_of_older_runs(run_dir, tmp_path):
    """A run saved before the base path and tokenizer were recorded still exports whole."""
    import shutil

    old = tmp_path / "old"
    shutil.copytree(run_dir, old)
    final = old / "checkpoints" / "final"
    cfg = json.loads((final / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = None
    (final / "adapter_config.json").write_text(json.dumps(cfg))
    for f in final.glob("*"):
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            f.unlink()
    assert main(["export", str(old), "--format", "peft", "--out", str(tmp_path / "p")]) == 0
    theirs, ours = _autopeft_against_ours(tmp_path / "p")
    assert (theirs - ours).abs().max().item() < 1e-5


@pytest.mark.parametrize("args,needle", [
    (["train", "--set", "reward.name=nope"], "nope"),
    (["train", "--set", "data.train=/no/such.jsonl"], "/no/such.jsonl"),
    (["eval", "--model", "/no/such/dir"], "/no/such/dir"),
    (["eval", "--packed-mb", "-1"], "--packed-mb -1"),
    (["eval", "--task", "humaneval", "--packed-mb", "-3"], "--packed-mb -3"),
    (["export", "/no/such/run", "--out", "x"], "/no/such/run"),
])
def test_bad_input_is_one_line(args, needle, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and "Traceback" not in err


def test_dataset_row_missing_prompt_field(tmp_path, capsys):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "1+1=", "answer": "2"}\n{"question": "2+2=", "answer": "4"}\n')
    assert main(["train", "--set", f"data.train={f}", "--set", "data.heldout=" + str(f)]) == 2
    err = capsys.readouterr().err
    assert "row 2" in err and "'prompt'" in err


def test_empty_dataset(tmp_path, capsys):
    f = tmp_path / "e.jsonl"
    f.write_text("")
    assert main(["train", "--set", f"data.train={f}"]) == 2
    assert "empty" in capsys.readouterr().err


def test_log_every_writes_a_metrics_row_every_n_steps(tmp_path):
    """log.every=2 over 5 steps: rows after steps 2 and 4, and the last step's."""
    import json

    from orbitrl.cli import main

    assert main(["train", "--out", str(tmp_path), "--set", "train.max_steps=5",
                 "--set", "log.every=2", "--set", "rollout.prompts_per_step=2",
                 "--set", "rollout.n=2", "--set", "data.heldout_size=4",
                 "--set", "log.progress=false", "--set", "checkpoint.every=0"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 3, 4]


def test_eval_of_a_run_is_the_runs_own_held_out_evaluation(run_dir, capsys):
    """`orbitrl eval --run` goes through the trainer's evaluation path: the run's frozen-base
    format, prompt encoding, reward and max tokens, so it reproduces the summary's number."""
    s = json.loads((run_dir / "summary.json").read_text())
    assert main(["eval", "--run", str(run_dir)]) == 0
    assert f"accuracy {s['heldout_accuracy_after']:.4f}" in capsys.readouterr().out


def test_eval_of_a_run_encodes_prompts_as_the_run_did(run_dir, tmp_path, monkeypatch):
    """A run trained under a chat template is evaluated under it (the eval command once
    encoded raw prompts whatever training had done)."""
    import shutil

    import yaml

    from orbitrl.model import tokenizer

    seen = []
    real = tokenizer.encode_prompt
    # (every prompt, and the one probe that asks whether the template opens a thought)
    monkeypatch.setattr(tokenizer, "encode_prompt",
                        lambda tok, text, chat_template=False, **kw:
                        seen.append(chat_template) or real(tok, text, chat_template, **kw))
    assert main(["eval", "--run", str(run_dir), "--limit", "4"]) == 0
    assert seen == [False] * 5
    run = tmp_path / "run"
    shutil.copytree(run_dir / "checkpoints" / "final", run / "checkpoints" / "final")
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    cfg["data"]["chat_template"] = True
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    seen.clear()
    assert main(["eval", "--run", str(run), "--limit", "4"]) == 0
    assert seen == [True] * 5
