"""The CPU decode attention over the paged cache (engine/paged_attention.py): a GRPO group's
shared prompt attended once per group (``Cascade``) gives the plain gather's result, is
chosen only where sharing saves reads, and serves the engine's packed decode steps."""

import random

import pytest
import torch

from orbitrl.engine import Engine, SamplingParams
from orbitrl.engine import paged_attention as pa
from orbitrl.engine.paged_attention import KVCache, PagedAttention
from hf_helpers import GREEDY, random_prompts

HKV, G, D, BS = 2, 3, 8, 4


def _cache(fp8=False, blocks=96):
    torch.manual_seed(0)
    c = KVCache(1, HKV, D, blocks, BS, torch.float32, "cpu", fp8=fp8)
    if fp8:
        c.k.copy_(KVCache.quantize(torch.randn(blocks * BS, HKV, D))[0])
        c.v.copy_(KVCache.quantize(torch.randn(blocks * BS, HKV, D))[0])
        c.k_scale.uniform_(0.002, 0.006)  # values of order 1
        c.v_scale.uniform_(0.002, 0.006)
    else:
        c.k.normal_()
        c.v.normal_()
    return c


def _items():
    """Decode rows: 4 sharing 3 blocks (contexts 13..19), a lone row, 3 sharing 2 blocks,
    2 sharing one block."""
    rnd, nxt, items = random.Random(0), [40], []

    def own(n):
        nxt[0] += n
        return list(range(nxt[0] - n, nxt[0]))

    for _ in range(4):
        items.append(([0, 1, 2] + own(3), 12 + rnd.randrange(7), 1))
    items.append((own(5), 9, 1))
    for _ in range(3):
        items.append(([3, 4] + own(3), 9 + rnd.randrange(6), 1))
    for _ in range(2):
        items.append(([5] + own(4), 10 + rnd.randrange(5), 1))
    return items


def _qkv(n):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(1, n, HKV * G, D, generator=g), torch.randn(1, n, HKV, D, generator=g),
            torch.randn(1, n, HKV, D, generator=g))


@pytest.mark.parametrize("fp8", [False, True])
def test_cascade_matches_the_gathered_attention(fp8):
    items = _items()
    q, k, v = _qkv(len(items))
    fast = PagedAttention.build(_cache(fp8), [None], 0.3, items, exact=False, cascade=True)
    plan = fast.cascade
    assert plan is not None and plan.groups == 3 and plan.rmax == 4
    assert plan.pmax == 12  # the 4-row group's 3 blocks (the others' 2 and 1 are padded)
    ref = PagedAttention.build(_cache(fp8), [None], 0.3, items, exact=True)  # fp64, gathered
    assert ref.cascade is None
    out, want = fast(0, q, k, v), ref(0, q, k, v)
    torch.testing.assert_close(out, want, rtol=0, atol=2e-6)
    # a padded row (ModelRunner's short steps) still comes out zero
    q2, k2, v2 = (torch.cat([t, t[:, :2]], 1) for t in (q, k, v))
    out2 = PagedAttention.build(_cache(fp8), [None], 0.3, items, exact=False,
                                cascade=True)(0, q2, k2, v2)
    assert torch.equal(out2[:, len(items):], torch.zeros_like(out2[:, len(items):]))
    torch.testing.assert_close(out2[:, :len(items)], want, rtol=0, atol=2e-6)


def test_an_exact_cascade_rounds_as_the_fp64_gathered_attention():
    """``exact``: fp64 inside, fp32 out (a training run's rollout, whose trainer attends in
    fp64): at most one fp32 ulp from the gathered fp64 path."""
    items = _items()
    q, k, v = _qkv(len(items))
    wide = PagedAttention.build(_cache(), [None], 0.3, items, exact=True, cascade=True)
    assert wide.cascade is not None and wide.cascade.exact
    out = wide(0, q, k, v)
    want = PagedAttention.build(_cache(), [None], 0.3, items, exact=True)(0, q, k, v)
    assert out.dtype == torch.float32
    ulp = torch.finfo(torch.float32).eps * want.abs().clamp_min(torch.finfo(torch.float32).tiny)
    assert ((out - want).abs() <= ulp).all()


def test_rows_that_are_whole_groups_attend_without_a_gather():
    """Every row in a group of the same size, in order (n samples of each prompt): the
    plan takes the rows as the groups' queries as they lie; the result is the same."""
    items = [([0, 1, 2] + [10 + 3 * i + j for j in range(3)], 13 + i, 1) for i in range(3)]
    items += [([3, 4] + [30 + 3 * i + j for j in range(3)], 10 + 2 * i, 1) for i in range(3)]
    q, k, v = _qkv(len(items))
    fast = PagedAttention.build(_cache(), [None], 0.3, items, exact=False, cascade=True)
    assert fast.cascade is not None and fast.cascade.whole and fast.cascade.groups == 2
    assert not PagedAttention.build(_cache(), [None], 0.3, _items(), exact=False,
                                    cascade=True).cascade.whole
    ref = PagedAttention.build(_cache(), [None], 0.3, items, exact=True)
    torch.testing.assert_close(fast(0, q, k, v), ref(0, q, k, v), rtol=0, atol=2e-6)


def test_a_prefix_stops_before_a_rows_own_token():
    """A group whose shortest row's context ends inside the shared blocks: the prefix is cut
    there (each row's own token stays in its suffix), the result unchanged."""
    items = [([0, 1, 2, 9 + i], 8 + i, 1) for i in range(3)]  # positions 8, 9, 10
    q, k, v = _qkv(3)
    fast = PagedAttention.build(_cache(), [None], 0.3, items, exact=False, cascade=True)
    assert fast.cascade is not None and fast.cascade.pmax == 8
    ref = PagedAttention.build(_cache(), [None], 0.3, items, exact=True)
    torch.testing.assert_close(fast(0, q, k, v), ref(0, q, k, v), rtol=0, atol=2e-6)


def test_cascade_only_where_it_saves_reads():
    c = _cache()
    # long contexts sharing one block: under a quarter of the gathered positions saved
    long = [([0] + list(range(10 + 8 * i, 18 + 8 * i)), 34, 1) for i in range(4)]
    assert PagedAttention.build(c, [None], 0.3, long, exact=False, cascade=True).cascade is None
    lone = [(list(range(5 * i, 5 * i + 5)), 17, 1) for i in range(4)]  # nothing shared
    assert PagedAttention.build(c, [None], 0.3, lone, exact=False, cascade=True).cascade is None
    assert PagedAttention.build(c, [None], 0.3, _items(), exact=False).cascade is None
    assert PagedAttention.build(c, [None], 0.3, _items(), exact=False, cascade=True,
                                softcap=30.0).cascade is None


def test_a_sliding_window_layer_attends_as_before(monkeypatch):
    """A model with windowed layers keeps the plan for its full layers only."""
    items = _items()
    q, k, v = _qkv(len(items))
    calls = []
    monkeypatch.setattr(pa.Cascade, "__call__", lambda self, *a: calls.append(a) or
                        pytest.fail("the cascade served a windowed layer"))
    fast = PagedAttention.build(_cache(), [5], 0.3, items, exact=False, cascade=True)
    ref = PagedAttention.build(_cache(), [5], 0.3, items, exact=True)
    torch.testing.assert_close(fast(0, q, k, v), ref(0, q, k, v), rtol=0, atol=2e-6)
    assert not calls


def test_engine_decode_steps_read_shared_prompts_once(hf_dirs, monkeypatch):
    """Packed decode steps of n samples per prompt go through the cascade, and give the
    tokens and logprobs of the unpacked engine (fp64 attention over gathered contexts)."""
    import orbitrl

    model = orbitrl.load_model(hf_dirs["qwen2"][0])
    seen = []
    real = pa.Cascade.__call__
    monkeypatch.setattr(pa.Cascade, "__call__",
                        lambda self, *a: seen.append(self.groups) or real(self, *a))
    prompts = random_prompts([40, 37, 45])
    params = SamplingParams(n=4, max_tokens=10, **GREEDY)
    a = Engine(model, kv_budget_bytes=4 << 20)
    outs_a = a.generate(prompts, params)
    assert a.summary()["packed_bytes"] > 0 and seen and max(seen) == 3
    n = len(seen)
    outs_b = Engine(model, kv_budget_bytes=4 << 20, packed_bytes=0).generate(prompts, params)
    assert len(seen) == n  # (fp64 attention: no cascade)
    for oa, ob in zip(outs_a, outs_b):
        for sa, sb in zip(oa.samples, ob.samples):
            assert sa.token_ids == sb.token_ids
            assert max(abs(x - y) for x, y in zip(sa.raw_logprobs, sb.raw_logprobs)) < 1e-5
