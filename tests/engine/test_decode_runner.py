"""The static decode runner on CPU (eager, the same padding and bookkeeping as the CUDA-graph
path): tokens against the general path and transformers, padding rows, the device block
tables against the host's, a pool resize mid-run, seeds, adapters on a quantized base."""

import pytest
import torch

import orbitrl
from orbitrl.engine import Engine, Request, SamplingParams
from orbitrl.engine.decode_runner import ReferencePagedDecode
from hf_helpers import GREEDY, hf_greedy as _hf_greedy, lora_views, random_prompts


def _tokens(outs):
    return [[s.token_ids for s in o.samples] for o in outs]


@pytest.mark.parametrize("family", ["qwen2", "mistral", "qwen3", "llama_bias", "gemma2",
                                    "gemma3_text", "phi3"])
def test_static_greedy_matches_general_path_and_transformers(hf_dirs, family):
    path, hf = hf_dirs[family]
    model = orbitrl.load_model(path)
    prompts = random_prompts([3, 17, 9, 33, 1, 12])
    want = [_hf_greedy(hf, p, 14) for p in prompts]
    params = SamplingParams(max_tokens=14, **GREEDY)
    for bs in (4, 16):
        fast = Engine(model, static_decode=True, kv_budget_bytes=1 << 20, block_size=bs)
        slow = Engine(model, kv_budget_bytes=1 << 20, block_size=bs, static_decode=False)
        a, b = fast.generate(prompts, params), slow.generate(prompts, params)
        assert sum(n == k for n, k, _ in fast.timeline) >= 13  # pure decode steps ran
        assert _tokens(a) == _tokens(b) == [[t] for t, _ in want]
        for o, (_, lps) in zip(a, want):
            assert max(abs(x - y) for x, y in zip(o.samples[0].raw_logprobs, lps)) < 1e-5


def test_padding_rows_never_change_real_rows(hf_dirs):
    model = orbitrl.load_model(hf_dirs["llama"][0])
    prompts = random_prompts([5, 11, 7])
    params = SamplingParams(n=2, max_tokens=10, temperature=1.0, seed=3, ignore_eos=True)
    exact = Engine(model, static_decode=True, kv_budget_bytes=1 << 20, block_size=4)
    exact.decode_runner.buckets = list(range(1, exact.decode.capacity + 1))  # no padding
    padded = Engine(model, static_decode=True, kv_budget_bytes=1 << 20, block_size=4)
    padded.decode_runner.buckets = [16, padded.decode.capacity]  # 6 rows padded to 16
    a, b = exact.generate(prompts, params), padded.generate(prompts, params)
    assert _tokens(a) == _tokens(b)
    for x, y in zip(a, b):
        for s, t in zip(x.samples, y.samples):
            assert max(abs(u - v) for u, v in zip(s.raw_logprobs, t.raw_logprobs)) < 1e-5
    st = padded.decode
    st.flush()  # the last step's retirements are applied before the next step
    assert (st.context_lens == 0).all() and (st.positions == 0).all()  # rows retired


def test_device_block_tables_follow_the_host(hf_dirs):
    """Step by step: every row's device block table, position and context length equal the
    host sequence's, while rows join (fork), cross blocks and leave (compaction)."""
    model = orbitrl.load_model(hf_dirs["qwen2"][0])
    eng = Engine(model, static_decode=True, kv_budget_bytes=1 << 20, block_size=4)
    lengths = {0: [3, 9, 17], 1: [6, 2, 12]}
    reqs = [Request(prompt_ids=p, params=SamplingParams(n=3, max_tokens=20, seed=i,
                                                        ignore_eos=True))
            for i, p in enumerate(random_prompts([6, 10]))]
    stop = lambda i, j, c: len(c) >= lengths[i][j]  # noqa: E731
    for i, r in enumerate(reqs):
        eng.add_request(i, r, r.params)
    eng.stop_fn, eng._done = stop, {}
    checked = 0
    while eng.scheduler.has_work():
        eng.step()
        st = eng.decode
        if not st.valid:
            continue
        st.flush()  # apply queued compaction before reading the device rows
        for row, seq in enumerate(st.seqs):
            table = st.block_tables[row, :len(seq.block_table)].tolist()
            assert table == seq.block_table[:len(table)]
            assert st.positions[row] == st.pos_h[row] == seq.num_computed
            assert st.tokens[row] == seq.token_ids[-1]
            assert st.counters[row] == seq.num_completion
            checked += 1
        assert (st.context_lens[st.n:] == 0).all()
    assert checked > 20
    got = {(i, s.sample): s.num_completion for i, seqs in eng._done.items() for s in seqs}
    assert got == {(i, j): n for i, row in lengths.items() for j, n in enumerate(row)}


def test_pool_resize_mid_run(hf_dirs):
    model = orbitrl.load_model(hf_dirs["qwen3"][0])
    prompts = random_prompts([5, 14, 9, 20])
    params = SamplingParams(n=2, max_tokens=24, **GREEDY)
    want = Engine(model, static_decode=True, kv_budget_bytes=1 << 22, block_size=4).generate(prompts, params)
    eng = Engine(model, static_decode=True, kv_budget_bytes=1 << 22, block_size=4)
    full, sizes = eng.pool.num_blocks, []

    def hook(e):  # shrink hard after a few steps, grow back later
        k = e.stats["steps"]
        if k == 6:
            sizes.append(e.resize_pool(e.min_blocks()))
        elif k == 14:
            sizes.append(e.resize_pool(full))

    eng.memory_hook = hook
    got = eng.generate(prompts, params)
    assert sizes[0] < full and sizes[1] == full and eng.summary()["preemptions"] > 0
    assert _tokens(got) == _tokens(want)


def test_seeds_reproducible_and_independent_of_the_batch(hf_dirs):
    model = orbitrl.load_model(hf_dirs["qwen2"][0])
    target = Request(prompt_ids=random_prompts([7])[0],
                     params=SamplingParams(n=3, max_tokens=15, seed=99, ignore_eos=True))
    alone = Engine(model, static_decode=True, kv_budget_bytes=1 << 20).generate([target])[0]
    others = [Request(prompt_ids=p, params=SamplingParams(n=4, max_tokens=12,
                                                          temperature=0.8, top_p=0.9))
              for p in random_prompts([4, 30, 11], seed=5)]
    eng = Engine(model, static_decode=True, kv_budget_bytes=1 << 20, block_size=4)
    mixed = eng.generate(others[:2] + [target] + others[2:])
    assert _tokens([mixed[2]]) == _tokens([alone])
    assert len({tuple(s.token_ids) for s in alone.samples}) == 3
    # unseeded requests: the engine's seed makes the run reproducible
    runs = [_tokens(Engine(model, static_decode=True, kv_budget_bytes=1 << 20, seed=7).generate(others))
            for _ in range(2)]
    assert runs[0] == runs[1]
    assert runs[0] != _tokens(Engine(model, static_decode=True, kv_budget_bytes=1 << 20, seed=8).generate(others))


def test_lora_on_nf4_static_equals_general_path(hf_dirs):
    pytest.importorskip("torchao")
    from orbitrl.model.lora import apply_lora, set_adapters_enabled

    model = orbitrl.load_model(hf_dirs["llama"][0])
    apply_lora(model, rank=4, base_format="nf4")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    prompts = random_prompts([6, 13])
    params = SamplingParams(n=2, max_tokens=12, **GREEDY)
    fast = Engine(model, static_decode=True, kv_budget_bytes=1 << 20, block_size=4)
    slow = Engine(model, kv_budget_bytes=1 << 20, block_size=4, static_decode=False)
    a = fast.generate(prompts, params)
    assert _tokens(a) == _tokens(slow.generate(prompts, params))
    set_adapters_enabled(model, False)  # the reference policy through the same runner
    b = fast.generate(prompts, params)
    assert _tokens(b) == _tokens(slow.generate(prompts, params)) != _tokens(a)
    # a graph reads the kept dequantized copies by address: one remade elsewhere changes
    # the signature that drops the graphs
    from orbitrl.engine.engine import _adapter_signature
    from orbitrl.model.quant import FrozenLinear, cache_dequantized

    assert cache_dequantized(model, 1 << 30) > 0
    fast.generate(prompts, params)
    sig = _adapter_signature(model)
    assert sig == _adapter_signature(model) and len(sig[0][1]) > 0
    m = next(m for m in model.modules() if isinstance(m, FrozenLinear))
    old, m._cached = m._cached, None  # (old kept alive: the new copy lands elsewhere)
    m(torch.randn(2, m.in_features))
    assert _adapter_signature(model) != sig and old is not None


def test_reference_paged_decode_against_dense_attention():
    """Padding rows give zeros; a window and GQA against SDPA over each row's context."""
    torch.manual_seed(0)
    hq, hkv, d, bs, slots = 4, 2, 8, 4, 64
    kc, vc = torch.randn(slots, hkv, d), torch.randn(slots, hkv, d)
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 0, 0], [0, 0, 0, 0]], dtype=torch.int32)
    ctx = torch.tensor([13, 6, 0], dtype=torch.int32)
    q = torch.randn(3, hq, d)
    for window in (None, 5):
        out = ReferencePagedDecode()(q, kc, vc, tables, ctx, block_size=bs, scale=0.3,
                                     window=window)
        assert (out[2] == 0).all()
        for r in range(2):
            idx = (tables[r].long()[:, None] * bs + torch.arange(bs)).reshape(-1)[:ctx[r]]
            if window is not None:
                idx = idx[-window:]
            k = kc[idx].transpose(0, 1).repeat_interleave(hq // hkv, 0)
            v = vc[idx].transpose(0, 1).repeat_interleave(hq // hkv, 0)
            ref = torch.softmax((q[r][:, None] @ k.transpose(1, 2))[:, 0] * 0.3, -1)
            assert torch.allclose(out[r], (ref[:, None] @ v)[:, 0], atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_paged_decode_soft_caps_scores(dtype):
    """Gemma 2's attention soft-capping (cap * tanh(scores / cap) before the mask) in both
    of the reference's paths: fp32 on a CPU (in fp64) and any other dtype (no SDPA)."""
    torch.manual_seed(0)
    hq, hkv, d, bs, cap = 4, 2, 8, 4, 0.7
    kc, vc = torch.randn(64, hkv, d, dtype=dtype), torch.randn(64, hkv, d, dtype=dtype)
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 0, 0]], dtype=torch.int32)
    ctx = torch.tensor([13, 6], dtype=torch.int32)
    q = torch.randn(2, hq, d, dtype=dtype)
    out = ReferencePagedDecode()(q, kc, vc, tables, ctx, block_size=bs, scale=0.3,
                                 window=5, softcap=cap)
    plain = ReferencePagedDecode()(q, kc, vc, tables, ctx, block_size=bs, scale=0.3, window=5)
    assert (out - plain).abs().max() > 1e-2
    for r in range(2):
        idx = (tables[r].long()[:, None] * bs + torch.arange(bs)).reshape(-1)[:ctx[r]][-5:]
        k = kc[idx].transpose(0, 1).repeat_interleave(hq // hkv, 0)
        v = vc[idx].transpose(0, 1).repeat_interleave(hq // hkv, 0)
        s = (q[r][:, None] @ k.transpose(1, 2))[:, 0] * 0.3
        ref = torch.softmax(torch.tanh(s / cap) * cap, -1)
        assert torch.allclose(out[r], (ref[:, None] @ v)[:, 0], atol=1e-5)


def test_reference_rows_do_not_depend_on_the_gather_extent():
    """A row's output is the same to the bit whatever the batch's longest row makes the
    gathered extent (the async engine runs a finished row one step longer, the batch then
    gathers more blocks): fp32 SDPA over a longer masked gather changed 110 of 200 such
    rows on AVX-512 and AVX2 alike; the CPU reference attends in fp64 and rounds."""
    g = torch.Generator().manual_seed(0)
    b, hq, hkv, d, bs = 4, 4, 2, 16, 4
    kc, vc = torch.randn(256, hkv, d, generator=g), torch.randn(256, hkv, d, generator=g)
    q = torch.randn(b, hq, d, generator=g)
    for _ in range(50):
        ctx = torch.randint(1, 21, (b,), generator=g).int()
        tables = torch.randperm(64, generator=g)[:b * 8].view(b, 8).int()
        with torch.inference_mode():
            outs = [ReferencePagedDecode()(q, kc, vc, tables[:, :nb].contiguous(), ctx,
                                           block_size=bs, scale=0.25) for nb in (5, 6, 8)]
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_cpu_runner_attends_with_the_reference():
    from orbitrl.engine.decode_runner import default_attend

    assert isinstance(default_attend(torch.device("cpu")), ReferencePagedDecode)


def test_eager_steps_take_the_split_count_a_graph_would(hf_dirs, monkeypatch):
    """The kernel's key splits come from the buffers' full width (what a captured graph
    sees), also in an eager step that gathers only up to its longest row, so graphs and
    eager round alike; the reference takes no split count."""
    from orbitrl.engine import decode_runner
    from orbitrl.engine.attention_kernels import paged_decode_torch

    monkeypatch.setattr(decode_runner, "auto_splits", lambda b, h, ctx, dev: ctx)  # echoes
    seen = []

    def attend(q, k, v, bt, ctx, *, num_splits=None, prefix_groups=None, **kw):
        seen.append((bt.shape[1], num_splits))
        return paged_decode_torch(q, k, v, bt, ctx, **kw)

    model = orbitrl.load_model(hf_dirs["qwen2"][0])
    params = SamplingParams(n=2, max_tokens=6, **GREEDY)
    eng = Engine(model, static_decode=True, kv_budget_bytes=1 << 22, block_size=4)
    want = eng.generate(random_prompts([5, 9]), params)
    eng.decode_runner.attend = attend
    got = eng.generate(random_prompts([5, 9]), params)
    width = eng.decode_runner.state.max_blocks
    assert seen and all(s == width * 4 for _, s in seen)
    assert max(nb for nb, _ in seen) < width  # eager steps gathered fewer blocks
    assert _tokens(got) == _tokens(want)


def test_graphs_off_while_hooked_and_kept_across_adapter_views(hf_dirs):
    """A replay runs no module hooks, so the runner captures nothing while the model has any
    (tiers, sharding, a logits probe). An adapter view is copied into the runner's own
    tensors: a new view of the same shapes keeps the graphs; a LoRA switch, a view coming or
    going, or other shapes drop them."""
    from orbitrl.model.lora import apply_lora, snapshot_adapters

    model = orbitrl.load_model(hf_dirs["llama"][0])
    apply_lora(model, rank=4)
    eng = Engine(model, static_decode=True, kv_budget_bytes=1 << 20)
    r = eng.decode_runner
    r.graphs = True  # what CUDA sets; only begin() runs here
    r.begin((), None)
    assert r.capture
    h = model.lm_head.register_forward_hook(lambda m, i, o: None)
    r.begin((), None)
    assert not r.capture
    h.remove()
    h = model.model.layers[1].register_forward_pre_hook(lambda m, i: None)
    r.begin((), None)
    assert not r.capture
    h.remove()
    r.begin((), None)
    assert r.capture
    r._graphs[1] = "captured"
    view = snapshot_adapters(model)
    r.begin((), view)
    assert r._graphs == {}  # a view came
    r._graphs[1] = "captured"
    mine = r._view
    view2 = {k: (a + 1, b - 1) for k, (a, b) in view.items()}
    r.begin((), view2)
    assert r._graphs == {1: "captured"} and r._view is mine  # copied in, graphs kept
    k = next(iter(view2))
    assert torch.equal(mine[k][0], view2[k][0]) and torch.equal(mine[k][1], view2[k][1])
    r.begin((), {k: (a[:2], b) for k, (a, b) in view.items()})
    assert r._graphs == {}  # other shapes
    r._graphs[1] = "captured"
    r.begin((False,), None)
    assert r._graphs == {}  # the view went, a switch changed
    # the engine's signature leaves the switches out under a view (a view is always on):
    # the training thread turning adapters off (rollout.overlap) keeps the rollout's graphs
    from orbitrl.engine.engine import _adapter_signature
    from orbitrl.model.lora import adapter_view, adapters_disabled

    with adapter_view(view2):
        sig = _adapter_signature(model)
        with adapters_disabled(model):
            assert _adapter_signature(model) == sig
    on = _adapter_signature(model)
    assert on != sig
    with adapters_disabled(model):  # without a view the switches count
        assert _adapter_signature(model) != on


def test_static_runner_samples_the_adapter_view(hf_dirs):
    """Under lora.adapter_view the runner's steps use the view (copied into its tensors),
    not the live adapters: the same tokens as the general path, for two views in turn."""
    from orbitrl.model.lora import adapter_parameters, adapter_view

    model = orbitrl.load_model(hf_dirs["llama"][0])
    views = lora_views(model)
    with torch.no_grad():
        for p in adapter_parameters(model):
            p.zero_()  # the live adapters differ from both views
    prompts = random_prompts([5, 11, 7])
    params = SamplingParams(n=2, max_tokens=10, **GREEDY)
    fast = Engine(model, static_decode=True, kv_budget_bytes=1 << 20)
    slow = Engine(model, static_decode=False, kv_budget_bytes=1 << 20)
    got = []
    for view in views:
        with adapter_view(view):
            a = _tokens(fast.generate(prompts, params))
            assert a == _tokens(slow.generate(prompts, params))
        got.append(a)
    assert got[0] != got[1] != _tokens(slow.generate(prompts, params))
    assert sum(n == k for n, k, _ in fast.timeline) >= 9


def test_rollout_with_a_hooked_head_runs_the_hook_every_step(hf_dirs):
    """The engine's tokens with a forward hook on the head, through the static runner, and
    the hook saw one row per token (what the alignment probe relies on)."""
    model = orbitrl.load_model(hf_dirs["llama"][0])
    rows = []
    h = model.lm_head.register_forward_hook(lambda m, i, o: rows.append(o.shape[0]))
    try:
        eng = Engine(model, static_decode=True, kv_budget_bytes=1 << 20, max_num_seqs=1)
        out = eng.generate(random_prompts([7]), SamplingParams(max_tokens=9, **GREEDY))
    finally:
        h.remove()
    assert len(out[0].samples[0].token_ids) == 9 and sum(rows) == 9
