"""The memory ledger against real orbitrl runs: predicted peak within 10% of measured.

Six short RL runs (2 steps each) in fresh processes (clean RSS baselines), with different
models, strategies and batch shapes. Each run writes ``predicted_peak_bytes`` (the ledger's
``predict_peak`` arithmetic for that run) and ``measured_peak_bytes`` (net resident
high-water mark of the largest phase, see ``orbitrl.observe.memory``) into summary.json.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from orbitrl.model.builtin import resolve_model_path

TOL = 0.10

# name, model (None: built-in), overrides
RUNS = [
    ("adapter-nf4-llama48M", dict(model_type="llama", hidden_size=512, intermediate_size=1536,
                                  num_hidden_layers=6, num_attention_heads=8,
                                  num_key_value_heads=4, vocab_size=4096),
     ["model.base_dtype=nf4", "lora.rank=8", "rollout.n=4", "rollout.prompts_per_step=2",
      "rollout.max_tokens=8"]),
    ("adapter-int8-qwen2-40M", dict(model_type="qwen2", hidden_size=448, intermediate_size=1792,
                                    num_hidden_layers=8, num_attention_heads=7,
                                    num_key_value_heads=1, vocab_size=128,
                                    tie_word_embeddings=True),
     ["model.base_dtype=int8", "lora.rank=16", "rollout.n=4", "rollout.prompts_per_step=4",
      "rollout.max_tokens=12"]),
    ("full-stateless-llama30M", dict(model_type="llama", hidden_size=384,
                                     intermediate_size=1024, num_hidden_layers=8,
                                     num_attention_heads=6, num_key_value_heads=2,
                                     vocab_size=8192),
     ["train.mode=full", "rollout.n=4", "rollout.prompts_per_step=2", "rollout.max_tokens=8"]),
    ("full-tiers-llama30M", dict(model_type="llama", hidden_size=384, intermediate_size=1024,
                                 num_hidden_layers=8, num_attention_heads=6,
                                 num_key_value_heads=2, vocab_size=8192),
     ["train.mode=full", "train.tiers=2", "rollout.n=4", "rollout.prompts_per_step=2",
      "rollout.max_tokens=8"]),
    ("full-adamw-qwen2-20M", dict(model_type="qwen2", hidden_size=384, intermediate_size=1024,
                                  num_hidden_layers=6, num_attention_heads=6,
                                  num_key_value_heads=2, vocab_size=512,
                                  tie_word_embeddings=True),
     ["train.mode=full", "train.optimizer=adamw", "rollout.n=2", "rollout.prompts_per_step=4",
      "rollout.max_tokens=10"]),
    ("adapter-fp32-builtin", None,
     ["model.base_dtype=fp32", "rollout.n=4", "rollout.prompts_per_step=2",
      "rollout.max_tokens=8"]),
]

# The measurement conditions (see docs/planner.md, "Predicted against measured"): a fixed
# glibc mmap threshold, so a freed tensor's pages go back to the OS at once and the RSS
# follows the live bytes (otherwise glibc keeps freed heap, and RSS counts it; 16 KiB, as a
# small model's activations of a few hundred KiB would fragment the heap below 256), and MKL's
# buffer cache off (its GEMM packing buffers are freed after each call instead of kept).
MEASURE_ENV = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "16384",
               "MKL_DISABLE_FAST_MM": "1"}

COMMON = ["train.max_steps=2", "data.heldout_size=4", "log.progress=false", "model.device=cpu",
          "checkpoint.every=0", "rollout.kv_budget_mb=32"]


def make_model(out: Path, spec: dict) -> Path:
    """A random HF checkpoint of ``spec``, with the built-in task's tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(spec)
    mt = spec.pop("model_type")
    cfg = AutoConfig.for_model(mt, max_position_embeddings=256, eos_token_id=1, pad_token_id=0,
                               bos_token_id=None, **spec)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    tok = resolve_model_path("builtin:tiny-arith")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tok / f).exists():
            shutil.copy(tok / f, out / f)
    return out


def run_one(tmp: Path, name: str, spec, overrides: list[str]) -> dict:
    sets = list(COMMON) + overrides
    if spec is not None:
        sets.append(f"model.path={make_model(tmp / ('model-' + name), spec)}")
    args = [sys.executable, "-m", "orbitrl", "train", "--out", str(tmp / name)]
    for s in sets:
        args += ["--set", s]
    env = dict(os.environ, **MEASURE_ENV)
    p = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    summary = json.loads((tmp / name / "summary.json").read_text())
    rows = [json.loads(x) for x in (tmp / name / "metrics.jsonl").read_text().splitlines()]
    return {"summary": summary, "rows": rows}


@pytest.mark.slow
def test_predicted_peak_within_10_percent_of_measured(tmp_path):
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak RSS per phase")
    results = []
    for name, spec, ov in RUNS:
        res = run_one(tmp_path, name, spec, ov)
        s = res["summary"]
        assert s["memory_probe"] == "rss-settled-hwm"
        row = res["rows"][-1]
        for ph in ("rollout", "score", "train"):
            assert f"mem_{ph}_predicted_bytes" in row and f"mem_{ph}_measured_bytes" in row
        pred, meas = s["predicted_peak_bytes"], s["measured_peak_bytes"]
        results.append((name, pred, meas, pred / meas - 1, s))
    lines = [f"{'run':<26} {'predicted MiB':>14} {'measured MiB':>13} {'error':>8} "
             f"{'at shape MiB':>13} {'error':>8}"]
    for name, pred, meas, err, s in results:
        at = s["predicted_peak_at_shape_bytes"]
        lines.append(f"{name:<26} {pred / 2**20:>14.1f} {meas / 2**20:>13.1f} {err:>+8.1%} "
                     f"{at / 2**20:>13.1f} {s['peak_at_shape_error']:>+8.1%}")
        for ph in ("rollout", "score", "train"):
            lines.append(f"  {ph:<24} {s[f'predicted_{ph}_bytes'] / 2**20:>14.1f} "
                         f"{s[f'measured_{ph}_bytes'] / 2**20:>13.1f}")
    print("\n" + "\n".join(lines))
    bad = [(n, e) for n, _, _, e, _ in results if abs(e) > TOL]
    within = len(results) - len(bad)
    assert within >= 5, f"{len(bad)} runs off by more than {TOL:.0%}: {bad}"
    assert all(abs(e) <= 0.25 for _, _, _, e, _ in results), results
