"""The planner's terms for one rank of a sharded run (ledger/memory.py
``sharded_runtime_terms``), checked against hand-computed bytes. The measured side is
benchmarks/bench_dist_memory.py (per-rank peaks of a 2-rank run against one process)."""

from __future__ import annotations

import math

import pytest

from orbitrl.config import load_config
from orbitrl.ledger.memory import largest_tensor_params
from orbitrl.ledger.runtime import runtime_prediction
from orbitrl.ledger.models import from_config

HF = dict(model_type="llama", vocab_size=128, hidden_size=512, intermediate_size=1536,
          num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=8,
          max_position_embeddings=64, tie_word_embeddings=True)


def predict(mode: str, devices: int, device: str = "cpu", *sets):
    cfg = load_config(None, [f"train.mode={mode}", "rollout.prompts_per_step=4",
                             "rollout.n=2", "rollout.max_tokens=4", *sets])
    return runtime_prediction(cfg, HF, 8, kv_blocks=4, device=device, devices=devices)


def test_full_mode_rank_of_two():
    s = from_config(HF)
    layer = s.layer_params * 4
    one, two = predict("full", 1, "cpu", "model.base_dtype=fp32"), \
        predict("full", 2, "cpu", "model.base_dtype=fp32")
    t1, t2 = one["terms"]["train"], two["terms"]["train"]
    assert t1["actor:weights"] == s.total_params * 4
    assert t2["actor:weights"] == math.ceil(s.total_params * 4 / 2)
    assert t2["comm_buffers:gather"] == 2 * layer  # computing + prefetched layer
    assert t2["comm_buffers:gather_staging"] == int(layer * 1.5)  # flat output + my shard
    assert t2["comm_buffers:root"] == (s.embed_params + s.hidden) * 4
    assert t2["actor:layer_grad"] == 0  # gloo: never at the same moment as a gather
    # AdaLomo, grouped clip: the gradient and g^2 or u (ledger/runtime.py update_copies)
    assert t1["actor:update_workspace"] == 2 * largest_tensor_params(s) * 4
    assert t2["actor:update_workspace"] == 2 * math.ceil(largest_tensor_params(s) / 2) * 4
    # the int8 reference stays whole on every rank
    assert t1["host:reference:weights"] == t2["host:reference:weights"]
    # each rank takes half the samples: one micro-batch of 4 instead of 8
    assert t1["activations:saved"] == 2 * t2["activations:saved"]
    assert two["peak"] < one["peak"]


def test_overlapping_collectives_count_the_gradient_copies():
    s = from_config(HF)
    t = predict("full", 2, "cuda", "model.base_dtype=fp32")["terms"]["train"]
    assert t["actor:layer_grad"] == 2 * s.layer_params * 4


@pytest.mark.parametrize("base,replicated", [("nf4", True), ("int8", True), ("fp32", False)])
def test_adapter_base_replicated_unless_plain(base, replicated):
    one = predict("adapter", 1, "cpu", f"model.base_dtype={base}")["terms"]["score"]
    two = predict("adapter", 2, "cpu", f"model.base_dtype={base}")["terms"]["score"]
    if replicated:  # the quantized projections (buffers) stay whole: well over half remains
        assert two["actor:weights"] > 0.5 * one["actor:weights"] + 1
    else:
        assert abs(two["actor:weights"] - one["actor:weights"] / 2) <= 1


def test_gathered_rollout_holds_the_whole_weights():
    s = from_config(HF)
    sharded = predict("full", 2, "cpu", "model.base_dtype=fp32")["terms"]["rollout"]
    whole = predict("full", 2, "cpu", "model.base_dtype=fp32",
                    "dist.rollout_weights=gathered")["terms"]["rollout"]
    assert sharded["comm_buffers:gather"] == 2 * s.layer_params * 4
    assert whole["comm_buffers:gather"] == s.total_params * 4
    assert whole["actor:weights"] == sharded["actor:weights"]  # the shard stays too


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_prefetch_depth_prices_one_gathered_layer_each(k):
    """``dist.prefetch_layers`` k: the computing layer plus k gathered ahead, in every phase
    (tests/distributed/rank_checks.py ``prefetch_depth`` counts them in a 2-rank run)."""
    layer = from_config(HF).layer_params * 4
    terms = predict("full", 2, "cpu", "model.base_dtype=fp32",
                    f"dist.prefetch_layers={k}")["terms"]
    for ph in ("rollout", "score", "train"):
        assert terms[ph]["comm_buffers:gather"] == (k + 1) * layer
