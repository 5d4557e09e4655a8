"""Every example config runs: two steps of each through `orbitrl train`, its own keys kept
and only the sizes overridden (steps, prompts, samples, tokens, held-out rows). An example
written for a real model (a model directory the user fetches) runs on a tiny random model
of the same family with a chat template, saved here; one that names a reward model
(``rm:runs/...``) gets one ``orbitrl rm`` trains here on the examples' pairs. What is checked
is that the config does what it says (its reward, environment and data resolve and train),
not what it learns."""

import json
from pathlib import Path

import pytest
from hf_helpers import make_hf_model

from orbitrl.cli import main
from orbitrl.config import load_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
SIZE = ["train.max_steps=2", "train.max_seconds=0", "rollout.prompts_per_step=2",
        "rollout.n=2", "data.heldout_size=4", "checkpoint.every=0", "log.progress=false",
        "train.threads=1", "rollout.kv_budget_mb=64"]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny Qwen2-shaped model whose tokenizer has a Qwen-style chat template (tools and
    tool messages included)."""
    from chat_helpers import chat_tokenizer

    d = tmp_path_factory.mktemp("chat_model")
    make_hf_model("qwen2", vocab_size=128, max_position_embeddings=2048).save_pretrained(d)
    chat_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    """A reward model ``orbitrl rm`` trained on the examples' pairs, for the configs that
    name one (``rm:runs/...``, which the user trains first, as each header says)."""
    d = tmp_path_factory.mktemp("rm") / "rm"
    assert main(["rm", "--data", str(ROOT / "examples/data/rm_pairs.jsonl"), "--out", str(d)]) == 0
    return d


def _reward_models(path: Path, request) -> list[str]:
    """The reward keys with each ``rm:`` source pointed at the trained ``reward_model``
    (none for a config without one)."""
    r = load_config(path).reward
    if not any(str(n).startswith("rm:") for n in [r.name, *r.extra]):
        return []
    rm = request.getfixturevalue("reward_model")
    sub = lambda n: f"rm:{rm}" if str(n).startswith("rm:") else n  # noqa: E731
    return [f"reward.name={sub(r.name)}", f"reward.extra=[{', '.join(map(sub, r.extra))}]"]


def _overrides(path: Path, chat_model: Path) -> list[str]:
    cfg = load_config(path)
    over = list(SIZE)
    if not str(cfg.model.path).startswith("builtin:"):
        # a model the user brings: the tiny chat model; the tool SFT warm start: built in
        over.append("model.path=" + (str(chat_model) if cfg.data.chat_template
                                     else "builtin:tiny-arith"))
    over.append(f"rollout.max_tokens={min(cfg.rollout.max_tokens, 24)}")
    if cfg.env.name:
        over += [f"env.turn_max_tokens={min(cfg.env.turn_max_tokens or 24, 24)}",
                 "env.max_turns=2"]
    return over


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(path, chat_model, tmp_path, monkeypatch, request):
    monkeypatch.chdir(ROOT)  # examples name their data relative to the repository
    out = tmp_path / "run"
    over = _overrides(path, chat_model) + _reward_models(path, request)
    sets = [x for o in over for x in ("--set", o)]
    assert main(["train", str(path), *sets, "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["steps"] == 2 and 0.0 <= s["heldout_accuracy_after"] <= 1.0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows and all("reward_mean" in r for r in rows)
