"""A causal LM without native code (GPT-NeoX here) through the transformers-backed policy
(model/hf_fallback.py, engine/hf_generate.py): packed rows against transformers' own
forward, generation against its generate, the trainer's recomputed logprobs against the
rollout's, GRPO runs in adapter and full mode that learn; a model that is not a causal LM
stops with one line before any weights load."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from orbitrl.cli import main
from orbitrl.config import load_config
from orbitrl.engine import Request, SamplingParams
from orbitrl.engine.hf_generate import HFEngine
from orbitrl.errors import OrbitError
from orbitrl.model.adapters import load_adapters
from orbitrl.model.builtin import resolve_model_path
from orbitrl.model.config import ModelConfig, NotNative
from orbitrl.model.hf_fallback import load_hf_model
from orbitrl.model.tokenizer import load_tokenizer
from orbitrl.observe.metrics import read_metrics
from orbitrl.rewards import register
from orbitrl.rl.batch import pack, score
from orbitrl.rl.policy import build_policy
from orbitrl.rl.run import run_training
from orbitrl.rl.types import Sample

TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SMALL = ["rollout.prompts_per_step=2", "rollout.n=4", "rollout.max_tokens=6",
         "data.heldout_size=2", "log.progress=false", "checkpoint.every=0"]


def _with_tokenizer(d: Path) -> Path:
    tok = resolve_model_path("builtin:tiny-arith")
    for f in TOKENIZER:
        shutil.copy(tok / f, d / f)
    return d


@pytest.fixture(scope="module")
def neox(tmp_path_factory):
    """A random tiny GPT-NeoX (no native code) with the built-in character tokenizer; its
    weights drawn wide enough (initializer_range 0.3) that its next-token distributions are
    not flat, so a reward moves them within a few steps."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    c = GPTNeoXConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                      eos_token_id=1, bos_token_id=None, pad_token_id=0, initializer_range=0.3)
    d = tmp_path_factory.mktemp("neox")
    GPTNeoXForCausalLM(c).save_pretrained(d)
    return _with_tokenizer(d)


def test_config_routes_causal_lms_and_refuses_the_rest():
    with pytest.raises(NotNative):
        ModelConfig.from_hf({"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]})
    with pytest.raises(NotNative):  # no architectures: transformers' causal-LM table
        ModelConfig.from_hf({"model_type": "opt"})
    for hf, want in [({"model_type": "bert", "architectures": ["BertForMaskedLM"]},
                      "not a causal language model"),
                     ({"model_type": "vit", "architectures": ["ViTModel"]},
                      "not a causal language model"),
                     ({"model_type": "made_up", "architectures": ["MadeUpForCausalLM"]},
                      "not known to transformers")]:
        with pytest.raises(OrbitError) as e:
            ModelConfig.from_hf(hf, "m/config.json")
        msg = str(e.value)
        assert not isinstance(e.value, NotNative) and "\n" not in msg
        assert want in msg and hf["architectures"][0] in msg and "m/config.json" in msg


def test_packed_rows_equal_transformers_forward(neox):
    """A GRPO group after one copy of its prompt, and a sample alone, in packed rows: every
    completion token's logprob equals transformers' forward of that sample by itself."""
    model = load_hf_model(neox)
    samples = [Sample(0, [5, 6, 7, 8], [9, 10, 11], [0.0] * 3, "stop", ""),
               Sample(0, [5, 6, 7, 8], [12, 13], [0.0] * 2, "stop", ""),
               Sample(1, [20, 21], [22, 23, 24, 25], [0.0] * 4, "stop", "")]
    batch = pack(samples, "cpu")
    assert batch.parent_ids is not None  # the group's prompt is laid out once
    with torch.no_grad():
        got = score(model, batch, temperature=0.7)
        for b, s in enumerate(samples):
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            logits = model.hf(input_ids=ids).logits[0] / 0.7
            P, C = len(s.prompt_ids), len(s.completion_ids)
            want = logits[P - 1:P + C - 1].log_softmax(-1).gather(
                -1, torch.tensor(s.completion_ids)[:, None])[:, 0]
            assert (got[b, :C] - want).abs().max() <= 1e-5
    # gradients: the shared prompt's hidden states take one path, as one copy per sample
    grads = []
    for share in (True, False):
        model.zero_grad()
        b = pack(samples, "cpu", share_prompts=share)
        (score(model, b) * b.mask).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-5, rtol=1e-4)


def test_engine_matches_generate_and_the_trainer(neox):
    """Greedy tokens equal transformers' generate of each prompt alone; sampled tokens'
    logprobs (at temperature 0.7 and 1) equal the trainer's recomputation within 1e-5
    (measured 1.9e-6 at most)."""
    model = load_hf_model(neox)
    engine = HFEngine(model, load_tokenizer(neox, 128), seed=0)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]]
    outs = engine.generate([Request(prompt_ids=p) for p in prompts],
                           SamplingParams(max_tokens=8, temperature=0.0))
    for o, p in zip(outs, prompts):
        want = model.hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                                 eos_token_id=1, pad_token_id=0)[0, len(p):].tolist()
        got = o.samples[0].token_ids
        assert got == want[:len(got)] and (got[-1] == 1 or len(got) == 8)
    for temp in (0.7, 1.0):
        outs = engine.generate([Request(prompt_ids=p) for p in prompts],
                               SamplingParams(n=4, max_tokens=8, temperature=temp, seed=3))
        samples = [Sample(g, p, c.token_ids, c.logprobs, c.finish_reason, c.text or "")
                   for g, (o, p) in enumerate(zip(outs, prompts)) for c in o.samples]
        assert len(samples) == 12 and engine.stats["generated_tokens"] > 0
        batch = pack(samples, "cpu")
        with torch.no_grad():
            gap = ((score(model, batch, temperature=temp) - batch.rollout_logp).abs()
                   * batch.mask).max().item()
        assert gap <= 1e-5
    with pytest.raises(OrbitError, match="whole batches only"):
        engine.begin([])


def test_train_adapter_mode(neox, tmp_path, capsys):
    """`orbitrl train` on the fallback: the warning once, the mismatch measured each step,
    adapters that peft loads on transformers' model with equal logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    assert main(["train", "--set", f"model.path={neox}", "--set", "train.max_steps=2",
                 "--set", "log.align_every=1", "--out", str(out)]
                + [a for kv in SMALL for a in ("--set", kv)]) == 0
    err = capsys.readouterr().err
    assert err.count("runs through transformers") == 1 and "faster" in err
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 2 and all(r["logprob_mismatch_max"] <= 1e-5 for r in rows)
    assert all("tis_weight_mean" in r for r in rows)
    # the periodic engine-vs-trainer check: generate's KV-cached logits against the
    # trainer's padded forward
    assert all(r["align_ok"] == 1.0 and r["align_logprob_gap_max"] <= 1e-5 for r in rows)
    final = out / "checkpoints" / "final"
    # check-alignment on the trained adapters, through transformers on both paths
    report = tmp_path / "align.json"
    assert main(["check-alignment", "--model", str(neox), "--adapter", str(final),
                 "--max-tokens", "6", "--json", str(report)]) == 0
    assert "aligned" in capsys.readouterr().out
    figures = json.loads(report.read_text())
    assert figures["aligned"] and figures["positions"] > 0 and figures["l1_max"] < 1e-4
    assert main(["check-alignment", "--model", str(neox), "--base-dtype", "nf4"]) == 2
    assert "no native code" in capsys.readouterr().err
    # the run's final policy evaluated as training evaluated it, through transformers
    assert main(["eval", "--run", str(out)]) == 0
    said = capsys.readouterr().out
    assert "accuracy" in said.lower()
    ours = load_hf_model(neox)
    load_adapters(ours, final)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(neox), final).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.allclose(peft(input_ids=ids).logits, ours.hf(input_ids=ids).logits,
                              atol=1e-5)
    # a merged export that transformers loads, with the adapted logits
    merged = tmp_path / "merged"
    assert main(["export", str(out), "--format", "hf", "--out", str(merged)]) == 0
    hf = AutoModelForCausalLM.from_pretrained(merged).eval()
    with torch.no_grad():
        assert torch.allclose(hf(input_ids=ids).logits, ours.hf(input_ids=ids).logits,
                              atol=1e-5)


def test_generate_and_eval_commands_run_through_transformers(neox, tmp_path, capsys):
    """`orbitrl generate` and `orbitrl eval --model` on a model without native code: greedy
    rows equal transformers' generate of each prompt alone; eval scores the built-in task."""
    import json

    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    src, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    src.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    assert main(["generate", "--model", str(neox), "--prompts", str(src), "--out", str(out),
                 "--max-tokens", "6", "--temperature", "0", "--no-progress"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    model = load_hf_model(neox)
    for p, row in zip(prompts, rows):
        want = model.hf.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False,
                                 eos_token_id=1, pad_token_id=0)[0, len(p):].tolist()
        got = row["completion_ids"]
        assert got == want[:len(got)] and (len(got) == 6 or got[-1] == 1)
    capsys.readouterr()
    assert main(["eval", "--model", str(neox), "--limit", "4"]) == 0
    assert "accuracy" in capsys.readouterr().out.lower()
    assert main(["eval", "--model", str(neox), "--task", "humaneval", "--limit", "1",
                 "--max-tokens", "4", "--n", "2", "--k", "1"]) == 0
    assert "pass@1 (greedy)" in capsys.readouterr().out
    assert main(["eval", "--model", str(neox), "--base-dtype", "nf4", "--adapter",
                 str(tmp_path), "--limit", "2"]) == 2
    assert "no native code" in capsys.readouterr().err


def test_reward_model_through_transformers(neox, tmp_path, capsys):
    """`orbitrl rm` on a model without native code: a fresh head on its backbone, saved as
    transformers' sequence classifier of the family (scores equal to ours), then used as
    the reward of a GRPO run of the same fallback model."""
    from transformers import AutoModelForSequenceClassification

    from orbitrl.train.reward_model import load_reward_model, reward_ids

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "chosen": str(a + b),
                                         "rejected": str(a + b + 1)}) + "\n"
                             for a in range(4) for b in range(4)))
    out = tmp_path / "rm"
    assert main(["rm", "--model", str(neox), "--data", str(pairs), "--out", str(out),
                 "--epochs", "2", "--batch-size", "4"]) == 0
    assert "held-out pair accuracy" in capsys.readouterr().out
    ours = load_reward_model(out)
    tok = load_tokenizer(out, 128)
    rows = [reward_ids(tok, "1+2=", "3"), reward_ids(tok, "1+2=", "44")]
    ref = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert type(ref).__name__ == "GPTNeoXForSequenceClassification"
    with torch.no_grad():
        want = [ref(input_ids=torch.tensor([r])).logits[0, 0].item() for r in rows]
    assert ours.scores(rows) == pytest.approx(want, abs=1e-5)
    run = tmp_path / "run"
    assert main(["train", "--set", f"model.path={neox}", "--set", "train.max_steps=1",
                 "--set", f"reward.name=rm:{out}", "--out", str(run)]
                + [a for kv in SMALL for a in ("--set", kv)]) == 0
    row = read_metrics(run / "metrics.jsonl")[0]
    assert row["reward_rm_errors"] == 0 and row["reward_rm_mean"] != 0
    assert row["reward_mean"] == pytest.approx(row["reward_rm_mean"])


def test_sft_through_transformers(neox, tmp_path, capsys):
    """`orbitrl sft` on a model without native code: the loss falls and the written model
    loads in transformers with the trained weights' logits."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "sft"
    assert main(["sft", "--model", str(neox), "--task", "arith", "--steps", "8",
                 "--limit", "32", "--lr", "3e-3", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "final loss" in said
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    before = AutoModelForCausalLM.from_pretrained(neox).eval()
    after = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert not torch.allclose(before(input_ids=ids).logits, after(input_ids=ids).logits)
    # the dropout rates written back, as the checkpoint had them
    assert after.config.to_dict().get("hidden_dropout") == before.config.to_dict().get("hidden_dropout")


def test_train_full_mode_with_reference(tmp_path):
    """Full mode with a KL term (the reference: a frozen copy) on GPT-2: Conv1D projections
    (no LoRA there: adapter mode stops with one line), a tied head, absolute positions and
    dropout 0.1 in its config (off while it trains, so the trainer scores what the rollout
    sampled; measured 0.1-0.17 apart with it on). The final weights are a directory
    transformers loads, with the checkpoint's dropout rates."""
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    d = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                               eos_token_id=1, bos_token_id=1)).save_pretrained(d)
    _with_tokenizer(d)
    with pytest.raises(OrbitError, match="Conv1D"):
        build_policy(load_config(None, [f"model.path={d}"]), torch.device("cpu"))
    out = tmp_path / "run"
    cfg = load_config(None, ["train.mode=full", "algo.kl_coef=0.1", "train.max_steps=2",
                             f"model.path={d}", *SMALL])
    run_training(cfg, out, echo=lambda *a: None)
    rows = read_metrics(out / "metrics.jsonl")
    assert all(r["logprob_mismatch_max"] <= 1e-5 for r in rows) and "kl" in rows[-1]
    back = AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "final")
    assert back.config.resid_pdrop == 0.1


@register("test_fallback_digits", override=True)
def _digits_and_capitals(prompt, completion, **f):
    return sum(c.isdigit() or c.isupper() for c in completion) / 8


def test_grpo_learns_on_the_fallback(neox, tmp_path):
    """The built-in task's GRPO loop in adapter mode with a reward the random model can
    learn (digits and capitals in the reply, about a third of the vocabulary): measured
    0.38 over the first four steps, 0.88 over the last four of 14 (seeds 1 and 2: 0.41 ->
    0.97, 0.34 -> 0.96)."""
    cfg = load_config(None, [f"model.path={neox}", "reward.name=test_fallback_digits",
                             "train.max_steps=14", "train.lr=2e-2", "train.seed=0",
                             "rollout.prompts_per_step=4", "rollout.n=8",
                             "rollout.max_tokens=8", "data.heldout_size=2",
                             "log.progress=false", "checkpoint.every=0"])
    run_training(cfg, tmp_path / "run", echo=lambda *a: None)
    rewards = [r["reward_mean"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert len(rewards) == 14
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.3


def test_not_a_causal_lm_stops_before_weights(tmp_path, capsys):
    """A BERT masked-LM directory (config.json and a tokenizer, no weights at all): one
    line naming its architecture, exit code 2, no traceback."""
    from transformers import BertConfig

    d = tmp_path / "bert"
    d.mkdir()
    c = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                   intermediate_size=64)
    c.architectures = ["BertForMaskedLM"]
    c.save_pretrained(d)
    _with_tokenizer(d)
    assert main(["train", "--set", f"model.path={d}", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    assert "BertForMaskedLM" in err[0] and "not a causal language model" in err[0]
    assert str(d / "config.json") in err[0]


def test_refused_settings_name_their_key(neox):
    cfg = load_config(None, [f"model.path={neox}", "model.base_dtype=nf4"])
    with pytest.raises(OrbitError, match="model.base_dtype"):
        build_policy(cfg, torch.device("cpu"))
