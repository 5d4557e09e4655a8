"""Gradient and update norms: one host sync, the same numbers as summing one by one."""

import math

import torch

from orbitrl.rl.guards import Snapshot, layer_grad_norms


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    names = ["model.layers.0.self_attn.q_proj.lora_A.weight",
             "model.layers.0.mlp.up_proj.lora_B.weight",
             "model.layers.1.self_attn.q_proj.lora_A.weight", "lm_head.weight"]
    out = []
    for n in names:
        p = torch.nn.Parameter(torch.randn(7, 5, generator=g))
        p.grad = torch.randn(7, 5, generator=g) * 1e-3
        out.append((n, p))
    out.append(("model.layers.2.mlp.down_proj.lora_A.weight", torch.nn.Parameter(torch.ones(2))))
    return out  # (the last one has no gradient)


def test_layer_grad_norms_per_layer_as_one_by_one():
    named = _params()
    want: dict = {}
    for name, p in named:
        if p.grad is not None:
            key = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else "lm_head"
            want[key] = want.get(key, 0.0) + float(p.grad.pow(2).sum())
    got = layer_grad_norms(named)
    assert got == {k: math.sqrt(v) for k, v in want.items()}  # bit for bit
    assert set(got) == {"model.layers.0", "model.layers.1", "lm_head"}


def test_update_size_as_one_by_one():
    params = [p for _, p in _params()]
    snap = Snapshot(params)
    with torch.no_grad():
        for p in params:
            p.add_(0.01)
    d2 = sum(float((p - s).pow(2).sum()) for s, p in zip(snap.saved, params))
    w2 = sum(float(s.pow(2).sum()) for s in snap.saved)
    out = snap.update_size()
    assert out["update_norm"] == math.sqrt(d2)
    assert out["update_rel"] == math.sqrt(d2) / math.sqrt(w2)
    assert Snapshot([]).update_size()["update_norm"] == 0.0


# ---- the heartbeat on its own -------------------------------------------------------------
def test_heartbeat_lets_the_warmup_through_then_vetoes_a_spike():
    from orbitrl.rl.guards import GradNormGuard

    g = GradNormGuard(factor=5.0, warmup=3, beta=0.5)
    for n in (1.0, 100.0, 1.0):  # warm-up: no running mean to compare with yet
        assert g.ok(n)
        g.accept(n)
    assert g.mean == 0.5 * (0.5 * 1.0 + 0.5 * 100.0) + 0.5 * 1.0  # 25.75
    assert g.ok(5 * g.mean - 1e-9) and not g.ok(5 * g.mean + 1e-6)
    assert (g.skipped_spike, g.skipped_nonfinite) == (1, 0)
    mean = g.mean
    assert not g.ok(float("nan")) and not g.ok(float("inf"))
    assert (g.skipped_spike, g.skipped_nonfinite) == (1, 2)
    assert g.mean == mean and g.count == 3  # a vetoed step moves no statistic


def test_heartbeat_names_the_layer_that_spiked_and_its_state_round_trips():
    from orbitrl.rl.guards import GradNormGuard

    g = GradNormGuard(warmup=0)
    g.accept(2.0, {"model.layers.0": 1.0, "model.layers.1": 1.0, "lm_head": 1.0})
    assert g.worst_layer({"model.layers.0": 1.5, "model.layers.1": 9.0, "lm_head": 2.0}) \
        == ("model.layers.1", 9.0)
    assert not g.ok(10.1) and g.ok(10.0)
    h = GradNormGuard(warmup=0)
    h.load_state_dict(g.state_dict())
    assert h.state_dict() == g.state_dict() and not h.ok(10.1)


# ---- anchors on their own -----------------------------------------------------------------
def _lora_model():
    from orbitrl.model import load_model
    from orbitrl.model.builtin import resolve_model_path
    from orbitrl.model.lora import adapter_parameters, apply_lora

    torch.manual_seed(0)
    model = load_model(resolve_model_path("builtin:tiny-arith"))
    apply_lora(model, rank=4)
    with torch.no_grad():  # B starts at zero: move the policy off the base
        for p in adapter_parameters(model):
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _logits(model):
    with torch.no_grad():
        return model(torch.arange(1, 9)[None]).float()


def test_anchor_is_the_base_until_refreshed_then_the_policy_it_snapshotted():
    from orbitrl.model.lora import adapter_parameters, adapters_disabled
    from orbitrl.rl.anchors import Anchors

    model = _lora_model()
    with adapters_disabled(model):
        base = _logits(model)
    policy = _logits(model)
    assert not torch.allclose(base, policy)
    a = Anchors(model, None, refresh_steps=0, kl_threshold=0.3)
    with a.anchored() as ref:
        assert torch.equal(_logits(ref), base)
    a.refresh(3, "test")
    with torch.no_grad():  # the policy moves on after the refresh
        for p in adapter_parameters(model):
            p.add_(0.05)
    moved = [p.detach().clone() for p in adapter_parameters(model)]
    with a.anchored() as ref:
        assert torch.equal(_logits(ref), policy)  # the snapshot, not the base or the live one
    # the live adapters are back after the block
    assert all(torch.equal(p, q) for p, q in zip(adapter_parameters(model), moved))
    assert a.events == [{"step": 3, "reason": "test", "kl": None}] and a.last_refresh == 3


def test_anchor_refreshes_on_drift_and_on_schedule_and_its_state_round_trips():
    from orbitrl.rl.anchors import Anchors

    model = _lora_model()
    a = Anchors(model, None, refresh_steps=10, kl_threshold=0.3)
    assert a.maybe_refresh(1, 0.1) is None
    assert a.maybe_refresh(2, 0.31) == "kl_drift" and a.last_refresh == 2
    assert a.maybe_refresh(11, 0.0) is None
    assert a.maybe_refresh(12, 0.0) == "schedule" and a.last_refresh == 12
    b = Anchors(model, None, refresh_steps=10, kl_threshold=0.3)
    b.load_state_dict(a.state_dict())
    assert b.last_refresh == 12 and [e["reason"] for e in b.events] == ["kl_drift", "schedule"]
    assert all(torch.equal(x, y) for x, y in zip(a.snapshot, b.snapshot))
    assert b.maybe_refresh(21, 0.0) is None and b.maybe_refresh(22, 0.0) == "schedule"
