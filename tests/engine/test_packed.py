"""The engine's oneDNN path for frozen fp32 nn.Linear weights on a CPU (engine/packed.py):
the same outputs as F.linear to fp32 rounding, each row's bits independent of the row count,
a weight changed in place seen at the next step, F.linear for other threads and for calls that need
gradients, and the engine's tokens and logprobs unchanged."""

import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import orbitrl
from orbitrl.engine import Engine, SamplingParams
from orbitrl.engine.packed import PackedLinears, available
from hf_helpers import GREEDY, random_prompts

pytestmark = pytest.mark.skipif(not available(), reason="this torch build has no oneDNN")


def _frozen_model(hf_dirs):
    return orbitrl.load_model(hf_dirs["qwen2"][0])


def test_packed_linear_matches_f_linear_and_is_row_invariant(hf_dirs):
    model = _frozen_model(hf_dirs)
    packed = PackedLinears(model, 1 << 30)
    mods = [m for m in model.modules() if type(m) is nn.Linear]
    assert packed and packed.mods == mods and packed.bytes == 0
    x = torch.randn(40, mods[0].in_features)
    with torch.inference_mode(), packed:
        m = mods[0]
        assert type(m.forward).__name__ == "_Forward"
        full = m(x)
        torch.testing.assert_close(full, F.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)
        for rows in range(1, 40):
            assert torch.equal(m(x[:rows]), full[:rows]), rows
        assert torch.equal(m(x[None, :7]), full[None, :7])  # leading dims kept
    assert "forward" not in m.__dict__  # the class's forward again
    attn = model.model.layers[0].self_attn  # q, k, v packed as one weight
    assert packed.bytes == sum(p.weight.numel() * 4 for p in (attn.q_proj, attn.k_proj,
                                                               attn.v_proj))


def test_sibling_projections_run_as_one_gemm(hf_dirs):
    model = _frozen_model(hf_dirs)
    packed = PackedLinears(model, 1 << 30)
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    units = {tuple(id(m) for m in u) for u in packed.units}
    assert tuple(map(id, (attn.q_proj, attn.k_proj, attn.v_proj))) in units
    assert tuple(map(id, (mlp.gate_proj, mlp.up_proj))) in units
    assert (id(attn.o_proj),) in units and (id(mlp.down_proj),) in units
    x = torch.randn(1, 7, attn.q_proj.in_features)
    with torch.inference_mode(), packed:
        outs = [p(x) for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
        # one GEMM: k and v are columns of the output q came from
        base = outs[0].untyped_storage().data_ptr()
        assert all(o.untyped_storage().data_ptr() == base for o in outs)
        for p, o in zip((attn.q_proj, attn.k_proj, attn.v_proj), outs):
            assert o.shape == (1, 7, p.out_features)
            torch.testing.assert_close(o, F.linear(x, p.weight, p.bias), rtol=1e-5, atol=1e-5)
    with torch.no_grad(), packed:
        y = torch.randn(1, 7, attn.q_proj.in_features)
        k_alone = attn.k_proj(y)  # another input, k first: the group's GEMM again
        assert torch.equal(k_alone, attn.k_proj(y)) and torch.equal(attn.q_proj(y)[0, :3],
                                                                   attn.q_proj(y[:, :3])[0])
        torch.testing.assert_close(k_alone, F.linear(y, attn.k_proj.weight, attn.k_proj.bias),
                                   rtol=1e-5, atol=1e-5)
        y.add_(1)  # changed in place: not served from the step's outputs
        torch.testing.assert_close(attn.v_proj(y), F.linear(y, attn.v_proj.weight,
                                                            attn.v_proj.bias),
                                   rtol=1e-5, atol=1e-5)
    assert not packed._stash  # dropped at the end of the step


def test_weight_changed_in_place_is_seen_and_other_callers_get_f_linear(hf_dirs):
    model = _frozen_model(hf_dirs)
    m = model.lm_head
    packed = PackedLinears(model, 1 << 30)
    x = torch.randn(5, m.in_features)
    with torch.no_grad():
        with packed:
            before = m(x)
        m.weight.mul_(-2)  # an optimizer step between two steps, in place
        with packed:
            after = m(x)
        torch.testing.assert_close(after, F.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(before, after)
        other = {}
        for key, fn in (("y", m), ("ref", lambda x: F.linear(x, m.weight, m.bias))):
            t = threading.Thread(target=lambda: other.setdefault(key, fn(x)))
            t.start()
            t.join()
        assert torch.equal(other["y"], other["ref"])  # another thread: F.linear's bits
    xg = torch.randn(5, m.in_features, requires_grad=True)
    with packed:
        m(xg).sum().backward()  # gradients: F.linear, so they flow
    assert xg.grad is not None
    torch.testing.assert_close(xg.grad, m.weight.detach().sum(0).expand(5, -1))


def test_what_is_packed(hf_dirs):
    lin, frozen = nn.Linear(8, 4), nn.Linear(8, 4).requires_grad_(False)
    half = nn.Linear(8, 4).to(torch.bfloat16)
    view = nn.Linear(8, 4)
    view.weight = nn.Parameter(torch.zeros(3, 4, 8)[1])  # a view into a stack (experts)

    class Sub(nn.Linear):  # a subclass has its own forward: left alone
        pass

    model = nn.Sequential(lin, frozen, half, Sub(8, 4), view)
    assert PackedLinears(model, 1 << 20).mods == [lin, frozen]
    assert not PackedLinears(model, 16)  # over the budget: nothing
    assert not PackedLinears(model, 0)
    packed = PackedLinears(model, 1 << 20)
    h = lin.register_forward_hook(lambda *a: None)  # tiers and sharding work through hooks
    packed.reset()
    assert not packed
    h.remove()
    packed.reset()
    assert packed

    from orbitrl.model.lora import apply_lora

    lora = _frozen_model(hf_dirs)
    apply_lora(lora, rank=4)
    names = {id(m): n for n, m in lora.named_modules()}
    got = {names[id(m)].rsplit(".", 1)[-1] for m in PackedLinears(lora, 1 << 30).mods}
    assert got == {"base_layer", "lm_head"}  # not lora_A / lora_B


def test_weights_changed_without_a_version_are_seen_at_the_next_generate(hf_dirs):
    model = _frozen_model(hf_dirs)
    prompts = random_prompts([6, 9])
    params = SamplingParams(max_tokens=8, **GREEDY)
    eng = Engine(model, kv_budget_bytes=1 << 20)
    ref = Engine(model, kv_budget_bytes=1 << 20, packed_bytes=0)
    eng.generate(prompts, params)
    with torch.no_grad():
        for p in model.parameters():
            p.data.copy_(p.data.flip(0) if p.dim() == 2 else p.data)  # no version bump
    a, b = eng.generate(prompts, params), ref.generate(prompts, params)
    assert [o.samples[0].token_ids for o in a] == [o.samples[0].token_ids for o in b]


def test_copies_are_kept_across_batches_until_a_weight_moves(hf_dirs):
    model = _frozen_model(hf_dirs)
    prompts, params = random_prompts([6, 9]), SamplingParams(max_tokens=4, **GREEDY)
    eng = Engine(model, kv_budget_bytes=1 << 20)
    ref = Engine(model, kv_budget_bytes=1 << 20, packed_bytes=0)
    eng.generate(prompts, params)
    first = {i: hit[2] for i, hit in eng.packed._packed.items()}
    assert len(first) == len(eng.packed.units) and eng.summary()["packed_bytes"] > 0
    eng.generate(prompts, params)  # nothing changed: the same copies serve the next batch
    assert all(eng.packed._packed[i][2] is t for i, t in first.items())
    # a fused optimizer step bumps no version: only the fingerprint sees it
    head = model.lm_head.weight
    version = head._version
    opt = torch.optim.Adam([head], lr=1e-2, fused=True)
    head.grad = torch.randn_like(head)
    opt.step()
    head.grad = None
    assert head._version == version
    a, b = eng.generate(prompts, params), ref.generate(prompts, params)
    assert [o.samples[0].token_ids for o in a] == [o.samples[0].token_ids for o in b]
    kept = [i for i, t in first.items() if eng.packed._packed[i][2] is t]
    head_unit = next(id(u) for u in eng.packed.units if u == (model.lm_head,))
    assert head_unit not in kept and len(kept) == len(first) - 1
    eng.weights_changed(recompute=False)  # drops every copy
    assert eng.packed.bytes == 0


def test_weights_made_in_inference_mode_run_unpacked(hf_dirs):
    with torch.inference_mode():
        model = orbitrl.load_model(hf_dirs["qwen2"][0])
        eng = Engine(model, kv_budget_bytes=1 << 20)
        out = eng.generate(random_prompts([6]), SamplingParams(max_tokens=5, **GREEDY))
    assert len(out[0].samples[0].token_ids) == 5 and eng.summary()["packed_bytes"] == 0


def test_engine_with_and_without_packing(hf_dirs):
    model = _frozen_model(hf_dirs)
    prompts = random_prompts([3, 17, 9, 33])
    params = SamplingParams(n=2, max_tokens=12, **GREEDY)
    a = Engine(model, kv_budget_bytes=1 << 20)
    b = Engine(model, kv_budget_bytes=1 << 20, packed_bytes=0)
    outs_a, outs_b = a.generate(prompts, params), b.generate(prompts, params)
    assert a.summary()["packed_bytes"] > 0 and b.summary()["packed_bytes"] == 0
    for oa, ob in zip(outs_a, outs_b):
        for sa, sb in zip(oa.samples, ob.samples):
            assert sa.token_ids == sb.token_ids
            assert max(abs(x - y) for x, y in zip(sa.raw_logprobs, sb.raw_logprobs)) < 1e-5
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_short_steps_padded_to_min_rows_give_the_unpadded_bits(hf_dirs, monkeypatch):
    """While packed, a step of fewer than MIN_ROWS tokens runs its GEMMs and its head on
    MIN_ROWS rows (the faster shape) and a step of 5-11 on its own rows: the samples'
    bits are those of running every step on its own rows."""
    model = _frozen_model(hf_dirs)
    prompts = random_prompts([3, 17, 9])
    lengths = {0: [2, 9, 1], 1: [5, 12, 3], 2: [7, 4, 11]}  # the batch shrinks 9 -> 1
    stop = lambda i, j, c: len(c) >= lengths[i][j]  # noqa: E731
    params = SamplingParams(n=3, max_tokens=12, seed=5, ignore_eos=True)
    rows = []
    real = torch.ops.mkldnn._linear_pointwise

    def counted(x, *a):
        rows.append(x.numel() // x.shape[-1])
        return real(x, *a)

    runs = []
    for min_rows in (PackedLinears.MIN_ROWS, 1):
        monkeypatch.setattr(PackedLinears, "MIN_ROWS", min_rows)
        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", counted)
        rows.clear()
        eng = Engine(model, kv_budget_bytes=1 << 20)
        outs = eng.generate(prompts, params, stop_fn=stop)
        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", real)
        runs.append([(s.token_ids, s.logprobs, s.raw_logprobs) for o in outs
                     for s in o.samples])
        assert (min(rows) >= 4) == (min_rows == 4), sorted(set(rows))
        assert any(5 <= r < 8 for r in rows)  # not padded to a multiple of 4
    assert runs[0] == runs[1]


def test_fused_group_with_mixed_biases_and_a_missing_member():
    torch.manual_seed(0)
    attn = nn.Module()
    attn.q_proj, attn.k_proj, attn.v_proj = nn.Linear(8, 6), nn.Linear(8, 4, bias=False), \
        nn.Linear(8, 4)
    mlp = nn.Module()
    mlp.gate_proj, mlp.up_proj = nn.Linear(8, 5), nn.Linear(6, 5)  # widths differ: alone
    model = nn.Sequential(attn, mlp)
    packed = PackedLinears(model, 1 << 20)
    assert [len(u) for u in packed.units] == [3, 1, 1]
    x = torch.randn(3, 8)
    with torch.no_grad(), packed:
        for p in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj):
            torch.testing.assert_close(p(x), F.linear(x, p.weight, p.bias), rtol=1e-5,
                                       atol=1e-6)
        with torch.no_grad():
            attn.k_proj.weight.add_(1)
    with torch.no_grad(), packed:  # the next step sees the change
        torch.testing.assert_close(attn.k_proj(x), F.linear(x, attn.k_proj.weight),
                                   rtol=1e-5, atol=1e-6)


def test_bias_changed_without_a_version_is_seen_at_the_next_batch():
    torch.manual_seed(1)
    attn = nn.Module()
    attn.q_proj, attn.k_proj, attn.v_proj = nn.Linear(8, 6), nn.Linear(8, 4), nn.Linear(8, 4)
    attn.o_proj = nn.Linear(6, 8)
    packed = PackedLinears(attn, 1 << 20)
    x, h = torch.randn(3, 8), torch.randn(3, 6)
    with torch.no_grad(), packed:
        attn.k_proj(x), attn.o_proj(h)
    for p in (attn.k_proj.bias, attn.o_proj.bias):
        version = p._version
        p.data.add_(1)  # no version bump
        assert p._version == version
    packed.reset()  # the next batch
    with torch.no_grad(), packed:
        for m, inp in ((attn.k_proj, x), (attn.o_proj, h)):
            torch.testing.assert_close(m(inp), F.linear(inp, m.weight, m.bias), rtol=1e-5,
                                       atol=1e-6)


def test_one_fused_output_is_held_at_a_time():
    torch.manual_seed(2)
    layers = [nn.Module() for _ in range(3)]
    for m in layers:
        m.gate_proj, m.up_proj = nn.Linear(8, 16), nn.Linear(8, 16)
    model = nn.Sequential(*layers)
    packed = PackedLinears(model, 1 << 20)
    x = torch.randn(5, 8)
    with torch.no_grad(), packed:
        for m in layers:
            g, u = m.gate_proj(x), m.up_proj(x)
            torch.testing.assert_close(u, F.linear(x, m.up_proj.weight, m.up_proj.bias),
                                       rtol=1e-5, atol=1e-6)
        # only the last unit's outputs are kept (not one entry per layer)
        assert packed._stash[0] == id(packed.units[-1]) and packed._stash[1] is x


def test_fused_checkpoint_projections_pack_as_they_are(hf_dirs, monkeypatch):
    """Phi-3's qkv_proj and gate_up_proj are one linear each: each packs as a unit of its
    own, and a step's q and k (columns of one output) rotate as one view."""
    from orbitrl.model import decoder

    model = orbitrl.load_model(hf_dirs["phi3"][0])
    packed = PackedLinears(model, 1 << 30)
    layer = model.model.layers[0]
    units = {tuple(id(m) for m in u) for u in packed.units}
    assert (id(layer.self_attn.qkv_proj),) in units and (id(layer.mlp.gate_up_proj),) in units
    seen, real = [], decoder._side_by_side

    def spy(q, k):
        out = real(q, k)
        seen.append(out is not None)
        return out

    monkeypatch.setattr(decoder, "_side_by_side", spy)
    with torch.inference_mode(), packed:
        model(torch.tensor([[5, 9, 2, 7]]))
    assert seen and all(seen)
