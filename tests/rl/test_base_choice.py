"""``model.base_dtype: auto``: a run prices its own shapes and takes the widest frozen base the
memory allows; the choice is what the run saves (config.yaml, the adapters' recorded base)."""

import json

import pytest
from hf_helpers import make_hf_model

import orbitrl.rl.policy as P
from orbitrl.cli import main

SIZE = ["train.max_steps=1", "rollout.prompts_per_step=2", "rollout.n=2",
        "rollout.max_tokens=4", "data.heldout_size=2", "checkpoint.every=0",
        "log.progress=false", "rollout.kv_budget_mb=64"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from chat_helpers import chat_tokenizer

    d = tmp_path_factory.mktemp("llama")
    make_hf_model("llama", vocab_size=128, max_position_embeddings=512).save_pretrained(d)
    chat_tokenizer().save_pretrained(d)
    return d


def run(tmp_path, model_dir, *sets):
    out = tmp_path / "run"
    args = [x for s in [*SIZE, f"model.path={model_dir}", *sets] for x in ("--set", s)]
    assert main(["train", *args, "--out", str(out)]) == 0
    saved = (out / "config.yaml").read_text()
    base = json.loads((out / "checkpoints" / "final" / "orbitrl_base.json").read_text())
    return saved, base["base_dtype"]


def test_plenty_of_memory_keeps_the_base_in_fp32(tmp_path, model_dir):
    saved, base = run(tmp_path, model_dir)
    assert base == "fp32" and "base_dtype: fp32" in saved


def test_little_memory_quantizes_the_base(tmp_path, model_dir, monkeypatch):
    monkeypatch.setattr(P, "available_memory", lambda device: 1 << 20)  # 1 MiB free
    saved, base = run(tmp_path, model_dir)
    assert base == "nf4" and "base_dtype: nf4" in saved


@pytest.mark.parametrize("fmt", ["int8", "nf4mix"])
def test_an_explicit_base_is_kept(tmp_path, model_dir, monkeypatch, fmt):
    monkeypatch.setattr(P, "available_memory", lambda device: 1 << 40)
    assert run(tmp_path, model_dir, f"model.base_dtype={fmt}")[1] == fmt
