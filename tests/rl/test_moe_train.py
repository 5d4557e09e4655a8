"""`orbitrl train` on the built-in tiny mixture: routing replay and router losses in the
metrics, adapters on routed experts saved as merged weights, full mode."""

import json

import pytest
import torch

from orbitrl.cli import main

FAST = ["--set", "model.path=builtin:tiny-arith-moe", "--set", "train.max_steps=2",
        "--set", "rollout.prompts_per_step=2", "--set", "rollout.n=4",
        "--set", "rollout.max_tokens=5", "--set", "data.heldout_size=4",
        "--set", "log.progress=false", "--set", "model.base_dtype=int8",
        "--set", "moe.replay_check_every=2", "--set", "moe.z_loss_coef=0.001"]


def _rows(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_adapter_run_logs_replay_and_router_losses(tmp_path):
    out = tmp_path / "run"
    assert main(["train", *FAST, "--out", str(out)]) == 0
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["logprob_mismatch_max"] <= 1e-5  # replayed, fp32 compute on an int8 base
        assert r["router_aux_loss"] > 0 and r["router_z_loss"] > 0
    assert "logprob_mismatch_max_noreplay" in rows[0] and "routing_flip_frac" in rows[0]
    assert "logprob_mismatch_max_noreplay" not in rows[1]
    assert (out / "checkpoints" / "final" / "adapter_config.json").exists()


@pytest.mark.parametrize("experts", ["per_expert", "shared"])
def test_routed_expert_adapters_end_as_merged_weights(tmp_path, capsys, experts):
    from safetensors import safe_open

    out = tmp_path / "run"
    assert main(["train", *FAST, "--set", f"lora.experts={experts}", "--out", str(out)]) == 0
    final = out / "checkpoints" / "final"
    assert not (final / "adapter_config.json").exists()
    with safe_open(str(final / "model.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.experts.3.up_proj.weight" in f.keys()
    assert main(["export", str(out), "--format", "peft", "--out", str(tmp_path / "p")]) != 0
    assert "no PEFT adapters" in capsys.readouterr().err
    assert main(["export", str(out), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0


def test_full_mode_trains_the_router(tmp_path):
    out = tmp_path / "run"
    assert main(["train", *FAST, "--set", "train.mode=full", "--out", str(out)]) == 0
    rows = _rows(out)
    assert all(r["logprob_mismatch_max"] <= 1e-5 for r in rows)
    from orbitrl.model import load_model
    from orbitrl.model.builtin import resolve_model_path

    start = load_model(resolve_model_path("builtin:tiny-arith-moe"))
    end = load_model(out / "checkpoints" / "final")
    assert not torch.equal(start.model.layers[0].mlp.gate.weight,
                           end.model.layers[0].mlp.gate.weight)
