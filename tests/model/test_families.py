"""The families added beside Llama/Qwen (SmolLM3's NoPE layers, OLMo 2/3's post-norm blocks
and whole-projection q/k norms) through the paths a run takes: the engine's and the
trainer's logprobs agree (`orbitrl check-alignment`), and a GRPO step runs in adapter and
full mode. Logits, engine greedy decoding, peft adapters and exports against transformers
are in test_parity.py, tests/engine/test_engine.py and test_adapters_peft.py."""

import json
import shutil

import pytest

from hf_helpers import make_hf_model
from orbitrl.cli import main
from orbitrl.model.builtin import resolve_model_path

FAMILIES = ["smollm3", "olmo2", "olmo3"]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """family -> a random tiny checkpoint with the built-in character tokenizer."""
    out = {}
    tok = resolve_model_path("builtin:tiny-arith")
    for fam in FAMILIES:
        d = tmp_path_factory.mktemp(fam)
        make_hf_model(fam, vocab_size=128).save_pretrained(d)
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(tok / f, d / f)
        out[fam] = d
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_and_trainer_logprobs_agree(family_dirs, family, tmp_path):
    out = tmp_path / "a.json"
    assert main(["check-alignment", "--model", str(family_dirs[family]),
                 "--json", str(out)]) == 0
    m = json.loads(out.read_text())
    assert m["aligned"] and m["positions"] >= 8
    assert m["logprob_gap_max"] <= 1e-5 and m["topk_agreement"] == 1.0


@pytest.mark.parametrize("family,mode", [("smollm3", "adapter"), ("olmo2", "full"),
                                         ("olmo3", "adapter")])
def test_a_grpo_step_runs(family_dirs, family, mode, tmp_path):
    assert main(["train", "--set", f"model.path={family_dirs[family]}",
                 "--set", f"train.mode={mode}", "--set", "train.max_steps=2",
                 "--set", "rollout.prompts_per_step=2", "--set", "rollout.n=2",
                 "--set", "rollout.max_tokens=6", "--set", "data.heldout_size=2",
                 "--set", "log.progress=false", "--set", "checkpoint.every=0",
                 "--out", str(tmp_path / "run")]) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["skipped_nonfinite"] == 0 for r in rows)


def test_config_defaults_follow_transformers():
    """Keys a config may leave out take transformers' defaults: SmolLM3 makes every 4th layer
    NoPE and ties its head; an OLMo 3 flat rope scaling (full-attention layers only) is
    refused rather than applied to every layer."""
    from orbitrl.errors import OrbitError
    from orbitrl.model.config import ModelConfig

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                num_attention_heads=4, num_key_value_heads=2)
    c = ModelConfig.from_hf(dict(base, model_type="smollm3"))
    assert c.rope_layers == [True, True, True, False] * 2 and c.tie_word_embeddings
    assert ModelConfig.from_hf(dict(base, model_type="olmo3")).post_norm
    with pytest.raises(OrbitError, match="OLMo 3 rope scaling"):
        ModelConfig.from_hf(dict(base, model_type="olmo3",
                                 rope_scaling={"rope_type": "yarn", "factor": 8.0}))
