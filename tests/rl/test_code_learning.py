"""The code task learns: GRPO with the ``code`` reward (programs run in the sandbox against
each problem's tests) raises the greedy pass rate of a small model.

The model is built here: a 2-layer decoder with the built-in character tokenizer, taught by
SFT to answer four problems with one of two programs, the wrong one three times in five
(``print(input())`` where the problem asks for the reversed line, ``lower`` for ``upper``,
``min`` for ``max``, characters for words). Greedy decoding then picks the wrong program
everywhere (held-out accuracy 0) while sampling finds the right one about two times in five,
which is what RL has to work with. The held-out file holds the same four problems: the test
is that the policy learns which program passes the tests, judged by running them.

Measured (seed 0; AVX-512 and AVX2 kernels): held-out 0.0 before, 1.0 after 6 steps; the
sandbox's pass rate per step 0.65, 0.98, 1.0, 0.97, 0.97, 1.0. With the advantages negated
the same run ends at 0.0 held-out, pass rate 0.65 -> 0.18: the test fails."""

import json
import shutil

import pytest
import torch

from orbitrl.config import load_config
from orbitrl.data.code_tasks import PROBLEMS, SHORT
from orbitrl.model import load_tokenizer
from orbitrl.model.builtin import resolve_model_path
from orbitrl.model.config import ModelConfig
from orbitrl.model.decoder import Decoder
from orbitrl.model.weights import save_pretrained
from orbitrl.observe.metrics import read_metrics
from orbitrl.rl.run import run_training
from orbitrl.train.sft import SFTConfig, encode_pairs, train_sft

CHOICES = {  # problem -> (a program that passes its tests, one that does not)
    "reverse_string": ("print(input()[::-1])\n", "print(input())\n"),
    "uppercase": ("print(input().upper())\n", "print(input().lower())\n"),
    "max_of_list": ("print(max(map(int, input().split())))\n",
                    "print(min(map(int, input().split())))\n"),
    "count_words": ("print(len(input().split()))\n", "print(len(input()))\n"),
}
HF = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 128,
      "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
      "rms_norm_eps": 1e-6, "hidden_act": "silu", "rope_theta": 10000.0,
      "tie_word_embeddings": True, "use_sliding_window": False, "bos_token_id": None,
      "eos_token_id": 1, "pad_token_id": 0}
SFT_STEPS = 300  # full-batch AdamW steps: the 3:2 mixture learned (loss 50 -> 0.02)


def prompt(name: str) -> str:
    return f"{SHORT[name]}\n```python\n"  # the task's terse prompt (data.prompt_field=short)


pytestmark = pytest.mark.usefixtures("needs_sandbox")


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """The SFT-warmed model directory and the four problems as a JSONL file."""
    root = tmp_path_factory.mktemp("code")
    model_dir = root / "model"
    model_dir.mkdir()
    builtin = resolve_model_path("builtin:tiny-arith")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(builtin / f, model_dir / f)
    tok = load_tokenizer(model_dir)
    torch.manual_seed(0)
    model = Decoder(ModelConfig.from_hf(HF))
    rows = []
    for name, (right, wrong) in CHOICES.items():
        rows += [{"prompt": prompt(name), "answer": right + "```"}] * 2
        rows += [{"prompt": prompt(name), "answer": wrong + "```"}] * 3
    train_sft(model, encode_pairs(tok, rows), SFTConfig(lr=3e-3, steps=SFT_STEPS,
                                                        batch_size=len(rows), warmup=10))
    save_pretrained(model, model_dir)
    data = root / "code.jsonl"
    data.write_text("".join(json.dumps({"prompt": prompt(n), "answer": "",
                                        "tests": PROBLEMS[n][1]}) + "\n" for n in CHOICES))
    return model_dir, data



def test_grpo_on_the_code_reward_learns_which_program_passes(warm, tmp_path):
    model_dir, data = warm
    cfg = load_config(None, [f"model.path={model_dir}", f"data.train={data}",
                             f"data.heldout={data}", "reward.name=code", "train.max_steps=6",
                             "rollout.prompts_per_step=4", "rollout.n=8",
                             "rollout.max_tokens=48", "train.lr=3e-3", "train.workers=1",
                             "train.seed=0", "model.base_dtype=fp32", "log.progress=false",
                             "checkpoint.every=0"])
    s = run_training(cfg, tmp_path / "run", echo=lambda *a: None)
    assert s["steps"] == 6 and s["skipped_nonfinite"] == 0
    # greedy decoding: every problem wrong before, at least three of four right after
    assert s["heldout_accuracy_before"] == 0.0
    assert s["heldout_accuracy_after"] >= 0.75
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert all(r["reward_code_sandbox_errors"] == 0 for r in rows)
    passed = [r["reward_code_pass_rate"] for r in rows]
    assert sum(passed[-2:]) / 2 > passed[0] + 0.2
