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
