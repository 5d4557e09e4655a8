import pytest
import torch

from orbitrl.errors import OrbitError
from orbitrl.train.logprobs import model_logprobs, naive_token_logprobs, token_logprobs


def _case(N=37, H=16, V=101, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.5
    y = torch.randint(0, V, (N,), generator=g)
    return h, w, y


@pytest.mark.parametrize("softcap", [None, 3.0])  # 3.0: Gemma's final soft-capping, bent
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunks", [(16, 5), (101, 37), (7, 64), (1000, 1000)])
def test_values_and_grads_match_naive(temperature, chunks, softcap):
    vc, tc = chunks
    h, w, y = _case()
    y[3] = -100  # ignored position
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(37, generator=g), torch.randn(37, generator=g)

    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = token_logprobs(h1, w1, y, temperature=temperature, with_entropy=True,
                             vocab_chunk=vc, token_chunk=tc, softcap=softcap)
    ((lp * a).sum() + (ent * b).sum()).backward()

    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp2, ent2 = naive_token_logprobs(h2, w2, y, temperature, softcap)
    ((lp2 * a).sum() + (ent2 * b).sum()).backward()
    if softcap is not None:  # the cap really bends these logits
        assert (naive_token_logprobs(h, w, y, temperature)[0] - lp2).abs().max() > 0.1

    assert lp[3] == 0
    torch.testing.assert_close(lp, lp2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ent2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-5, rtol=1e-5)


def test_only_logprob_grad_and_only_entropy_grad():
    h, w, y = _case(N=9, V=33)
    for which in (0, 1):
        h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
        out = token_logprobs(h1, w1, y, with_entropy=True, vocab_chunk=8, token_chunk=4)
        out[which].sum().backward()
        h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
        naive_token_logprobs(h2, w2, y)[which].sum().backward()
        torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(w1.grad, w2.grad, atol=1e-5, rtol=1e-5)


def test_scoring_no_grad_same_numbers_and_batched_shape():
    h, w, y = _case(N=24)
    with torch.no_grad():
        lp = token_logprobs(h.view(2, 12, -1), w, y.view(2, 12), vocab_chunk=10)
    assert lp.shape == (2, 12) and not lp.requires_grad
    torch.testing.assert_close(lp.view(-1), naive_token_logprobs(h, w, y)[0], atol=1e-5,
                               rtol=1e-5)


def test_tile_never_vocab_sized(monkeypatch):
    """No tensor of N x V elements is ever created (forward or backward)."""
    import orbitrl.train.logprobs as L

    seen = []
    orig = L._tile

    def spy(h, w, *rest):
        z = orig(h, w, *rest)
        seen.append(tuple(z.shape))
        return z

    monkeypatch.setattr(L, "_tile", spy)
    h, w, y = _case(N=40, V=101)
    h.requires_grad_()
    token_logprobs(h, w, y, vocab_chunk=16, token_chunk=8).sum().backward()
    assert seen and max(a * b for a, b in seen) <= 8 * 16


def test_model_logprobs_matches_full_logits(hf_dirs):
    import orbitrl

    model = orbitrl.load_model(hf_dirs["qwen2"][0])  # tied embeddings
    ids = torch.randint(0, 97, (2, 11))
    tgt = torch.cat([ids[:, 1:], torch.full((2, 1), -1)], dim=1)
    lp, ent = model_logprobs(model, ids, tgt, with_entropy=True, vocab_chunk=13,
                             temperature=0.9)
    lp.sum().backward()
    g1 = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits = model(ids) / 0.9
    ref = torch.log_softmax(logits, -1).gather(-1, tgt.clamp(min=0)[..., None])[..., 0]
    ref = torch.where(tgt >= 0, ref, torch.zeros_like(ref))
    ref.sum().backward()
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(g1[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)


def test_bad_inputs():
    h, w, y = _case()
    with pytest.raises(OrbitError, match="temperature"):
        token_logprobs(h, w, y, temperature=0)
    with pytest.raises(OrbitError, match="vocab size"):
        token_logprobs(h, w, y + 200)
    with pytest.raises(OrbitError, match="shape"):
        token_logprobs(h, w[:, :3], y)


def test_column_major_head_gradient_built_in_place():
    """A column-major head (model/decoder.py) gets its gradient in its own layout: the
    buffer backward builds is the one .grad keeps (no V x H copy), with the same values."""
    torch.manual_seed(0)
    V, H, N = 1000, 64, 50
    h, t = torch.randn(N, H), torch.randint(0, V, (N,))
    row = torch.nn.Parameter(torch.randn(V, H))
    col = torch.nn.Parameter(row.detach().t().contiguous().t())
    seen = []
    col.register_hook(lambda g: seen.append(g.data_ptr()))
    for w in (row, col):
        out = token_logprobs(h, w, t)
        (out[0] if isinstance(out, tuple) else out).sum().backward()
    assert col.grad.stride() == (1, V) and seen == [col.grad.data_ptr()]
    assert torch.allclose(col.grad, row.grad, atol=1e-6)


def test_a_tokens_logprob_rounds_as_the_rollout_samplers_at_large_logits():
    # the rollout's sampler (one pass over the vocabulary) and the trainer (chunked,
    # online) both take (z_y - max) - log(sum): z_y - lse would round at lse's magnitude
    # (SmolLM2's reach 38 in a chat reply; here 40-60: an ulp of 3.8e-6) and differ there
    # whenever the two sums' last bits do. Integer hidden states and weights make the
    # logits exact on both sides, so all that differs is the order of the sums
    from orbitrl.engine.sampler import sample_rows

    g = torch.Generator().manual_seed(0)
    rows, vocab, hid = 256, 20000, 64
    h = torch.randint(0, 3, (rows, hid), generator=g).float()
    w = torch.randint(-1, 2, (vocab, hid), generator=g).float()
    h[:, 0], w[:, 0] = 10.0, 2.0  # every logit 20 higher: a max of 40-60 on most rows
    logits = h @ w.t()
    assert float(logits.max(-1).values.median()) >= 40
    u = torch.rand(rows, generator=g).clamp_(1e-6, 1 - 1e-6)
    tokens, _, raw = sample_rows(logits, torch.ones(rows), torch.zeros(rows, dtype=torch.bool),
                                 u, all_raw=True, any_greedy=False)
    ours = token_logprobs(h, w, tokens)  # three vocabulary chunks
    assert float((ours - raw).abs().max()) <= 1e-6
    # the other order: z_y - lse with lse summed in one pass and chunk by chunk (online, as
    # the trainer sums) differs by an ulp of lse (3.8e-6) on some of these rows
    mx = logits.amax(-1)
    one_pass = mx + (logits - mx[:, None]).exp().sum(-1).log()
    m, s = torch.full((rows,), float("-inf")), torch.zeros(rows)
    for v0 in range(0, vocab, 8192):
        z = logits[:, v0:v0 + 8192]
        m_new = torch.maximum(m, z.amax(-1))
        s = s * torch.exp(m - m_new) + (z - m_new[:, None]).exp().sum(-1)
        m = m_new
    chunked = m + s.log()
    z_y = logits.gather(1, tokens[:, None])[:, 0]
    assert float(((z_y - one_pass) - (z_y - chunked)).abs().max()) >= 3e-6
