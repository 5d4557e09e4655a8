"""Layouts (replicated vs sharded frozen base), the elastic KV pool and the auto micro batch."""

import math

import pytest

from orbitrl.ledger import models
from orbitrl.ledger.bandwidth import Links, ring_gather_bytes
from orbitrl.ledger.bill import phase_terms
from orbitrl.ledger.bill import predict_peak
from orbitrl.ledger.memory import Strategy, Workload, kv_block_bytes, state_bytes
from orbitrl.ledger.plan import Cluster, Options, plan
from orbitrl.ledger.timing import auto_micro_batch, bandwidth_bill

GB = 1e9
INT4 = Strategy("adapter", base_dtype="int4")


def test_replicated_base_holds_a_copy_per_tp_group_and_gathers_nothing():
    s = models.known("llama3-8b")
    w = Workload(micro_batch=1)
    rep = phase_terms(s, INT4, w, devices=16, prefetch_depth=2, tp=2, replicate_base=True)
    shd = phase_terms(s, INT4, w, devices=16, prefetch_depth=2, tp=2)
    a = s.adapter_params(16)
    base = state_bytes(s, INT4).weights - 2 * a
    assert rep["train"]["actor:weights"] == math.ceil(base / 2) + math.ceil(2 * a / 16)
    assert "comm_buffers:gather" not in rep["train"] and "comm_buffers:gather" in shd["train"]
    bw = bandwidth_bill(s, INT4, w, Links(), Options(), 16, 2, replicated=True)
    assert not any("all-gather" in t.name for t in bw["transfers"])


def test_sharded_gathers_once_per_pass_per_micro_step():
    s = models.from_params(1.6e12)
    w = Workload(micro_batch=2)
    bw = bandwidth_bill(s, INT4, w, Links(), Options(), 8, 1, replicated=False)
    micro = math.ceil(bw["tokens"] / (8 * 2 * w.seq_len))
    assert bw["micro_steps"] == micro
    one = ring_gather_bytes(s.gathered_layer_params * s.num_layers * INT4.bytes_per_param(), 8)
    t = {x.name: x for x in bw["transfers"]}
    assert t["train all-gather"].bytes == pytest.approx(2 * micro * one, rel=1e-9)
    assert t["score all-gather"].bytes == pytest.approx(micro * one, rel=1e-9)
    # the frozen base never re-lays out: only the adapters move
    assert t["re-layout train<->generate (adapters)"].bytes < 1e9


def test_planner_prefers_a_replicated_base_and_can_be_told_otherwise():
    s, c = models.known("llama3-8b"), Cluster(16, 80 * GB)
    auto = plan(s, INT4, Workload(), c)
    assert auto.fits and auto.replicated and auto.layout()["weights"] == "replicated"
    assert auto.execution[0]["parallel"]["generation"]["dp"] == 16 // auto.tp
    forced = plan(s, INT4, Workload(), c, Options(base_layout="sharded"))
    assert forced.fits and not forced.replicated
    assert any("all-gather" in t["name"] for t in forced.timing["bandwidth"]["transfers"])
    with pytest.raises(ValueError):
        Options(base_layout="mirrored")


def test_elastic_pool_is_capped_by_the_step_and_by_memory():
    s = models.known("llama3-8b")
    small = plan(s, INT4, Workload(), Cluster(8, 80 * GB))  # room for the whole step
    kv = small.kv_pool
    assert kv["mode"] == "elastic" and kv["concurrent_seqs"] == kv["need_seqs"] == 512
    assert small.per_device_bytes < small.cluster.usable
    tight = plan(s, INT4, Workload(), Cluster(1, 24 * GB))  # the pool takes what is left
    kv = tight.kv_pool
    assert tight.fits and kv["reserve_seqs"] == 8 < kv["concurrent_seqs"] < kv["need_seqs"]
    assert tight.cluster.usable - tight.per_device_bytes < kv_block_bytes(s, "bf16") + 0.1 * GB
    assert tight.static_per_device_bytes < tight.per_device_bytes <= tight.cluster.usable


def test_auto_micro_batch_hides_gathers_or_is_one():
    s = models.from_params(1e12)
    opts = Options()
    w = Workload()
    assert auto_micro_batch(s, Strategy("stateless"), w, Links(), opts, 100, 4) > 1
    assert auto_micro_batch(s, Strategy("stateless"), w, Links(), opts, 4, 4) == 1  # dp 1
    assert auto_micro_batch(s, INT4, w, Links(), opts, 16, 8, replicated=True) == 1
    p = plan(s, Strategy("stateless"), w, Cluster(100, 80 * GB))
    assert p.workload.micro_batch > 1 and p.micro_batch_auto
    b = p.timing["breakdown"]
    assert b["exposed_comm_s"] < 0.05 * b["step_s"]


def test_predict_peak_takes_the_engines_pool():
    cfg = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 128, "vocab_size": 1000}
    w = Workload(prompt_len=16, completion_len=16, rollout_seqs=4, micro_batch=2)
    shape = models.from_config(cfg)
    base = predict_peak(cfg, "stateless", w)
    more = predict_peak(cfg, "stateless", w, kv_blocks=100)
    assert more["terms"]["rollout"]["rollout_kv:blocks"] == 100 * kv_block_bytes(shape, "bf16")
    assert base["terms"]["rollout"]["rollout_kv:blocks"] == 4 * 2 * kv_block_bytes(shape, "bf16")
