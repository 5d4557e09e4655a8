import copy
import math

import pytest
import torch

import orbitrl
from orbitrl.errors import OrbitError
from orbitrl.train.logprobs import model_logprobs
from orbitrl.train.optim import FusedAdaLomo, FusedSGD, build_optimizer, lr_at


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
                   clip=1.0, each=None):
    """AdaLomo written out plainly over full gradients (LOMO repo's adalomo.py maths).

    ``max_norm=None``: no global clip, only the grouped (per-tensor) update normalization.
    ``each(t)`` runs after step t. Returns the global gradient norm of every step."""
    state, norms = {}, []
    for t, b in enumerate(batches, start=1):
        model.zero_grad()
        _loss(model, b).backward()
        total = math.sqrt(sum(float((p.grad ** 2).sum()) for p in model.parameters()))
        norms.append(total)
        coef = 1.0 if max_norm is None else min(1.0, max_norm / (total + 1e-6))
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
        if each is not None:
            each(t)
    return norms


@pytest.mark.parametrize("build", ["class", "clip_global"])
def test_adalomo_matches_plain_reference(hf_dirs, build):
    batches = _batches(4, seed=2)
    ref, fused = _model(hf_dirs, "qwen3"), _model(hf_dirs, "qwen3")
    norms = _plain_adalomo(ref, batches, lr=0.05, max_norm=0.3, wd=0.1)
    assert max(norms) > 0.3  # the global clip was active
    if build == "class":
        opt = FusedAdaLomo(fused.parameters(), lr=0.05, weight_decay=0.1)
    else:  # what train.clip=global builds
        opt = build_optimizer("adalomo", fused.parameters(), 0.05, clip="global",
                              max_grad_norm=0.3, weight_decay=0.1)
    for b in batches:
        opt.step(lambda b=b: _closure(fused, b))
    assert opt.two_pass and opt.stats.backward_passes == 8
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


def test_one_pass_grouped_adalomo_matches_plain_reference_step_by_step(hf_dirs):
    """clip="grouped" (the full-mode default): one backward per step, no global clip, each
    tensor's update normalized by its own RMS; compared after every step."""
    batches = _batches(4, seed=2)
    ref, fused, exact = (_model(hf_dirs, "qwen3") for _ in range(3))
    opt = build_optimizer("adalomo", fused.parameters(), 0.05, weight_decay=0.1)
    assert not opt.two_pass and opt.max_grad_norm is None and opt.nonfinite == "stop"

    def fused_step(t):
        opt.step(lambda: _closure(fused, batches[t - 1]))
        assert opt.stats.backward_passes == t and opt.stats.steps == t
        _close(fused, ref, tol=1e-5)

    norms = _plain_adalomo(ref, batches, lr=0.05, max_norm=None, wd=0.1, each=fused_step)
    assert opt.stats.last_grad_norm == pytest.approx(norms[-1], rel=1e-5)
    assert opt.stats.vetoed == opt.stats.partial == opt.stats.held == 0
    # the reference is not the global-clip one in disguise: that run ends elsewhere
    assert max(norms) > 0.3
    two = build_optimizer("adalomo", exact.parameters(), 0.05, clip="global", weight_decay=0.1)
    for b in batches:
        two.step(lambda b=b: _closure(exact, b))
    gap = max(float((p - q).detach().abs().max())
              for p, q in zip(fused.parameters(), exact.parameters()))
    assert gap > 1e-4


def _hand_case(scale: float, lr: float = 0.1):
    """W [2, 2] = ones with gradient scale * [[2, 0], [0, 1]], v [4] = 2 with gradient
    scale * 3, one grouped one-pass AdaLomo step."""
    W = torch.ones(2, 2, requires_grad=True)
    v = torch.full((4,), 2.0, requires_grad=True)
    G = torch.tensor([[2.0, 0.0], [0.0, 1.0]]) * scale
    opt = build_optimizer("adalomo", [W, v], lr)

    def closure():
        loss = (W * G).sum() + (v * 3.0 * scale).sum()
        loss.backward()
        return loss
    opt.step(closure)
    return W.detach(), v.detach(), opt


@pytest.mark.parametrize("scale", [1.0, 1e3])
def test_grouped_update_by_hand(scale):
    """Step 1 (beta2 = 0). W: row means of g^2 r = [2, 0.5], column means c = [2, 0.5],
    v = r c^T / mean(r) = [[3.2, 0.8], [0.8, 0.2]], u = g / sqrt(v) = [[2/sqrt(3.2), 0],
    [0, 1/sqrt(0.2)]] = [[1.1180, 0], [0, 2.2361]], RMS(u) = sqrt((1.25 + 5) / 4) = 1.25 > 1,
    so u / 1.25 = [[0.8944, 0], [0, 1.7889]]; RMS(W) = 1, so W -= 0.1 * u. Vector: u = g /
    |g| = 1, RMS(v) = 2, so v -= 0.1 * 2 * 1. A 1000x larger gradient gives the same step:
    the grouped normalization is what bounds it, with no global clip."""
    W, v, opt = _hand_case(scale)
    want = torch.tensor([[1 - 0.1 * 0.894427, 1.0], [1.0, 1 - 0.1 * 1.788854]])
    torch.testing.assert_close(W, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(v, torch.full((4,), 1.8), atol=1e-6, rtol=0)
    assert opt.stats.backward_passes == 1
    assert opt.stats.last_grad_norm == pytest.approx(scale * math.sqrt(5 + 4 * 9), rel=1e-6)


def _layer0_scaled(m, factor):
    """A forward hook on layer 0 whose output's gradient is multiplied by ``factor``: the
    backward reaches the later layers first, with their gradients as they were."""
    def hook(mod, inp, out):
        out.register_hook(lambda g: g * factor)
    return m.model.layers[0].register_forward_hook(hook)


def _warm(m, opt, n):
    norms = []
    for b in _batches(n, seed=4):
        opt.step(lambda b=b: _closure(m, b))
        norms.append(opt.stats.last_grad_norm)
    return sum(norms) / len(norms)


def test_grouped_veto_sees_the_norm_so_far_and_stops_there(hf_dirs):
    """One pass: ``veto`` gets the global norm of the gradients seen so far after each
    tensor (rising to the step's global norm at the last one); where it refuses, that
    tensor and every later one keep their values and moments."""
    m = _model(hf_dirs, recompute=True)
    opt = build_optimizer("adalomo", m.parameters(), 0.05)
    limit = 5 * _warm(m, opt, 6)  # the trainer's heartbeat: 5x the running mean
    calls = []
    opt.veto = lambda n: calls.append(n) or n > limit
    b = _batches(1, seed=8)[0]
    n_params = len(list(m.parameters()))
    # an ordinary step: never refused, the bound rises to the exact global norm
    opt.step(lambda: _closure(m, b))
    assert len(calls) == n_params and calls == sorted(calls)
    assert calls[-1] == pytest.approx(opt.stats.last_grad_norm, rel=1e-6)
    assert opt.stats.steps == 7 and opt.stats.vetoed == opt.stats.held == 0
    # a spike from the loss: the first tensor reached is already over the limit
    before = _snapshot(m)
    moments = {n: {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
               for n, p in m.named_parameters()}
    calls.clear()

    def big():
        loss = _loss(m, b) * 1e4
        loss.backward()
        return loss
    opt.step(big)
    assert len(calls) == 1 and opt.stats.vetoed == 1 and opt.stats.held == n_params
    assert opt.stats.steps == 7
    for n, p in m.named_parameters():
        assert torch.equal(p, before[n]), n
        assert p.grad is None
        for k, t in moments[n].items():
            assert torch.equal(opt.state[p][k], t), (n, k)
    # a spike entering at layer 0: the later layers keep their update, layer 0 and the
    # embedding (reached after it) keep their values
    h = _layer0_scaled(m, 1e4)
    try:
        opt.step(lambda: _closure(m, b))
    finally:
        h.remove()
    late = [n for n, _ in m.named_parameters() if n.startswith("model.layers.0.") or "embed" in n]
    assert opt.stats.vetoed == 2 and opt.stats.held == n_params + len(late)
    for n, p in m.named_parameters():
        assert torch.equal(p, before[n]) == (n in late), n
    opt.step(lambda: _closure(m, b))  # and training goes on
    assert opt.stats.steps == 8 and opt.stats.vetoed == 2


def test_grouped_without_veto_applies_the_spike_bounded(hf_dirs):
    """The control: with no veto the 1e4x step is applied, and the grouped normalization
    keeps every tensor's change within lr * max(eps2, RMS(W)) in RMS."""
    m = _model(hf_dirs, recompute=True)
    opt = build_optimizer("adalomo", m.parameters(), 0.05)
    _warm(m, opt, 6)
    before = _snapshot(m)
    b = _batches(1, seed=8)[0]

    def big():
        loss = _loss(m, b) * 1e4
        loss.backward()
        return loss
    opt.step(big)
    assert opt.stats.vetoed == 0 and opt.stats.held == 0 and opt.stats.steps == 7
    for n, p in m.named_parameters():
        d = (p.detach() - before[n]).pow(2).mean().sqrt()
        bound = 0.05 * max(1e-3, float(before[n].pow(2).mean().sqrt()))
        assert 0 < d <= bound * (1 + 1e-5), (n, float(d), bound)


def test_grouped_nan_stops_and_counts_partial(hf_dirs):
    m = _model(hf_dirs)
    opt = build_optimizer("adalomo", m.parameters(), 0.05)
    b = _batches(1)[0]
    opt.step(lambda: _closure(m, b))
    before = _snapshot(m)
    h = _layer0_scaled(m, float("nan"))
    try:
        opt.step(lambda: _closure(m, b))
    finally:
        h.remove()
    assert opt.stats.partial == 1 and opt.stats.steps == 1 and opt.stats.held > 0
    assert all(torch.isfinite(p).all() for p in m.parameters())
    assert all(torch.isfinite(t).all() for st in opt.state.values() for t in st.values()
               if torch.is_tensor(t))
    for n, p in m.named_parameters():
        if n.startswith("model.layers.0.") or "embed" in n:
            assert torch.equal(p, before[n]), n


def test_build_optimizer_clip_modes(hf_dirs):
    ps = list(_model(hf_dirs).parameters())
    one = build_optimizer("adalomo", ps, 1e-3)
    assert (one.two_pass, one.max_grad_norm, one.nonfinite) == (False, None, "stop")
    one.remove_hooks()
    two = build_optimizer("adalomo", ps, 1e-3, clip="global", max_grad_norm=0.2)
    assert (two.two_pass, two.max_grad_norm, two.nonfinite) == (True, 0.2, "skip")
    two.remove_hooks()
    sgd = build_optimizer("sgd", ps, 1e-3)
    assert sgd.two_pass and sgd.max_grad_norm == 0.3
    sgd.remove_hooks()
    for name, clip in (("sgd", "grouped"), ("adamw", "grouped"), ("adalomo", "previous")):
        with pytest.raises(OrbitError):
            build_optimizer(name, ps, 1e-3, clip=clip)


def test_lr_at_warmup_constant_and_cosine():
    """The one learning-rate schedule (RL's train.* keys, SFT's cosine), by hand."""
    # constant, warmup 4: (step + 1) / 4 of lr, then lr
    assert [lr_at(s, 2.0, warmup=4) for s in (0, 1, 3, 10)] == [0.5, 1.0, 2.0, 2.0]
    assert lr_at(0, 2.0) == 2.0  # warmup 0: none (no division by it)
    # cosine from 1.1 to min_lr .1 over 10 steps: halfway .1 + 1 x .5 x (1 + cos(pi/2)) = .6
    kw = dict(total=10, schedule="cosine", min_lr=0.1)
    assert lr_at(0, 1.1, **kw) == pytest.approx(1.1)
    assert lr_at(5, 1.1, **kw) == pytest.approx(0.6)
    assert lr_at(10, 1.1, **kw) == pytest.approx(0.1) and lr_at(20, 1.1, **kw) == pytest.approx(0.1)
    # warmup scales the part above min_lr: step 0 of 2 -> .1 + 1 x .5 x .5 x (1 + 1)
    assert lr_at(0, 1.1, warmup=2, **kw) == pytest.approx(0.6)
    # SFT's schedule (train/sft.py: warmup + cosine to 0) as it was written there, to rounding
    # (pi x (s / total) here against (pi x s) / total there)
    for s in range(0, 300, 7):
        old = 1e-3 * min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / 300))
        assert lr_at(s, 1e-3, warmup=20, total=300, schedule="cosine") == \
            pytest.approx(old, rel=1e-12, abs=0)
    with pytest.raises(OrbitError, match="linear"):
        lr_at(0, 1.0, schedule="linear")
