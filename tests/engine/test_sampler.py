"""The sampler against references: the two-level inverse CDF against a float64 cumsum, the
empirical distribution against softmax, logprobs against log_softmax, the counter-based
uniforms against a pure-Python splitmix64."""

import pytest
import torch

from orbitrl.engine.sampler import (_invert_cdf, _mix_int, _signed, row_key, sample, uniforms,
                                    uniforms_host)
from orbitrl.engine.sequence import SamplingParams


@pytest.mark.parametrize("v", [1, 255, 256, 1000, 4099])
def test_inverse_cdf_matches_float64_cumsum(v):
    g = torch.Generator().manual_seed(v)
    w = torch.rand(6, v, generator=g) ** 4
    w[1, 1::3] = 0.0  # zero-weight tokens inside blocks
    w[2, max(1, v // 2):] = 0.0  # a zero tail
    cdf = w.double().cumsum(-1)
    for u in [torch.rand(6, generator=g), torch.zeros(6), torch.ones(6)]:
        target = u.double() * cdf[:, -1]
        want = torch.searchsorted(cdf, target.clamp_min(1e-30)[:, None])[:, 0].clamp_max(v - 1)
        got = _invert_cdf(w, (u * w.sum(-1)))
        assert (w.gather(1, got[:, None]) > 0).all()  # never a zero-weight token
        # identical except where fp32 rounding sits on a CDF step
        near = (cdf.gather(1, want[:, None])[:, 0] - target).abs() < 1e-5 * cdf[:, -1]
        assert ((got == want) | near).all(), (got, want)


@pytest.mark.parametrize("v", [97, 256, 1000])
def test_nan_logits_still_give_a_token_in_the_vocabulary(v):
    # a diverged policy's NaN row: the inverse CDF searches past the end; the id must stay
    # below V (an id >= V fails the next step's embedding, on CUDA a device-side assert)
    logits = torch.randn(3, v)
    logits[1] = float("nan")
    logits[2, 5] = float("nan")
    w = (logits - logits.amax(-1, keepdim=True)).exp()
    got = _invert_cdf(w, torch.rand(3) * w.sum(-1))
    assert ((got >= 0) & (got < v)).all(), got
    params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate([1.0, 0.7, 1.0])]
    tok = sample(logits, params, [1, 2, 3], [0, 0, 0])[0]
    assert ((tok >= 0) & (tok < v)).all(), tok


def test_samples_follow_softmax_and_report_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(1, 300) * 2
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7),
              SamplingParams(temperature=1.0, top_k=20)]
    n = 20000
    counts = torch.zeros(3, 300)
    x = logits.expand(3, -1).contiguous()
    keys = [row_key(0, j) for j in range(3)]
    for step in range(n):
        tok, lp, raw = sample(x, params, keys, [step] * 3)
        counts[torch.arange(3), tok] += 1
    raw_ref = torch.log_softmax(logits[0], -1)
    want = [raw_ref.exp(), torch.softmax(logits[0] / 0.7, -1)]
    top = logits[0].topk(20).indices
    k = torch.full((300,), float("-inf")).scatter(0, top, logits[0, top])
    want.append(torch.softmax(k, -1))
    for r in range(3):
        freq = counts[r] / n
        # 5 standard errors of a binomial proportion
        assert ((freq - want[r]).abs() <= 5 * (want[r] * (1 - want[r]) / n).sqrt() + 1e-3).all()
    assert counts[2][want[2] == 0].sum() == 0
    # the last draw's logprobs: raw = log_softmax at T=1; sampling = its own distribution
    assert torch.allclose(raw, raw_ref[tok], atol=1e-5)
    assert torch.allclose(lp, torch.stack([want[r][tok[r]].log() for r in range(3)]), atol=1e-5)


def test_greedy_rows_and_seeded_rows_independent_of_batch():
    torch.manual_seed(1)
    x = torch.randn(5, 700)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3)] * 2 + [
        SamplingParams(temperature=1.3, top_p=0.9, seed=4)]
    keys = [row_key(p.seed or 0, r) for r, p in enumerate(params)]
    tok, lp, raw = sample(x, params, keys, [7] * 5)
    assert tok[0] == x[0].argmax() and tok[2] == x[2].argmax() and lp[0] == 0
    for r in (1, 4):  # the same row alone, with the same key and counter
        alone, lp1, raw1 = sample(x[r:r + 1], [params[r]], keys[r:r + 1], [7])
        assert alone[0] == tok[r] and torch.allclose(lp1[0], lp[r])
    assert torch.allclose(raw, torch.log_softmax(x, -1).gather(1, tok[:, None])[:, 0],
                          atol=1e-6)


def test_uniforms_match_python_splitmix_and_are_uniform():
    keys = [row_key(s, j) for s in (0, 1, 2 ** 40 + 3) for j in (0, 1, 7)]
    ctr = [0, 1, 5, 2 ** 33, 12, 3, 99, 100, 101]
    got = uniforms(torch.tensor(keys), torch.tensor(ctr))
    gold = 0x9E3779B97F4A7C15
    for g, k, c in zip(got.tolist(), keys, ctr):
        h = _mix_int((k & (2 ** 64 - 1)) ^ ((c * gold) & (2 ** 64 - 1)))
        assert g == (2 * (h >> 41) + 1) * 2.0 ** -24
    assert _signed(2 ** 64 - 1) == -1
    # the host form (what ``sample`` uses on a CPU) gives the same values
    assert uniforms_host(keys, ctr) == got.tolist()
    more_k = [row_key(s, j) for s in range(40) for j in range(3)] + [-1, 0, 2 ** 63 - 1, -2 ** 63]
    more_c = [(i * 7919) % 5000 for i in range(len(more_k))]
    assert uniforms_host(more_k, more_c) == uniforms(torch.tensor(more_k),
                                                     torch.tensor(more_c)).tolist()
    # a long stream of one key: mean and spread of a uniform, no repeats among neighbours
    u = uniforms(torch.full((100_000,), row_key(3, 4)), torch.arange(100_000))
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    assert 0 < u.min() and u.max() < 1 and (u[1:] != u[:-1]).float().mean() > 0.999
    # different samples of one seed are not the same stream
    v = uniforms(torch.full((1000,), row_key(3, 5)), torch.arange(1000))
    assert (u[:1000] != v).float().mean() > 0.99


def test_host_flags_give_the_general_paths_bits():
    """``all_raw`` (every row at temperature 1, unfiltered: one exp over [B, V]),
    ``any_greedy=False`` (no argmax) and a kept ``work`` buffer give the same tokens and
    logprobs, bit for bit, as the general path; ``sample`` sets the flags from the params."""
    from orbitrl.engine.sampler import row_params, sample_rows

    torch.manual_seed(3)
    x = torch.randn(9, 1000) * 3
    params = [SamplingParams(temperature=1.0)] * 9
    keys = [row_key(0, j) for j in range(9)]
    u = uniforms(torch.tensor(keys), torch.full((9,), 5))
    kw = row_params(params, x.device)
    general = sample_rows(x, u=u, **kw)
    fast = sample_rows(x, u=u, **kw, all_raw=True, any_greedy=False)
    work = torch.full((2 * x.numel() + 5,), float("nan"))  # a kept buffer, stale contents
    in_work = sample_rows(x, u=u, **kw, all_raw=True, any_greedy=False, work=work)
    for a, b, c in zip(general, fast, in_work):
        assert torch.equal(a, b) and torch.equal(a, c)
    via_params = sample(x, params, keys, [5] * 9)
    assert torch.equal(via_params[0], general[0]) and torch.equal(via_params[2], general[2])
    # a greedy row or another temperature in the batch: the general path
    mixed = [SamplingParams(temperature=0)] + [SamplingParams(temperature=0.5)] * 8
    tok, lp, _ = sample(x, mixed, keys, [5] * 9)
    assert tok[0] == x[0].argmax() and lp[0] == 0
    assert torch.allclose(lp[1:], torch.log_softmax(x[1:] * 2, -1).gather(1, tok[1:, None])[:, 0],
                          atol=1e-5)
