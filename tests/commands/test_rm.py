"""`orbitrl rm` end to end: a tiny reward model learns synthetic preferences (the right sum
over a wrong one), transformers loads it as a sequence classifier with orbitrl's scores, a
GRPO run uses it beside a verifier; malformed pairs and a used output directory are refused
in one line with nothing lost."""

import json
import random

import pytest
import torch

from orbitrl.cli import main
from orbitrl.data.arith import arith_rows


def write_pairs(path, n: int, seed: int = 0):
    """Arithmetic prompts of the built-in task; chosen the sum, rejected a wrong one."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for r in arith_rows("sft", n):
            c = int(r["answer"])
            w = c + rng.choice([-1, 1]) * rng.randint(1, 30)
            w = w if w >= 0 else c + rng.randint(1, 30)
            f.write(json.dumps({"prompt": r["prompt"], "chosen": str(c),
                                "rejected": str(w)}) + "\n")
    return path


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("rm")
    data = write_pairs(d / "pairs.jsonl", 600)
    assert main(["rm", "--data", str(data), "--epochs", "4", "--held-out", "0.2",
                 "--out", str(d / "out")]) == 0
    return d / "out"


def test_learns_synthetic_preferences(rm_dir):
    s = json.loads((rm_dir / "rm_summary.json").read_text())
    assert (s["pairs_train"], s["pairs_heldout"], s["lr"]) == (480, 120, 1e-3)  # built-in lr
    assert s["heldout_accuracy_after"] >= 0.7  # 120 held-out pairs: chance is 0.5
    assert s["heldout_accuracy_after"] > s["heldout_accuracy_before"] + 0.1


def test_transformers_loads_it_with_orbitrl_scores(rm_dir):
    from transformers import AutoModelForSequenceClassification

    from orbitrl.model import load_tokenizer
    from orbitrl.rl.reward_model import RewardModel

    hf, info = AutoModelForSequenceClassification.from_pretrained(rm_dir,
                                                                  output_loading_info=True)
    assert type(hf).__name__ == "Qwen2ForSequenceClassification" and hf.config.num_labels == 1
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tok = load_tokenizer(rm_dir)  # (transformers' AutoTokenizer would rebuild it as Qwen2's)
    texts = ["12+34=46", "5+5=11", "99+1=100 it is"]
    enc = tok(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    assert tok.padding_side == "right" and hf.config.pad_token_id == tok.pad_token_id
    with torch.no_grad():
        ref = hf(**enc).logits[:, 0].tolist()
    ours = RewardModel(rm_dir).score_batch(["12+34=", "5+5=", "99+1="],
                                           ["46", "11", "100 it is"]).scores
    assert ours == pytest.approx(ref, abs=1e-5)


def test_grpo_uses_it_beside_a_verifier(rm_dir, tmp_path):
    sets = ["train.max_steps=2", "rollout.prompts_per_step=2", "rollout.n=2",
            "rollout.max_tokens=4", "data.heldout_size=4", "log.progress=false",
            "checkpoint.every=0", "model.base_dtype=int8", "reward.name=exact_match",
            f"reward.extra=[rm:{rm_dir}]", "reward.weights=[1.0, 0.5]"]
    out = tmp_path / "run"
    assert main(["train", *[x for s in sets for x in ("--set", s)], "--out", str(out)]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert "reward_rm_mean" in r and r["reward_rm_errors"] == 0
        assert r["reward_rm_mean"] != 0.0 and "reward_exact_match_mean" in r


@pytest.mark.parametrize("line, says", [
    ('{"prompt": "1+1=", "chosen": "2"}', "line 3 has no field 'rejected'"),
    ('{"prompt": "1+1=", "chosen": "2", "rejected": 3}', "line 3: field 'rejected' is int"),
    ('{"prompt": "1+1=", "chosen": ', "line 3 is not valid JSON"),
])
def test_malformed_pairs_are_one_line_and_nothing_is_written(line, says, tmp_path, capsys):
    data = write_pairs(tmp_path / "pairs.jsonl", 2)
    data.write_text(data.read_text() + line + "\n")
    out = tmp_path / "out"
    assert main(["rm", "--data", str(data), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"orbitrl rm: error: {data}: {says}")
    assert not out.exists() and not any(p.name.endswith(".partial") for p in tmp_path.iterdir())


def test_a_used_output_directory_is_refused_and_kept(tmp_path, capsys):
    data = write_pairs(tmp_path / "pairs.jsonl", 20)
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("mine")
    assert main(["rm", "--data", str(data), "--out", str(out)]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["config.json"]
    assert (out / "config.json").read_text() == "mine"


def test_eval_data_and_an_empty_output_directory(tmp_path):
    data, held = write_pairs(tmp_path / "a.jsonl", 16), write_pairs(tmp_path / "b.jsonl", 8, 1)
    out = tmp_path / "out"
    out.mkdir()
    assert main(["rm", "--data", str(data), "--eval-data", str(held), "--batch-size", "8",
                 "--out", str(out)]) == 0
    s = json.loads((out / "rm_summary.json").read_text())
    assert (s["pairs_train"], s["pairs_heldout"], s["steps"]) == (16, 8, 2)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
