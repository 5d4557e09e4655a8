"""LoRA over every frozen-base format: parity with LoRA over the dequantized base, gradients
on adapters only, target patterns, the disable switch, and rollout/training logprob agreement
through the very same modules."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import orbitrl
from orbitrl.errors import OrbitError
from orbitrl.model.lora import (LoRALinear, adapter_parameters, adapters_disabled, apply_lora,
                                lora_modules)
from orbitrl.model.quant import FrozenLinear
from test_quant import FMTS, error_bound


def _randomize(model_or_mods, std=0.05, seed=0):
    """Non-zero B (a trained adapter) so the adapter path is really exercised."""
    g = torch.Generator().manual_seed(seed)
    mods = model_or_mods.values() if isinstance(model_or_mods, dict) else \
        lora_modules(model_or_mods).values()
    with torch.no_grad():
        for m in mods:
            for p in (m.lora_A.weight, m.lora_B.weight):
                p.copy_(torch.randn(p.shape, generator=g) * std)


@pytest.mark.parametrize("fmt", FMTS)
def test_lora_over_format_matches_lora_over_dequantized(fmt):
    torch.manual_seed(0)
    w, b = torch.randn(96, 64) * 0.05, torch.randn(96) * 0.1
    q = LoRALinear(FrozenLinear(w, b, fmt), rank=4, alpha=8)
    ref = LoRALinear(nn.Linear(64, 96), rank=4, alpha=8)
    full = LoRALinear(nn.Linear(64, 96), rank=4, alpha=8)
    with torch.no_grad():
        ref.base_layer.weight.copy_(q.base_weight())
        full.base_layer.weight.copy_(w)
        for m in (ref, full):
            m.base_layer.bias.copy_(b)
    _randomize({"q": q})
    for m in (ref, full):
        m.lora_A.load_state_dict(q.lora_A.state_dict())
        m.lora_B.load_state_dict(q.lora_B.state_dict())
    x = torch.randn(3, 7, 64)
    y = q(x)
    assert (y - ref(x)).abs().max().item() < 1e-5
    # against the LoRA over the original weight: within the format's error, |x| @ bound
    bound = x.abs() @ error_bound(fmt, w).t()
    assert ((y - full(x)).abs() <= bound + 1e-5).all()
    # the flag: LoRALinear(linear, base_format=...) is the same module
    lin = nn.Linear(64, 96)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    flagged = LoRALinear(lin, 4, 8, base_format=fmt)
    assert isinstance(flagged.base_layer, FrozenLinear) and flagged.base_layer.fmt == fmt
    flagged.load_state_dict(q.state_dict())
    assert torch.equal(flagged(x), y)
    # the merged weight reproduces the forward
    st = q.dequantized_state()
    assert (F.linear(x, st["weight"], st["bias"]) - y).abs().max().item() < 1e-5


@pytest.mark.parametrize("fmt", [None] + FMTS)
def test_gradients_reach_only_adapters(hf_dirs, fmt):
    path, _ = hf_dirs["llama_bias"]
    model = orbitrl.load_model(path, base_format=fmt)
    names = apply_lora(model, rank=4, alpha=8, targets="all-linear")
    assert len(names) == 2 * 7
    _randomize(model)
    before = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k
              and not hasattr(v, "__tensor_flatten__")}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.lora_{ab}.weight" for n in names for ab in "AB"}
    ids = torch.randint(0, 97, (2, 9))
    model.train()
    model(ids).logsumexp(-1).mean().backward()
    for n, p in model.named_parameters():
        if "lora_" in n:
            assert p.grad is not None and p.grad.abs().sum() > 0, n
        else:
            assert p.grad is None, n
    torch.optim.AdamW(adapter_parameters(model), lr=1e-2).step()
    after = model.state_dict()
    for k, v in before.items():
        assert torch.equal(after[k], v), k


def test_fresh_adapter_is_identity_and_switch_gives_base(hf_dirs):
    path, _ = hf_dirs["qwen2"]
    model = orbitrl.load_model(path, base_format="nf4")
    ids = torch.randint(0, 97, (2, 8))
    with torch.no_grad():
        base = model(ids)
        apply_lora(model, rank=8, alpha=16)
        assert torch.equal(model(ids), base)  # B = 0
        _randomize(model)
        tuned = model(ids)
        assert (tuned - base).abs().max() > 1e-3
        ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
        with adapters_disabled(model):
            assert torch.equal(model(ids), base)
            # no extra memory: the same parameters, nothing copied
            assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
        assert torch.equal(model(ids), tuned)


def test_target_patterns(hf_dirs):
    path, _ = hf_dirs["llama"]

    def names(targets):
        return apply_lora(orbitrl.load_model(path), rank=2, targets=targets)

    assert len(names("all-linear")) == 14
    assert names("q_proj") == ["model.layers.0.self_attn.q_proj",
                               "model.layers.1.self_attn.q_proj"]
    assert names("model.layers.1.mlp.*") == [f"model.layers.1.mlp.{p}_proj"
                                             for p in ("gate", "up", "down")]
    assert names(r"re:model\.layers\.0\.self_attn\.(q|v)_proj") == [
        "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"]
    assert len(names(["self_attn.o_proj", "down_proj"])) == 4
    for bad in ("qproj", "lm_head", ["q_proj", "mlp.gate"], "re:model\\.layers\\.9\\..*"):
        with pytest.raises(OrbitError) as e:
            names(bad)
        assert "targets" in str(e.value) and "\n" not in str(e.value)
        assert (bad if isinstance(bad, str) else bad[1]) in str(e.value)
    with pytest.raises(OrbitError, match="bad regular expression"):
        names("re:(")
    m = orbitrl.load_model(path)
    apply_lora(m, rank=2)
    with pytest.raises(OrbitError, match="already"):
        apply_lora(m, rank=2)


def test_bf16_adapters_and_dropout(hf_dirs):
    path, _ = hf_dirs["llama"]
    model = orbitrl.load_model(path, base_format="int4")
    apply_lora(model, rank=4, alpha=4, dropout=0.5, adapter_dtype="bf16")
    ps = adapter_parameters(model)
    assert all(p.dtype == torch.bfloat16 for p in ps)
    _randomize(model, std=0.2)
    ids = torch.randint(0, 97, (1, 6))
    with torch.no_grad():
        a, b = model(ids), model(ids)  # eval: dropout off
        assert a.dtype == torch.float32 and torch.equal(a, b)
        model.train()
        assert not torch.equal(model(ids), model(ids))
    model(ids).sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in ps)


def test_recompute_gives_same_gradients(hf_dirs):
    path, _ = hf_dirs["qwen3"]
    ids = torch.randint(0, 97, (2, 7))
    grads = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = orbitrl.load_model(path, base_format="nf4")
        apply_lora(model, rank=4)
        _randomize(model)
        model.recompute = recompute
        model(ids).logsumexp(-1).mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in adapter_parameters(model)]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


# ---- rollout vs training logprobs through the same modules ----------------------------------

def _engine_vs_trainer(model, seed=0):
    """Sample with the engine, recompute every sampled token's logprob with the trainer's
    chunked logprobs over the packed sequences; returns |difference| per token."""
    from orbitrl.engine import Engine, SamplingParams
    from orbitrl.train.logprobs import model_logprobs

    eng = Engine(model, kv_budget_bytes=1 << 20, max_num_seqs=8)
    outs = eng.generate([[1, 2, 3, 4, 5], [7, 8, 9]],
                        SamplingParams(n=2, max_tokens=10, seed=seed, ignore_eos=True))
    seqs, rollout, idx, start = [], [], [], 0
    for o in outs:
        for s in o.samples:
            seq = list(o.prompt_ids) + list(s.token_ids)
            seqs.append(seq)
            rollout += s.raw_logprobs
            idx += range(start + len(o.prompt_ids) - 1, start + len(seq) - 1)
            start += len(seq)
    ids, pos, sid = model.packed_inputs(seqs)
    tgt = torch.full_like(ids, -1)
    start = 0
    for s in seqs:
        tgt[0, start:start + len(s) - 1] = torch.tensor(s[1:])
        start += len(s)
    with torch.no_grad():
        lp = model_logprobs(model, ids, tgt, positions=pos, seq_ids=sid)[0, idx]
    return (lp - torch.tensor(rollout)).abs(), lp


@pytest.mark.parametrize("fmt", [None] + FMTS)
def test_engine_and_trainer_logprobs_agree(hf_dirs, fmt):
    """fp32 compute over any stored base format: the only difference is reduction order."""
    path, _ = hf_dirs["llama"]
    model = orbitrl.load_model(path, base_format=fmt)
    apply_lora(model, rank=4, alpha=8)
    _randomize(model, std=0.1)
    diff, _ = _engine_vs_trainer(model)
    print(f"\nlogprob gap {fmt or 'plain fp32'}: max {diff.max():.3g} mean {diff.mean():.3g} "
          f"over {diff.numel()} tokens")
    assert diff.max().item() < 1e-5


def test_engine_samples_the_updated_policy(hf_dirs):
    """After an optimizer step the engine samples from the updated adapters with nothing
    else done (same modules: no merge, copy or sync), and the logprobs still agree."""
    path, _ = hf_dirs["llama"]
    model = orbitrl.load_model(path, base_format="nf4")
    apply_lora(model, rank=4, alpha=8)
    _randomize(model, std=0.1)
    _, before = _engine_vs_trainer(model)
    opt = torch.optim.SGD(adapter_parameters(model), lr=0.5)
    model(torch.tensor([[1, 2, 3, 4]])).logsumexp(-1).mean().backward()
    opt.step()
    diff, after = _engine_vs_trainer(model)
    assert diff.max().item() < 1e-5
    assert (after - before).abs().max() > 1e-3  # same seed, new policy: new logprobs


def test_bf16_compute_gap_is_measured(hf_dirs):
    """bf16 weights *and* compute (not the default on CPU): the gap is rounding, reported."""
    path, _ = hf_dirs["llama"]
    model = orbitrl.load_model(path, dtype="bf16")
    apply_lora(model, rank=4, alpha=8)
    _randomize(model, std=0.1)
    diff, _ = _engine_vs_trainer(model)
    print(f"\nlogprob gap bf16 compute: max {diff.max():.3g} mean {diff.mean():.3g}")
    assert diff.max().item() < 0.05


def test_adapter_view_is_per_thread(hf_dirs):
    """A thread inside adapter_view computes with the frozen copy while another thread's
    changes to the live adapters (and their switch) do not reach it."""
    import threading

    from orbitrl.model.lora import adapter_view, snapshot_adapters

    model = orbitrl.load_model(hf_dirs["qwen2"][0])
    apply_lora(model, rank=4)
    with torch.no_grad():
        for p in adapter_parameters(model):
            p.normal_(0, 0.1)
    ids = torch.randint(0, 97, (1, 9))
    want = model(ids).clone()
    snap = snapshot_adapters(model)
    with torch.no_grad():
        for p in adapter_parameters(model):
            p.add_(1.0)
    moved = model(ids)
    assert not torch.allclose(moved, want)
    out = {}

    def worker():
        with adapter_view(snap):
            out["logits"] = model(ids)

    with adapters_disabled(model):  # the live switch is off in this thread
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    torch.testing.assert_close(out["logits"], want, rtol=0, atol=1e-6)
    torch.testing.assert_close(model(ids), moved)  # outside the view: live adapters
