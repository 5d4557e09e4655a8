"""The ledger's mixture pricing: shapes read from MoE config.json files, active against
total parameters, gpt-oss's biases and sinks against the loaded model, the sparse per-step
change that a delta weight sync moves, and the predicted peak of real MoE runs against the
measured one."""

import json

import pytest

import orbitrl
from orbitrl.engine import Engine
from orbitrl.ledger.kv import kv_bytes_per_token
from orbitrl.ledger.models import from_config, known
from orbitrl.model.builtin import resolve_model_path
from orbitrl.model.config import ModelConfig


def test_builtin_mixture_shape_matches_the_model():
    path = resolve_model_path("builtin:tiny-arith-moe")
    hf = json.loads((path / "config.json").read_text())
    shape, cfg = from_config(hf, "tiny-arith-moe"), ModelConfig.from_dir(path)
    assert shape.num_experts == 4 and shape.experts_per_token == 2
    assert shape.shared_experts == 1  # Qwen2-MoE's shared expert, as wide as one expert
    # biases and the shared expert's one-row gate are not priced: 0.1% here
    assert abs(shape.total_params / cfg.num_params - 1) < 2e-3
    # active: 2 of 4 routed experts per layer (norms and routers are noise, not priced)
    idle = 4 * (2 * 3 * 128 * 192)
    assert abs((shape.total_params - shape.active_params) / idle - 1) < 0.01


def test_gpt_oss_weights_and_kv_priced_as_loaded(hf_dirs):
    """gpt-oss's biases (q/k/v/o, router, every expert projection) and attention sinks are
    priced: the ledger's parameters are the model's, its weight bytes the loaded state
    dict's; its KV bytes per token are the engine pool's per slot (every layer, the sliding
    ones too: the pool keeps their keys past the window)."""
    path, ref = hf_dirs["gpt_oss"]
    shape = from_config(json.loads((path / "config.json").read_text()))
    model = orbitrl.load_model(path)
    measured = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert shape.total_params == model.config.num_params == sum(
        p.numel() for p in ref.parameters())
    assert abs(shape.total_params * 4 / measured - 1) < 0.10
    cache = Engine(model, kv_budget_bytes=1 << 20, block_size=4).cache
    assert kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim,
                              "float32") == cache.nbytes // cache.k.shape[1]


def test_sparse_update_prices_the_delta_sync():
    from orbitrl.ledger.bandwidth import Links, sync_transfer

    moe, dense = known("mixtral-8x7b"), known("qwen2.5-32b")
    assert moe.changed_fraction < dense.changed_fraction / 10
    links = Links()
    w = 2 * moe.total_params
    assert sync_transfer("changed", w, 0, moe.changed_fraction, links).bytes == int(w * 5e-4)


@pytest.mark.slow
def test_predicted_peak_of_moe_runs_within_10_percent(tmp_path):
    from pathlib import Path

    from test_runtime_prediction import run_one

    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak RSS per phase")
    runs = [
        ("adapter-fp32-builtin-moe", None,
         ["model.path=builtin:tiny-arith-moe", "model.base_dtype=fp32", "rollout.n=4",
          "rollout.prompts_per_step=2", "rollout.max_tokens=8"]),
        ("adapter-int8-qwen3moe", dict(model_type="qwen3_moe", hidden_size=384,
                                       intermediate_size=1024, moe_intermediate_size=256,
                                       num_experts=16, num_experts_per_tok=4,
                                       norm_topk_prob=True, num_hidden_layers=6,
                                       num_attention_heads=6, num_key_value_heads=2,
                                       vocab_size=512),
         ["model.base_dtype=int8", "lora.rank=8", "rollout.n=4", "rollout.prompts_per_step=2",
          "rollout.max_tokens=8"]),
        ("full-stateless-mixtral", dict(model_type="mixtral", hidden_size=256,
                                        intermediate_size=512, num_local_experts=8,
                                        num_experts_per_tok=2, num_hidden_layers=6,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        vocab_size=512),
         ["train.mode=full", "rollout.n=4", "rollout.prompts_per_step=2",
          "rollout.max_tokens=8"]),
    ]
    for name, spec, ov in runs:
        s = run_one(tmp_path, name, spec, ov)["summary"]
        err = s["predicted_peak_bytes"] / s["measured_peak_bytes"] - 1
        print(f"{name}: predicted {s['predicted_peak_bytes'] / 2**20:.1f} MiB, measured "
              f"{s['measured_peak_bytes'] / 2**20:.1f} MiB ({err:+.1%})")
        assert abs(err) <= 0.10, (name, err)


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v3_plain_q"])
def test_deepseek_weights_and_kv_priced_as_loaded(hf_dirs, family):
    """DeepSeek-V3's latent attention, dense first layer and shared experts priced from
    config.json: the ledger's parameters are the model's (the correction bias, a buffer,
    is not a parameter), its bytes within 10% of the loaded state dict; the KV per token
    and layer is one latent row (kv_lora_rank + qk_rope_head_dim values), the engine
    pool's bytes per slot, in fp32 and in fp8 with its scale; LoRA counted as applied."""
    from orbitrl.model.lora import adapter_parameters, apply_lora

    path, ref = hf_dirs[family]
    hf = json.loads((path / "config.json").read_text())
    shape = from_config(hf)
    model = orbitrl.load_model(path)
    measured = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert shape.total_params == model.config.num_params == sum(
        p.numel() for p in ref.parameters())
    assert abs(shape.total_params * 4 / measured - 1) < 0.10
    latent = hf["kv_lora_rank"] + hf["qk_rope_head_dim"]
    assert shape.kv_latent == latent == model.config.kv_layout[1]
    for kv_dtype, elem, scale in ((None, 4, 0), ("fp8", 1, 4)):
        cache = Engine(model, kv_budget_bytes=1 << 20, block_size=4, kv_dtype=kv_dtype).cache
        assert cache.v is None
        per_slot = cache.nbytes // cache.k.shape[1]
        assert per_slot == kv_bytes_per_token(shape.num_layers, shape.num_kv_heads,
                                              shape.head_dim, "fp8" if kv_dtype else "float32",
                                              scale, shape.kv_latent)
        assert per_slot == shape.num_layers * (latent * elem + scale)
    apply_lora(model, rank=4)
    assert shape.adapter_params(4) == sum(p.numel() for p in adapter_parameters(model))


def test_deepseek_triton_refused_with_one_line(hf_dirs):
    from orbitrl.errors import OrbitError

    model = orbitrl.load_model(hf_dirs["deepseek_v3"][0])
    with pytest.raises(OrbitError, match="latent KV rows .*kv_lora_rank.*'torch'") as e:
        Engine(model, kv_budget_bytes=1 << 20, attention_backend="triton")
    assert "\n" not in str(e.value)
    assert Engine(model, kv_budget_bytes=1 << 20).attention_backend == "torch"
