"""The decode runner on a CUDA device: CUDA graphs against eager steps, greedy parity with
transformers, fp8 KV, LoRA on an NF4 base (skipped without CUDA; run by
scripts/gpu_check.sh)."""

import pytest
import torch

import orbitrl
from orbitrl.engine import Engine, SamplingParams
from hf_helpers import GREEDY, hf_greedy, lora_views, random_prompts

pytestmark = pytest.mark.gpu


def _tokens(outs):
    return [[s.token_ids for s in o.samples] for o in outs]


def test_greedy_matches_transformers_on_cuda(hf_dirs):
    path, hf = hf_dirs["qwen2"]
    model = orbitrl.load_model(path, device="cuda")
    prompts = random_prompts([3, 17, 9, 33, 1, 12])
    want = [hf_greedy(hf, p, 12) for p in prompts]
    eng = Engine(model, kv_budget_bytes=1 << 22, block_size=16)
    outs = eng.generate(prompts, SamplingParams(max_tokens=12, **GREEDY))
    assert eng.decode_runner._graphs  # the decode steps replayed graphs
    for o, (toks, lps) in zip(outs, want):
        assert o.samples[0].token_ids == toks
        assert max(abs(a - b) for a, b in zip(o.samples[0].raw_logprobs, lps)) < 1e-4


@pytest.mark.parametrize("dtype", ["float32", "bf16"])
def test_graphs_and_eager_give_identical_greedy_tokens(hf_dirs, dtype):
    model = orbitrl.load_model(hf_dirs["mistral"][0], dtype=dtype, device="cuda")
    prompts = random_prompts([5, 30, 9, 21, 2])
    params = [SamplingParams(n=3, max_tokens=20, **GREEDY),
              SamplingParams(n=3, max_tokens=20, seed=5, ignore_eos=True)]
    for p in params:
        runs = []
        for graphs in (True, False):
            eng = Engine(model, kv_budget_bytes=1 << 22, block_size=8, cuda_graphs=graphs)
            runs.append(_tokens(eng.generate(prompts, p)))
            assert bool(eng.decode_runner._graphs) == graphs
        assert runs[0] == runs[1]


def test_weight_update_seen_by_the_next_replay(hf_dirs):
    model = orbitrl.load_model(hf_dirs["llama"][0], device="cuda")
    eng = Engine(model, kv_budget_bytes=1 << 22, block_size=4)
    prompt = random_prompts([8])[0]
    params = SamplingParams(max_tokens=6, **GREEDY)
    before = eng.generate([prompt], params)[0].samples[0].token_ids
    graphs = dict(eng.decode_runner._graphs)
    with torch.no_grad():  # in place: the captured graphs read the same addresses
        model.lm_head.weight[before[2]] *= -50.0
    after = eng.generate([prompt], params)[0].samples[0].token_ids
    assert eng.decode_runner._graphs.keys() >= graphs.keys()  # no recapture needed
    ref = Engine(model, kv_budget_bytes=1 << 22, block_size=4, static_decode=False)
    assert after == ref.generate([prompt], params)[0].samples[0].token_ids != before


def test_fp8_kv_on_cuda(hf_dirs):
    model = orbitrl.load_model(hf_dirs["llama"][0], device="cuda")
    prompts = random_prompts([9, 21, 4])
    params = SamplingParams(max_tokens=16, **GREEDY)
    a = Engine(model, kv_budget_bytes=1 << 22).generate(prompts, params)
    fp8 = Engine(model, kv_budget_bytes=1 << 22, kv_dtype="fp8")
    b = fp8.generate(prompts, params)
    eager = Engine(model, kv_budget_bytes=1 << 22, kv_dtype="fp8", cuda_graphs=False)
    assert _tokens(b) == _tokens(eager.generate(prompts, params))
    diffs = []
    for x, y in zip(a, b):
        xs, ys = x.samples[0], y.samples[0]
        n = next((i for i, (u, v) in enumerate(zip(xs.token_ids, ys.token_ids)) if u != v), 16)
        diffs += [abs(u - v) for u, v in zip(xs.raw_logprobs[:n], ys.raw_logprobs[:n])]
    assert 0 < max(diffs) < 0.05, max(diffs)


def test_lora_on_nf4_rollout_on_cuda(hf_dirs):
    pytest.importorskip("torchao")
    from orbitrl.model.lora import adapter_parameters, apply_lora

    model = orbitrl.load_model(hf_dirs["llama"][0], dtype="bf16", device="cuda")
    apply_lora(model, rank=4, base_format="nf4")
    prompts = random_prompts([6, 13, 25])
    params = SamplingParams(n=2, max_tokens=12, **GREEDY)
    # graphs against the same runner stepping eagerly: the same kernels and padding, so
    # the same bits (the general path's gather + SDPA in bf16 may break a near-tie)
    fast = Engine(model, kv_budget_bytes=1 << 22, block_size=4)
    slow = Engine(model, kv_budget_bytes=1 << 22, block_size=4, cuda_graphs=False)
    before = _tokens(fast.generate(prompts, params))
    assert fast.decode_runner._graphs and not slow.decode_runner._graphs
    assert before == _tokens(slow.generate(prompts, params))
    with torch.no_grad():  # an adapter update in place, seen by the captured graphs
        for p in adapter_parameters(model):
            p.add_(torch.randn_like(p) * 0.2)
    after = _tokens(fast.generate(prompts, params))
    assert after == _tokens(slow.generate(prompts, params)) != before


def test_triton_kernel_is_the_default_and_matches_the_reference(hf_dirs):
    """On CUDA the engine's attention is the Triton paged kernels (decode in the runner's
    graphs with prefix groups, prefill in the general path); its tokens and logprobs match
    the gather + SDPA reference the engine uses elsewhere."""
    from orbitrl.engine.attention_kernels import paged_decode
    from orbitrl.engine.decode_runner import ReferencePagedDecode

    model = orbitrl.load_model(hf_dirs["mistral"][0], device="cuda")  # sliding window 5
    prompts = random_prompts([5, 30, 9, 21, 2])
    p = SamplingParams(n=3, max_tokens=20, **GREEDY)
    eng = Engine(model, kv_budget_bytes=1 << 22, block_size=8)
    assert eng.attention_backend == "triton" and eng.decode_runner.attend.func is paged_decode
    ref = Engine(model, kv_budget_bytes=1 << 22, block_size=8, attention_backend="torch")
    assert isinstance(ref.decode_runner.attend, ReferencePagedDecode)
    a, b = eng.generate(prompts, p), ref.generate(prompts, p)
    assert _tokens(a) == _tokens(b)
    gap = max(abs(x - y) for oa, ob in zip(a, b) for sa, sb in zip(oa.samples, ob.samples)
              for x, y in zip(sa.raw_logprobs, sb.raw_logprobs))
    assert gap < 1e-4


def test_hooked_model_steps_eagerly_on_cuda(hf_dirs):
    """A forward hook (here a probe on the head, as the alignment row uses) runs at every
    decode step: the runner does not capture graphs while the model has hooks."""
    model = orbitrl.load_model(hf_dirs["llama"][0], device="cuda")
    rows = []
    h = model.lm_head.register_forward_hook(lambda m, i, o: rows.append(o.shape[0]))
    try:
        eng = Engine(model, kv_budget_bytes=1 << 22, max_num_seqs=1)
        out = eng.generate(random_prompts([7]), SamplingParams(max_tokens=9, **GREEDY))
    finally:
        h.remove()
    assert not eng.decode_runner._graphs
    assert len(out[0].samples[0].token_ids) == 9 and sum(rows) == 9
    eng.generate(random_prompts([7]), SamplingParams(max_tokens=9, **GREEDY))
    assert eng.decode_runner._graphs  # unhooked: captured again


def test_adapter_views_replay_the_same_graphs_on_cuda(hf_dirs):
    """rollout.overlap samples each step from a new adapter view: the runner copies it into
    its own tensors, so the graphs captured for the first view are replayed for the next,
    and give the eager runner's tokens for each."""
    from orbitrl.model.lora import adapter_view

    model = orbitrl.load_model(hf_dirs["llama"][0], device="cuda")
    views = lora_views(model)
    prompts = random_prompts([5, 11, 7])
    params = SamplingParams(n=2, max_tokens=10, **GREEDY)
    fast = Engine(model, kv_budget_bytes=1 << 22)
    slow = Engine(model, kv_budget_bytes=1 << 22, cuda_graphs=False)
    got, graphs = [], []
    for view in views:
        with adapter_view(view):
            a = _tokens(fast.generate(prompts, params))
            assert a == _tokens(slow.generate(prompts, params))
        got.append(a)
        graphs.append(dict(fast.decode_runner._graphs))
    assert got[0] != got[1]
    assert graphs[0] and all(graphs[1][k] is g for k, g in graphs[0].items())


def test_async_decode_equals_sync_on_cuda(hf_dirs):
    """The default on CUDA launches step k+1 before reading step k (graphs replayed, values
    through pinned buffers): the same samples as reading each step first, with stop_fn,
    stop ids and forks. Logprobs within 1e-5, not to the bit: a row that finished in the
    step in flight still runs the next one, so that step's batch can fall in a larger
    bucket (other GEMM shapes) and a group of GRPO samples still counts it as a member (its
    shared prompt read by the group kernel, then merged), each of which rounds apart."""
    model = orbitrl.load_model(hf_dirs["qwen2"][0], device="cuda")
    prompts = random_prompts([5, 30, 9, 21])
    lengths = {0: [3, 9, 30], 1: [6, 1, 12], 2: [2, 2, 20], 3: [5, 11, 8]}
    stop = lambda i, j, c: len(c) >= lengths[i][j]  # noqa: E731
    params = [SamplingParams(n=3, max_tokens=20, seed=1, ignore_eos=True),
              SamplingParams(n=3, max_tokens=24, **GREEDY),
              SamplingParams(n=3, max_tokens=18, seed=3, ignore_eos=True,
                             stop_token_ids=[7, 11, 13, 17, 19, 23]),
              SamplingParams(n=3, max_tokens=16, seed=4, temperature=0.7, top_p=0.9,
                             ignore_eos=True)]
    runs = []
    for async_decode in (None, False):
        eng = Engine(model, kv_budget_bytes=1 << 22, block_size=8, async_decode=async_decode)
        assert eng.async_decode == (async_decode is None)
        outs = eng.generate(prompts, params, stop_fn=stop)
        assert eng.decode_runner._graphs and eng.pool.num_free == eng.pool.num_blocks
        runs.append([(s.token_ids, s.logprobs, s.finish_reason) for o in outs
                     for s in o.samples])
    for (ids, lps, why), (ids1, lps1, why1) in zip(*runs):
        assert (ids, why) == (ids1, why1)
        assert max((abs(a - b) for a, b in zip(lps, lps1)), default=0.0) <= 1e-5
