"""Reward models as reward sources: transformers sequence classifiers scored in batches
against transformers' own scores, orbitrl's first format (a scalar head beside a causal
LM), one-line refusals, and ``rm:PATH`` (a directory or a Hub id) beside a verifier."""

import json
import shutil

import pytest
import torch
from hf_helpers import make_hf_config

from orbitrl.errors import OrbitError
from orbitrl.model.builtin import resolve_model_path
from orbitrl.model.config import FAMILIES
from orbitrl.rewards import RewardRunner
from orbitrl.rl.reward_model import RewardModel
from orbitrl.rl.score import reward_sources
from orbitrl.config import RewardSection
from orbitrl.train.reward_model import (SEQCLS, load_reward_model, new_reward_model,
                                        save_reward_head, save_reward_model)

PAD = 0
# rows of different lengths; one holds the pad id inside it, one ends on it (transformers
# reads that row at the token before: the rightmost token that is not padding)
ROWS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [12, 13, PAD, 14, 15], [20, 21, 22, PAD], [30]]


def hf_classifier(family: str, d, **over):
    """A tiny random transformers sequence classifier saved in ``d``."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    cfg = make_hf_config(family, num_labels=1, pad_token_id=PAD, **over)
    model = AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(d)
    return model


def hf_scores(model, rows, pad=PAD):
    """transformers' scores of right-padded rows (its attention mask, its pooling)."""
    T = max(map(len, rows))
    ids = torch.tensor([r + [pad] * (T - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits[:, 0].tolist()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma2", "deepseek_v3"])
def test_batched_scores_equal_transformers_sequence_classifier(family, tmp_path):
    ref = hf_classifier(family, tmp_path)
    rm = load_reward_model(tmp_path)
    assert rm.pad_id == PAD and (rm.backbone.lm_head is None) == (
        family in ("llama", "qwen3", "deepseek_v3"))
    ours = rm.scores(ROWS, batch_size=2)  # three forwards, each padded
    assert ours == pytest.approx(hf_scores(ref, ROWS), abs=1e-5)
    assert ours == pytest.approx([rm.scores([r])[0] for r in ROWS], abs=1e-5)


def test_every_native_family_has_its_transformers_classifier():
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as names)

    assert set(SEQCLS) == set(FAMILIES)
    assert all(names[t] == SEQCLS[t] for t in FAMILIES)


def test_bf16_scores_stay_near_fp32(tmp_path):
    hf_classifier("llama", tmp_path)
    fp32 = load_reward_model(tmp_path).scores(ROWS)
    bf16 = load_reward_model(tmp_path, dtype="bf16")
    assert bf16.score.weight.dtype == torch.bfloat16
    assert bf16.scores(ROWS) == pytest.approx(fp32, abs=0.05)


def test_more_than_one_label_is_refused_naming_the_file(tmp_path):
    from transformers import AutoModelForSequenceClassification

    cfg = make_hf_config("llama", num_labels=3, pad_token_id=PAD)
    AutoModelForSequenceClassification.from_config(cfg).save_pretrained(tmp_path)
    with pytest.raises(OrbitError) as e:
        load_reward_model(tmp_path)
    msg = str(e.value)
    assert str(tmp_path / "config.json") in msg and "3 labels" in msg and "\n" not in msg


def test_a_causal_lm_without_a_head_is_not_a_reward_model(tmp_path):
    d = tmp_path / "plain"
    shutil.copytree(resolve_model_path("builtin:tiny-arith"), d)
    with pytest.raises(OrbitError, match="reward_head.safetensors"):
        RewardModel(d)


@pytest.fixture()
def head_dir(tmp_path):
    """orbitrl's first format: the built-in model plus reward_head.safetensors."""
    d = tmp_path / "rm"
    shutil.copytree(resolve_model_path("builtin:tiny-arith"), d)
    torch.manual_seed(0)
    save_reward_head(d, torch.randn(1, 128), torch.tensor([0.5]))
    return d


def test_first_format_is_the_head_on_the_last_hidden_state(head_dir):
    rm = RewardModel(head_dir)
    s = rm("12+34=", "46")
    ids = rm.tok("12+34=46", add_special_tokens=False)["input_ids"]
    m = rm.model
    with torch.no_grad():
        want = float(m.score(m.backbone(torch.tensor([ids]), return_hidden=True)[0, -1]))
    assert s == pytest.approx(want, abs=1e-6) and s != rm("12+34=", "47")
    got = rm.score_batch(["12+34=", "1+1=", ""], ["46", "2", ""])
    assert got.scores[0] == pytest.approx(s, abs=1e-5) and got.scores[2] is None
    assert got.errors == [(2, "exception", "empty prompt and completion")]


@pytest.fixture()
def classifier_dir(tmp_path):
    """The built-in model as a sequence classifier with a random head, its tokenizer
    beside it (what ``orbitrl rm`` writes)."""
    from orbitrl.model import load_tokenizer

    base = resolve_model_path("builtin:tiny-arith")
    tok = load_tokenizer(base)
    rm = new_reward_model(base, tok, seed=3)
    with torch.no_grad():
        rm.score.weight.normal_(0, 1, generator=torch.Generator().manual_seed(1))
    return save_reward_model(rm, tmp_path / "cls", tok)


def test_rm_in_extra_is_weighted_beside_a_verifier(classifier_dir):
    rc = RewardSection(name="exact_match", extra=[f"rm:{classifier_dir}"], weights=[1.0, 0.5])
    runner = RewardRunner(reward_sources(rc, device="cpu"), timeout_s=None)
    prompts, replies = ["12+34=", "5+5=", "2+2="], ["46", "11", "4"]
    res = runner(prompts, replies, [{"answer": a} for a in ("46", "10", "4")])
    rm = RewardModel(classifier_dir)
    raw = [rm(p, c) for p, c in zip(prompts, replies)]
    assert res.per_source["rm"] == pytest.approx(raw, abs=1e-5)
    assert res.rewards == pytest.approx([1 + 0.5 * raw[0], 0.5 * raw[1], 1 + 0.5 * raw[2]],
                                        abs=1e-5)
    assert res.metrics["reward_rm_errors"] == 0 and "reward_exact_match_mean" in res.metrics


def test_rm_path_may_be_a_hub_id(classifier_dir, tmp_path, monkeypatch):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--orbit-test--tiny-rm"
    shutil.copytree(classifier_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc = RewardSection(name="exact_match", extra=["rm:orbit-test/tiny-rm", f"rm:{classifier_dir}"])
    a, b = reward_sources(rc, device="cpu")[1:]
    assert (a.name, b.name) == ("rm", "rm2") and a.fn.path == repo / "snapshots" / commit
    assert a.fn("7+8=", "15") == pytest.approx(b.fn("7+8=", "15"), abs=1e-6)


def test_chat_template_reads_a_user_turn_and_the_reply(classifier_dir):
    from chat_helpers import chat_tokenizer
    from orbitrl.train.reward_model import reward_ids

    tok = chat_tokenizer()
    text = tok.decode(reward_ids(tok, "2+2=", "4"))
    assert text.endswith("<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n")
    assert json.loads((classifier_dir / "config.json").read_text())["architectures"] == \
        ["Qwen2ForSequenceClassification"]
