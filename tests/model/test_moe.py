"""Mixtures of experts: export, sharded load, grouped experts, routing replay, router losses,
frozen experts (parity of the logits themselves is in test_parity.py, over every family)."""

import json

import pytest
import torch

import orbitrl
from hf_helpers import MOE_CONFIGS, gemm_rows_invariant
from orbitrl.errors import OrbitError
from orbitrl.model import moe
from orbitrl.model.config import ModelConfig

MOE = list(MOE_CONFIGS)


@pytest.mark.parametrize("family", MOE)
def test_export_round_trip_and_param_count(hf_dirs, family, tmp_path):
    from transformers import AutoModelForCausalLM

    path, ref = hf_dirs[family]
    ours = orbitrl.load_model(path)
    assert ours.config.num_params == sum(p.numel() for p in ref.parameters())
    orbitrl.save_pretrained(ours, tmp_path / "out")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    ids = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, ref(ids).logits)


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_sharded_checkpoint_matches_transformers(hf_dirs, family, tmp_path):
    """Shards written by transformers and by our export both load (experts split across
    files), and give transformers' logits."""
    from orbitrl.model.weights import save_pretrained

    _, ref = hf_dirs[family]
    ref.save_pretrained(tmp_path / "hf", max_shard_size="60KB")
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(5))
    for d in ("hf", "ours"):
        index = json.loads((tmp_path / d / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 2
        again = orbitrl.load_model(tmp_path / d)
        with torch.no_grad():
            assert (again(ids) - ref(ids).logits).abs().max().item() < 1e-5
        if d == "hf":
            save_pretrained(again, tmp_path / "ours", max_shard_bytes=40_000)


def test_grouped_experts_equal_per_token_sum():
    torch.manual_seed(0)
    experts = torch.nn.ModuleList(moe.Expert(16, 8, ("gate_proj", "up_proj", "down_proj"))
                                  for _ in range(5))
    x = torch.randn(13, 16)
    ids = torch.stack([torch.randperm(5)[:2] for _ in range(13)])
    ids[3] = torch.tensor([4, 4 - 1])  # every expert id reachable, one expert unused below
    ids[ids == 2] = 1
    w = torch.rand(13, 2)
    got = moe.grouped_experts(x, ids, w, experts)
    want = torch.stack([sum(w[n, j] * experts[int(ids[n, j])](x[n]) for j in range(2))
                        for n in range(13)])
    assert (got - want).abs().max().item() < 1e-6


def test_route_replays_ids_with_current_weights():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 1.0, 2.0]])
    ids, w = moe.route(logits, 2, norm=True)
    assert ids.tolist() == [[0, 1], [1, 3]]
    forced = torch.tensor([[2, 3], [-1, -1]])  # row 1: free
    ids2, w2 = moe.route(logits, 2, norm=True, ids=forced)
    assert ids2.tolist() == [[2, 3], [1, 3]]
    p = torch.softmax(logits, -1)
    assert torch.allclose(w2[0], p[0, [2, 3]] / p[0, [2, 3]].sum())
    assert torch.equal(w2[1], w[1])
    _, raw = moe.route(logits, 2, norm=False, ids=forced)
    assert torch.allclose(raw[0], p[0, [2, 3]])


@pytest.mark.parametrize("family", MOE)
def test_record_then_replay_reproduces_and_overrides(hf_dirs, family):
    path, _ = hf_dirs[family]
    m = orbitrl.load_model(path)
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(6))
    rec = moe.Routing(record=True)
    with torch.no_grad():
        free = m(ids, routing=rec)
        chosen = rec.chosen_tensor()
        S = len(m.config.moe.sparse_layers)
        assert chosen.shape == (S, 14, m.config.moe.top_k)
        assert torch.equal(m(ids, routing=moe.Routing(replay=chosen)), free)
        # another router: free routing changes; replaying the recorded choice keeps them
        for layer in m.model.layers:
            ffn = getattr(layer, layer.ffn_name)
            if isinstance(ffn, moe.SparseMoE):
                router = getattr(ffn, ffn.router_attr)  # "gate" ("router": gpt-oss)
                router.weight.copy_(torch.randn_like(router.weight))
        again = moe.Routing(record=True, replay=chosen)
        m(ids, routing=again)
        assert torch.equal(again.chosen_tensor(), chosen)
        moved = moe.Routing(record=True)
        m(ids, routing=moved)
        assert not torch.equal(moved.chosen_tensor(), chosen)


def test_load_balancing_loss_matches_transformers():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    g = torch.Generator().manual_seed(7)
    logits = [torch.randn(10, 6, generator=g) for _ in range(3)]
    ids = [torch.topk(torch.softmax(lg, -1), 2, -1).indices for lg in logits]
    want = load_balancing_loss_func(tuple(logits), 6, 2)
    got = moe.load_balancing_loss(logits, ids, 6)
    assert abs(float(got) - float(want)) < 1e-6
    mask = torch.tensor([1] * 7 + [0] * 3)
    want_m = load_balancing_loss_func(tuple(logits), 6, 2, attention_mask=mask[None])
    got_m = moe.load_balancing_loss(logits, ids, 6, valid=mask.bool())
    assert abs(float(got_m) - float(want_m)) < 1e-6
    z = moe.z_loss(logits)
    assert abs(float(z) - float(torch.stack([torch.logsumexp(lg, -1).pow(2).mean()
                                             for lg in logits]).mean())) < 1e-6


def test_router_losses_reach_the_router(hf_dirs):
    path, _ = hf_dirs["qwen3_moe"]
    m = orbitrl.load_model(path).train()
    moe.configure(m, aux_loss_coef=0.01, z_loss_coef=0.001)
    r = moe.replay_routing(m, None, aux=True)
    seq = torch.tensor([[0] * 5 + [-1] * 2])
    m(torch.randint(0, 97, (1, 7)), seq_ids=seq, routing=r)
    loss, metrics = moe.router_losses(m, r)
    assert metrics["router_aux_loss"] > 0 and metrics["router_z_loss"] > 0
    assert r.valid.tolist() == [True] * 5 + [False] * 2
    loss.backward()
    gate = m.model.layers[0].mlp.gate.weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0


def test_frozen_base_dequantizes_only_active_experts(hf_dirs, monkeypatch):
    from orbitrl.model.quant import FrozenLinear

    path, _ = hf_dirs["qwen3_moe"]
    m = orbitrl.load_model(path, base_format="int8")
    assert isinstance(m.model.layers[0].mlp.experts[5].down_proj, FrozenLinear)
    assert not isinstance(m.model.layers[0].mlp.gate, FrozenLinear)
    seen = []
    orig = FrozenLinear.dequantize
    monkeypatch.setattr(FrozenLinear, "dequantize",
                        lambda self, dtype=torch.float32: seen.append(id(self)) or orig(self, dtype))
    rec = moe.Routing(record=True)
    with torch.no_grad():
        m(torch.tensor([[3]]), routing=rec)  # one token: top-3 of 8 experts per layer
    chosen = rec.chosen_tensor()
    for li, layer in enumerate(m.model.layers):
        active = set(chosen[li, 0].tolist())
        for e, ex in enumerate(layer.mlp.experts):
            hit = [id(getattr(ex, n)) in seen for n in ex.names]
            assert all(hit) if e in active else not any(hit), (li, e)


@pytest.mark.parametrize("change,msg", [
    ({"num_experts_per_tok": 9}, "exceeds num_experts"),
    ({"moe_intermediate_size": None}, "'moe_intermediate_size' must be a positive integer"),
    ({"router_jitter_noise": 0.1}, "router_jitter_noise"),
])
def test_bad_moe_config_one_line_error(hf_dirs, change, msg):
    path, _ = hf_dirs["qwen3_moe"]
    hf = json.loads((path / "config.json").read_text())
    hf.pop("num_local_experts", None)
    hf["num_experts"] = 8
    hf.update(change)
    with pytest.raises(OrbitError, match=msg) as e:
        ModelConfig.from_hf(hf, "x/config.json")
    assert "\n" not in str(e.value) and "x/config.json" in str(e.value)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("min_rows", [10 ** 9, 1])
def test_packed_experts_equal_the_loop_and_follow_updates(hf_dirs, family, min_rows,
                                                          monkeypatch):
    """load_model stacks plain CPU fp32 experts (moe.pack_experts): the stacked path, grouped
    (few rows per expert) or expert by expert (``FUSED_MIN_ROWS``), gives the loop's outputs
    and gradients (input, router weights and every active expert's weights; none for the
    others), sees in-place updates, and steps aside for good when a weight is re-allocated.
    Qwen3's experts are narrower than the model (router weights applied inside the stacked
    backward), the tiny Mixtral's wider (applied to the output)."""
    monkeypatch.setattr(moe, "FUSED_MIN_ROWS", min_rows)
    path, _ = hf_dirs[family]
    layer = orbitrl.load_model(path).train().model.layers[0]
    blk = getattr(layer, layer.ffn_name)
    for p in blk.parameters():
        p.requires_grad_(True)
    E = len(blk.experts)
    x0 = torch.randn(12, 64, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ids, w0 = moe.route(blk.gate(x0), blk.top_k, blk.norm)
    idle = E - 1  # chosen by no token
    ids[:, 0] = ids[:, 0] % idle
    ids[:, 1:] = torch.where(ids[:, 1:] == idle, idle - 1 - ids[:, :1] % 2, ids[:, 1:])
    ids[:, 1:] = torch.where(ids[:, 1:] == ids[:, :1], (ids[:, :1] + 1) % idle, ids[:, 1:])

    def run(packed):
        blk.zero_grad()
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        out = moe.grouped_experts(x, ids, w, blk.experts, packed)
        (out * torch.linspace(-1, 1, 64)).sum().backward()
        grads = [None if p.grad is None else p.grad.clone() for p in blk.experts.parameters()]
        return out.detach(), x.grad, w.grad, grads

    packed = moe._packed_weights(blk)
    assert packed is not None
    (a, ga, wa, pa), (b, gb, wb, pb) = run(packed), run(None)
    assert (a - b).abs().max().item() < 1e-5 and (ga - gb).abs().max().item() < 1e-5
    assert (wa - wb).abs().max().item() < 1e-5 and wa.abs().max().item() > 1e-3
    for u, v in zip(pa, pb):
        assert (u is None) == (v is None)
        assert u is None or (u - v).abs().max().item() < 1e-5
    assert any(u is None for u in pa)  # the idle expert got no gradient, as in the loop
    with torch.no_grad():
        for ex in blk.experts:  # as an optimizer step updates them: in place
            getattr(ex, ex.names[1]).weight.mul_(2)
    (a2, *_), (b2, *_) = run(moe._packed_weights(blk)), run(None)
    assert (a2 - b2).abs().max().item() < 1e-5 and (a2 - a).abs().max().item() > 1e-3
    ex = blk.experts[1]
    wt = getattr(ex, ex.names[2]).weight
    wt.data = wt.data.clone()
    assert moe._packed_weights(blk) is None and blk.packed is None


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_sparse_layer_rows_do_not_depend_on_the_batch(hf_dirs, family):
    """A token's sparse-layer output is the same to the bit alone, in a few tokens or in a
    large batch (each expert's short slice padded to moe.row_count rows, the shared gate
    through a padded GEMM, SiLU and gpt-oss's clamped SwiGLU row by row): what lets an
    engine step of few tokens give the trainer's numbers (the routing-replay gap,
    docs/moe.md). The large batch runs the stacked experts one by one, the small ones
    grouped: both round a row alike (gpt-oss's biased experts are not stacked: the loop)."""
    from contextlib import nullcontext

    from orbitrl.engine.model_runner import RowPadded

    path, _ = hf_dirs[family]
    m = orbitrl.load_model(path)
    layer = m.model.layers[m.config.moe.sparse_layers[0]].mlp  # DeepSeek-V3: layer 0 dense
    x = torch.randn(1, 300, 64, generator=torch.Generator().manual_seed(8))
    m = layer.experts
    assert (layer.packed is not None) == (family != "gpt_oss")
    assert 300 * layer.top_k >= moe.FUSED_MIN_ROWS * len(m)
    # to the bit where this CPU's GEMMs round a row alike at the padded row counts (MKL's
    # AVX-512 kernels); on AVX2 within the ISA-independent bound
    exact = all(gemm_rows_invariant(k, nn) for k, nn in ((64, 32), (32, 64), (64, 48),
                                                          (48, 64)))
    with torch.no_grad():
        big = layer(x)[0]
    # (a few ulps of the output's size: DeepSeek-V3's routed scaling makes its rows larger)
    tol = 1e-6 * max(1.0, big.abs().max().item())
    same = torch.equal if exact else \
        (lambda a, b: torch.allclose(a, b, rtol=0, atol=tol))  # noqa: E731
    with torch.no_grad():
        for n in range(1, 40):  # below ROW_FLOOR tokens the engine pads every GEMM too
            with RowPadded() if n < moe.ROW_FLOOR else nullcontext():
                assert same(layer(x[:, :n])[0], big[:n]), f"{n} tokens"
    x.requires_grad_(True)  # the trainer's path (loop over experts, autograd)
    assert same(layer(x[:, :20])[0].detach(), big[:20])
    assert [moe.row_count(m) for m in (1, 3, 4, 5, 11, 12, 13)] == [4, 4, 4, 8, 12, 12, 13]


def test_deepseek_routing_against_transformers_router(hf_dirs):
    """route's grouped sigmoid choice and weights are transformers' DeepseekV3TopkRouter's
    (correction bias set, groups that exclude the best single expert's group at times);
    replayed ids take the current scores, and the bias never reaches the weights."""
    _, ref = hf_dirs["deepseek_v3"]
    gate = ref.model.layers[1].mlp.gate
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, want_w, want_i = gate(x)
        bias = gate.e_score_correction_bias
        assert bias.abs().min() > 0
        ids, w = moe.route(logits, 2, True, grouped=(bias, 4, 2, 2.5))
        order = want_i.argsort(-1)
        assert torch.equal(ids.sort(-1).values, want_i.gather(1, order))
        assert torch.allclose(w.gather(1, ids.argsort(-1)), want_w.gather(1, order), atol=1e-7)
        free, _ = moe.route(logits, 2, True, grouped=(torch.zeros_like(bias), 4, 2, 2.5))
        assert not torch.equal(free.sort(-1).values, ids.sort(-1).values)  # the bias chooses
        forced = torch.tensor([[6, 7]] * 39 + [[-1, -1]])
        ids2, w2 = moe.route(logits, 2, True, ids=forced, grouped=(bias, 4, 2, 2.5))
        s = logits[0, [6, 7]].sigmoid()
        assert torch.allclose(w2[0], 2.5 * s / s.sum()) and torch.equal(ids2[-1], ids[-1])
