import copy
import math

import pytest
import torch

import orbitrl
from orbitrl.errors import OrbitError
from orbitrl.train.logprobs import model_logprobs
from orbitrl.train.optim import FusedAdaLomo, FusedSGD, build_optimizer


def _batches(n, seed=0, B=2, T=9, V=97):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, V, (B, T), generator=g)
        tgt = torch.cat([ids[:, 1:], torch.full((B, 1), -1)], 1)
        adv = torch.randn(B, 1, generator=g)
        out.append((ids, tgt, adv))
    return out


def _loss(model, batch):
    ids, tgt, adv = batch
    lp = model_logprobs(model, ids, tgt, vocab_chunk=32)
    return -(lp * adv).sum() / (tgt >= 0).sum()


def _model(hf_dirs, fam="llama", recompute=False):
    m = orbitrl.load_model(hf_dirs[fam][0]).train()
    m.recompute = recompute
    return m


def _close(a, b, tol=1e-6):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=tol, rtol=0, msg=n)


def _ref_sgd(model, batches, lr, wd, max_norm, k=1):
    opt = torch.optim.SGD(model.parameters(), lr=lr / k, weight_decay=wd)
    norms = []
    for b in batches:
        opt.zero_grad()
        _loss(model, b).backward()
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
    return norms


@pytest.mark.parametrize("fam,max_norm,recompute", [("llama", 0.3, False),
                                                    ("llama", None, False),
                                                    ("qwen2", 0.05, True)])
def test_fused_sgd_matches_torch_sgd(hf_dirs, fam, max_norm, recompute):
    batches = _batches(4)
    ref = _model(hf_dirs, fam)
    fused = _model(hf_dirs, fam, recompute=recompute)
    norms = _ref_sgd(ref, batches, lr=0.5, wd=0.01, max_norm=max_norm)
    opt = FusedSGD(fused.parameters(), lr=0.5, weight_decay=0.01, max_grad_norm=max_norm)
    for i, b in enumerate(batches):
        def closure():
            loss = _loss(fused, b)
            loss.backward()
            return loss
        opt.step(closure)
        assert all(p.grad is None for p in fused.parameters())
        if max_norm is not None:
            assert opt.stats.last_grad_norm == pytest.approx(norms[i], rel=1e-5)
    if max_norm is not None:
        assert max(norms) > max_norm  # clipping was active
    assert opt.stats.steps == 4 and opt.stats.backward_passes == 8
    _close(fused, ref)


def test_one_pass_uses_previous_norm(hf_dirs):
    batches = _batches(4, seed=1)
    ref, fused = _model(hf_dirs), _model(hf_dirs)
    # reference: step 0 clipped by its own norm, step t by the norm of step t-1
    sgd = torch.optim.SGD(ref.parameters(), lr=0.5)
    prev = None
    for b in batches:
        sgd.zero_grad()
        _loss(ref, b).backward()
        norm = float(torch.linalg.vector_norm(torch.stack(
            [p.grad.norm() for p in ref.parameters()])))
        use = norm if prev is None else prev
        coef = min(1.0, 0.3 / (use + 1e-6))
        for p in ref.parameters():
            p.grad.mul_(coef)
        sgd.step()
        prev = norm
    opt = FusedSGD(fused.parameters(), lr=0.5, two_pass=False, nonfinite="stop")
    for b in batches:
        opt.step(lambda b=b: _closure(fused, b))
    assert opt.stats.backward_passes == 5  # first step two-pass, then one each
    _close(fused, ref)


def _closure(model, b):
    loss = _loss(model, b)
    loss.backward()
    return loss


def test_grads_freed_during_backward(hf_dirs):
    m = _model(hf_dirs)
    live = []
    # count params holding a gradient each time any hook fires (registered after the opt)
    opt = FusedSGD(m.parameters(), lr=0.1)
    params = list(m.parameters())
    for p in params:
        p.register_post_accumulate_grad_hook(
            lambda p: live.append(sum(q.grad is not None for q in params)))
    opt.step(lambda: _closure(m, _batches(1)[0]))
    assert live and max(live) <= 1  # only the one being updated, already freed after


def _plain_adalomo(model, batches, lr, max_norm, wd=0.0, eps=(1e-30, 1e-3), decay=-0.8,
                   clip=1.0):
    """AdaLomo written out plainly over full gradients (LOMO repo's adalomo.py maths)."""
    state = {}
    for t, b in enumerate(batches, start=1):
        model.zero_grad()
        _loss(model, b).backward()
        total = math.sqrt(sum(float((p.grad ** 2).sum()) for p in model.parameters()))
        coef = min(1.0, max_norm / (total + 1e-6))
        beta2 = 1 - t ** decay
        with torch.no_grad():
            for p in model.parameters():
                g = p.grad * coef
                s = state.setdefault(p, {})
                if p.dim() == 2:
                    r_new = (g * g + eps[0]).mean(1)
                    c_new = (g * g + eps[0]).mean(0)
                    s["r"] = beta2 * s.get("r", torch.zeros_like(r_new)) + (1 - beta2) * r_new
                    s["c"] = beta2 * s.get("c", torch.zeros_like(c_new)) + (1 - beta2) * c_new
                    v = torch.outer(s["r"], s["c"]) / s["r"].mean()
                else:
                    s["v"] = beta2 * s.get("v", torch.zeros_like(g)) + (1 - beta2) * (g * g + eps[0])
                    v = s["v"]
                u = g / v.sqrt()
                rms_u = u.pow(2).mean().sqrt()
                u = u / max(1.0, float(rms_u) / clip)
                lr_t = lr * max(eps[1], float(p.pow(2).mean().sqrt()))
                p.mul_(1 - lr_t * wd)
                p.sub_(lr_t * u)


def test_adalomo_matches_plain_reference(hf_dirs):
    batches = _batches(4, seed=2)
    ref, fused = _model(hf_dirs, "qwen3"), _model(hf_dirs, "qwen3")
    _plain_adalomo(ref, batches, lr=0.05, max_norm=0.3, wd=0.1)
    opt = FusedAdaLomo(fused.parameters(), lr=0.05, weight_decay=0.1)
    for b in batches:
        opt.step(lambda b=b: _closure(fused, b))
    _close(fused, ref, tol=1e-5)
    # factored: only row + column vectors for matrices
    w = fused.model.layers[0].mlp.up_proj.weight
    assert set(opt.state[w]) == {"step", "row", "col"}
    assert opt.state[w]["row"].shape == (w.shape[0],) and opt.state[w]["col"].shape == (w.shape[1],)
    # state_dict round trip
    sd = copy.deepcopy(opt.state_dict())
    opt2 = FusedAdaLomo(_model(hf_dirs, "qwen3").parameters(), lr=0.05)
    opt2.load_state_dict(sd)
    assert opt2.stats.steps == 4


def _snapshot(m):
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def _poison(mod, inp, out):
    out.register_hook(lambda g: g * float("nan"))


def test_nan_gradient_skips_step_params_unchanged(hf_dirs):
    m = _model(hf_dirs, recompute=True)
    opt = FusedSGD(m.parameters(), lr=0.5)
    b = _batches(1)[0]
    before = _snapshot(m)

    # NaN enters the backward at layer 0's input: the last layers, lm_head and final norm
    # already have finite gradients by then (a one-pass update would have changed them).
    def poisoned():
        h = m.model.layers[0].register_forward_hook(_poison)
        try:
            return _closure(m, b)
        finally:
            h.remove()

    opt.step(poisoned)
    assert opt.stats.skipped == 1 and opt.stats.steps == 0
    for n, p in m.named_parameters():
        assert torch.equal(p, before[n]), n
        assert p.grad is None

    # a non-finite loss is skipped too
    def nan_loss():
        loss = _loss(m, b) * float("nan")
        loss.backward()
        return loss

    opt.step(nan_loss)
    assert opt.stats.skipped == 2
    assert all(torch.equal(p, before[n]) for n, p in m.named_parameters())
    # and training continues
    opt.step(lambda: _closure(m, b))
    assert opt.stats.steps == 1
    assert any(not torch.equal(p, before[n]) for n, p in m.named_parameters())


def test_one_pass_nan_stops_and_counts_partial(hf_dirs):
    m = _model(hf_dirs)
    opt = FusedSGD(m.parameters(), lr=0.5, two_pass=False, nonfinite="stop")
    b = _batches(1)[0]
    opt.step(lambda: _closure(m, b))
    before = _snapshot(m)

    def poisoned():
        h = m.model.layers[0].register_forward_hook(_poison)
        try:
            return _closure(m, b)
        finally:
            h.remove()

    opt.step(poisoned)
    assert opt.stats.partial == 1 and opt.stats.steps == 1
    assert all(torch.isfinite(p).all() for p in m.parameters())
    # layer-0 and embedding parameters (reached after the NaN) were not touched
    for n, p in m.named_parameters():
        if n.startswith("model.layers.0.") or "embed" in n:
            assert torch.equal(p, before[n]), n


def test_accumulation_is_lr_over_k_per_micro_batch(hf_dirs):
    batches = _batches(4, seed=3)
    ref, fused = _model(hf_dirs), _model(hf_dirs)
    _ref_sgd(ref, batches, lr=0.4, wd=0.0, max_norm=0.3, k=2)
    opt = FusedSGD(fused.parameters(), lr=0.4, accumulation_steps=2)
    for b in batches:
        opt.step(lambda b=b: _closure(fused, b))
    assert opt.stats.micro_steps == 4 and opt.stats.steps == 2
    _close(fused, ref)


def test_refuses_what_it_cannot_honour(hf_dirs):
    ps = list(_model(hf_dirs).parameters())
    bad = [dict(momentum=0.9), dict(nesterov=True), dict(foreach=True), dict(fused=True),
           dict(maximize=True), dict(two_pass=False), dict(nonfinite="stop"),
           dict(max_grad_norm=0.0), dict(accumulation_steps=0), dict(betas=(0.9, 0.99))]
    for kw in bad:
        with pytest.raises(OrbitError):
            FusedSGD(ps, lr=0.1, **kw)
    with pytest.raises(OrbitError):
        FusedAdaLomo(ps, lr=0.1, differentiable=True)
    with pytest.raises(OrbitError, match="requires_grad"):
        FusedSGD([torch.zeros(2)], lr=0.1)
    m = _model(hf_dirs)
    opt = FusedSGD(m.parameters(), lr=0.1)
    with pytest.raises(OrbitError, match="closure"):
        opt.step()
    with pytest.raises(OrbitError, match="outside"):
        _loss(m, _batches(1)[0]).backward()
    assert isinstance(build_optimizer("adamw", m.parameters(), lr=1e-3), torch.optim.AdamW)
    with pytest.raises(OrbitError):
        build_optimizer("lion", m.parameters(), lr=1e-3)


@pytest.mark.parametrize("cls,kw", [(FusedSGD, dict(lr=0.5, weight_decay=0.01)),
                                    (FusedAdaLomo, dict(lr=0.05, weight_decay=0.1))])
def test_update_size_equals_the_measured_change(hf_dirs, cls, kw):
    """The fused step's reported update norm is the norm of what it wrote to the weights."""
    m = _model(hf_dirs, "qwen3")
    opt = cls(m.parameters(), **kw)
    for b in _batches(2, seed=5):  # a state that is not the initial one (AdaLomo moments)
        opt.step(lambda b=b: _closure(m, b))
    assert opt.take_update_size()["update_norm"] > 0
    before = [p.detach().clone() for p in m.parameters()]
    opt.step(lambda: _closure(m, _batches(1, seed=9)[0]))
    size = opt.take_update_size()
    d = math.sqrt(sum(float((p.detach() - q).pow(2).sum()) for p, q in zip(m.parameters(), before)))
    w = math.sqrt(sum(float(q.pow(2).sum()) for q in before))
    assert size["update_norm"] == pytest.approx(d, rel=1e-4)
    assert size["update_rel"] == pytest.approx(d / w, rel=1e-4)
    assert opt.take_update_size()["update_norm"] == 0.0  # reset


def test_dot_over_layouts():
    """AdaLomo's weight-decay term sums W * u over a row-major or column-major head."""
    from orbitrl.train.optim import _dot

    torch.manual_seed(0)
    a, b = torch.randn(300, 40), torch.randn(300, 40)
    want = (a.double() * b.double()).sum()
    col = lambda x: x.t().contiguous().t()  # noqa: E731
    for x, y in [(a, b), (col(a), col(b)), (a, col(b)), (col(a), b)]:
        assert abs(_dot(x, y).item() - want.item()) < 1e-3
