"""A short step of a dense model (fewer than moe.ROW_FLOOR tokens) runs on row_count(N)
token rows: the same logits, bit for bit, and the same KV cache as running every GEMM of the
unpadded step under RowPadded (what a mixture still does), and the padding rows write no KV."""

import pytest
import torch

import orbitrl
from orbitrl.engine.model_runner import ModelRunner, RowPadded
from orbitrl.engine.paged_attention import KVCache, PagedAttention
from orbitrl.engine.sequence import SamplingParams, Sequence
from orbitrl.model.moe import ROW_FLOOR, row_count
from hf_helpers import random_prompts


@pytest.mark.parametrize("family", ["qwen2", "mistral"])  # mistral: sliding window
@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_short_step_token_padding_matches_gemm_padding(hf_dirs, family, n):
    assert n < ROW_FLOOR and row_count(n) > n
    model = orbitrl.load_model(hf_dirs[family][0])
    c = model.config
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 8 * n, 4, torch.float32, "cpu")
    seqs = []
    for i, p in enumerate(random_prompts([6 + 3 * i for i in range(n)])):
        s = Sequence(i, 0, p, SamplingParams(), frozenset(), i)
        s.block_table = list(range(8 * i, 8 * i + 8))
        seqs.append(s)
    runner = ModelRunner(model, cache)
    with torch.no_grad():  # prefill: every prompt in one step, then one token each
        runner.run([(s, len(s.token_ids)) for s in seqs])
    for i, s in enumerate(seqs):
        s.num_computed = len(s.token_ids)
        s.token_ids.append(7 + i)
    before = (cache.k.clone(), cache.v.clone())

    got, done = runner.run([(s, 1) for s in seqs])
    assert done == seqs and got.shape == (n, c.vocab_size)
    after = (cache.k.clone(), cache.v.clone())

    cache.k.copy_(before[0])
    cache.v.copy_(before[1])
    attn = PagedAttention.build(cache, c.sliding_windows, c.head_dim ** -0.5,
                                [(s.block_table, s.num_computed, 1) for s in seqs])
    ids = torch.tensor([[s.token_ids[-1] for s in seqs]])
    pos = torch.tensor([[s.num_computed for s in seqs]])
    with torch.inference_mode(), RowPadded():
        hidden = model(ids, positions=pos, attn=attn, return_hidden=True)[0]
        want = model.lm_head(hidden).float()
    assert torch.equal(got, want)
    assert torch.equal(after[0], cache.k) and torch.equal(after[1], cache.v)
    # the step wrote exactly one new slot per sequence
    changed = (after[0] != before[0]).any(-1).any(-1).any(0).nonzero()[:, 0].tolist()
    assert changed == sorted(s.block_table[s.num_computed // 4] * 4 + s.num_computed % 4
                             for s in seqs)


def test_kv_cache_layer_views_follow_a_resize():
    """KVCache.layer keeps each layer's views between steps; a resize drops them, so the old
    pool is freed (a throttled engine gives its memory back) and the next write lands in the
    new one."""
    import weakref

    cache = KVCache(2, 2, 4, 3, 4, torch.float32, "cpu")
    k, v = cache.layer(1)
    assert k.data_ptr() == cache.k[1].data_ptr() and v.data_ptr() == cache.v[1].data_ptr()
    del k, v
    old = weakref.ref(cache.k)
    cache.resize(5)
    assert old() is None
    cache.write(1, torch.tensor([17]), torch.ones(1, 2, 4), torch.full((1, 2, 4), 2.0))
    k, v = cache.read(1, torch.tensor([17, 3]))
    assert k[0].eq(1).all() and v[0].eq(2).all() and k[1].eq(0).all()
    assert cache.k[1, 17].eq(1).all() and cache.k[0, 17].eq(0).all()
