"""Helpers for multi-process tests: a tiny random Llama with the built-in tokenizer, the
``orbitrl train`` arguments of a short run, and launching it on 1 or N ranks (gloo, one
thread each) with a hard timeout, so a hang fails the test."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
TIMEOUT_S = 240  # per launch; a run here takes seconds, a hang is killed at this


def rank_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(HERE), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A 2-layer Llama (no biases, untied head) over the built-in 128-token vocabulary."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


STEPS = 4  # steps of the reference runs


@pytest.fixture(scope="session")
def one_process_runs(tiny_llama, tmp_path_factory) -> dict:
    """The one-process reference run of each mode (``STEPS`` steps), shared by the tests
    that compare a multi-process run against it."""
    out = {}
    for mode in ("adapter", "full"):
        run = tmp_path_factory.mktemp(f"one-{mode}")
        train(train_args(tiny_llama, mode, STEPS), 1, run)
        out[mode] = run
    return out


def build_tiny_llama(out: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from orbitrl.model.builtin import resolve_model_path

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, tie_word_embeddings=False,
                      eos_token_id=1, pad_token_id=0, bos_token_id=None)
    LlamaForCausalLM(cfg).save_pretrained(out)
    src = resolve_model_path("builtin:tiny-arith")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(src / f, out / f)
    return out


def train_args(model: Path, mode: str, steps: int, *extra: str) -> list[str]:
    sets = [f"model.path={model}", "model.base_dtype=fp32", f"train.mode={mode}",
            f"train.max_steps={steps}", "rollout.prompts_per_step=4", "rollout.n=4",
            "rollout.max_tokens=6", "rollout.kv_budget_mb=2", "data.heldout_size=4",
            "log.progress=false", "checkpoint.every=0", "train.deterministic=true",
            "reward.name=dist_rewards:digits", "train.lr=1e-3", "dist.timeout_s=60",
            *extra]
    out = ["train"]
    for s in sets:
        out += ["--set", s]
    return out


def train(args: list[str], world: int, run_dir: Path, resume: bool = False):
    """``orbitrl train`` on ``world`` ranks; returns the per-rank results (asserted 0)."""
    import launch

    argv = launch.orbitrl_argv(*(["train", "--resume", str(run_dir)] + args[1:] if resume
                                 else args + ["--out", str(run_dir)]))
    if world == 1:
        r = subprocess.run(argv, env=rank_env(), capture_output=True, text=True,
                           timeout=TIMEOUT_S)
        assert r.returncode == 0, r.stderr[-3000:]
        return [r]
    res = launch.run(argv, world, TIMEOUT_S, env=rank_env())
    for x in res:
        assert x.returncode == 0, f"rank {x.rank}: {x.stderr[-3000:]}"
    return res


def final_weights(run_dir: Path, mode: str) -> dict:
    from safetensors.torch import load_file

    name = "adapter_model.safetensors" if mode == "adapter" else "model.safetensors"
    return load_file(run_dir / "checkpoints" / "final" / name)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)
