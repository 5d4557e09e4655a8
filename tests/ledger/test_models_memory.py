"""Shapes from config dicts, known names and counts; the per-phase prediction the runtime calls."""

import json

import pytest

from orbitrl.ledger import kv, models
from orbitrl.ledger.bill import predict_peak
from orbitrl.ledger.memory import (Strategy, Workload, activation_bytes, kv_cache_bytes,
                                   state_bytes)

QWEN_TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1000,
             "tie_word_embeddings": True}


def test_known_shapes_match_published_counts():
    assert models.known("Llama3-8B").total_params == pytest.approx(8.03e9, rel=0.01)
    assert models.known("qwen2.5-7b").total_params == pytest.approx(7.62e9, rel=0.01)
    k2 = models.known("kimi-k2")
    assert k2.total_params == pytest.approx(1.03e12, rel=0.05) and k2.active_params < 0.05e12
    with pytest.raises(ValueError, match="known"):
        models.known("gpt-9")


def test_from_config_counts_every_weight():
    s = models.from_config(QWEN_TINY)
    h, kvd, f, v = 64, 32, 128, 1000
    layer = 2 * h * h + 2 * h * kvd + 3 * h * f + 2 * h
    assert s.total_params == v * h + 2 * layer + h


def test_load_model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_TINY))
    assert models.load_model_dir(str(tmp_path)).num_layers == 2


def test_from_params_keeps_total_exact():
    for p in (1e9, 7e10, 1e12):
        s = models.from_params(p)
        assert s.total_params == int(p) and s.num_heads % 8 == 0
    moe = models.from_params(1e12, moe_experts=384)
    assert moe.total_params == int(1e12) and moe.active_params < 0.1 * moe.total_params
    assert moe.gathered_layer_params < 0.05 * moe.layer_params  # experts stay expert-parallel


def test_parse_count():
    assert models.parse_count("1e12") == 10**12
    assert models.parse_count("1.6T") == 1_600_000_000_000
    assert models.parse_count("70B") == 70 * 10**9
    for bad in ("-1", "0", "x"):
        with pytest.raises(ValueError):
            models.parse_count(bad)


def test_kv_matches_engine_formula():
    s = models.from_config(QWEN_TINY)
    block = kv.kv_bytes_per_block(2, 2, 16, 16, "bf16")
    assert kv_cache_bytes(s, seqs=3, seq_len=40, kv_dtype="bf16") == 3 * 3 * block
    assert kv_cache_bytes(s, 3, 40, "fp8") < kv_cache_bytes(s, 3, 40, "bf16")


def test_recompute_shrinks_activations():
    s = models.known("llama3-8b")
    assert activation_bytes(s, 4096, True) < 0.5 * activation_bytes(s, 4096, False)


def test_strategies_order():
    s = models.known("llama3-8b")
    bills = {k: state_bytes(s, Strategy(k, base_dtype="int4")).total
             for k in ("adamw", "stateless", "adapter")}
    assert bills["adamw"] == pytest.approx(16 * s.total_params, rel=1e-9)
    assert bills["stateless"] == pytest.approx(2 * s.total_params, rel=1e-9)
    assert bills["adapter"] < bills["stateless"] < bills["adamw"]
    with pytest.raises(ValueError):
        Strategy("sgd")


def test_predict_peak_from_config_dict():
    w = Workload(prompt_len=16, completion_len=16, rollout_seqs=8, micro_batch=4)
    out = predict_peak(QWEN_TINY, "adamw", w)
    assert set(out) >= {"rollout", "score", "train", "peak", "terms"}
    assert out["peak"] == max(out["rollout"], out["score"], out["train"])
    assert out["terms"]["train"]["actor:optimizer"] > 0
    lean = predict_peak(QWEN_TINY, Strategy("adapter"), w)
    assert lean["train"] < out["train"]
