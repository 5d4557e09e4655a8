"""Engine behaviour on CPU with tiny random models: parity with transformers' greedy
generate, prefix sharing, preemption, seeds, fp8 KV, bad requests."""

import pytest
import torch

import orbitrl
from orbitrl.engine import Engine, Request, SamplingParams
from orbitrl.engine.sampler import filter_logits
from hf_helpers import (GREEDY, PHI3_SWITCH, ROPE_CONFIGS, ROPE_SWITCH,
                        hf_greedy as _hf_greedy, make_hf_model, random_prompts,
                        unconstrained_run)

# longrope and dynamic rope switch frequencies past ROPE_SWITCH tokens: transformers' prefill
# of a longer prompt rotates all of it with the switched ones, orbitrl (and transformers'
# one-token decode steps) by each token's position (model/rope.py), so these prompts stay
# within the switch and the 12 tokens decoded cross it
SWITCH_PROMPTS = [3, ROPE_SWITCH - 1, 9, 14, 1, 12]


@pytest.mark.parametrize("family", ["qwen2", "mistral", "qwen3", "llama3", "smollm3", "olmo2",
                                    "olmo3", "gemma2", "gemma3_text", "phi3"])
def test_greedy_matches_transformers(hf_dirs, family):
    path, hf = hf_dirs[family]
    _greedy_matches(orbitrl.load_model(path), hf, random_prompts([3, 17, 9, 33, 1, 12]))


@pytest.mark.parametrize("rope", list(ROPE_CONFIGS) + ["phi3"])
def test_greedy_matches_transformers_rope_scaling(rope, tmp_path, monkeypatch):
    hf = make_hf_model(rope, **PHI3_SWITCH if rope == "phi3" else {})
    hf.save_pretrained(tmp_path)
    if rope == "phi3":
        # transformers' Phi-3 generate re-encodes the whole sequence, prompt included, with
        # the long factors at the step that crosses the switch (its
        # prepare_inputs_for_generation), which no KV cache that keeps each token's rotation
        # (nor a trainer forward) reproduces; without that step it decodes as every other
        # model's rotary does, one token per forward (docs/models.md, "Rope scaling")
        from transformers import GenerationMixin

        monkeypatch.setattr(type(hf), "prepare_inputs_for_generation",
                            GenerationMixin.prepare_inputs_for_generation)
    # dynamic NTK's max_position_embeddings is the switch: the engine may go past it;
    # the general step and the static decode runner (CUDA graphs' path)
    model, prompts = orbitrl.load_model(tmp_path), random_prompts(SWITCH_PROMPTS)
    for static in (False, True):
        _greedy_matches(model, hf, prompts, max_model_len=64, static_decode=static)


def _greedy_matches(model, hf, prompts, **engine_kw):
    want = [_hf_greedy(hf, p, 12) for p in prompts]
    # batch sizes 1..6 at once, with and without chunked prefill, two block sizes
    for max_seqs, budget, bs in [(6, 2048, 16), (2, 16, 4), (4, 7, 8)]:
        eng = Engine(model, kv_budget_bytes=1 << 20, block_size=bs, max_num_seqs=max_seqs,
                     max_num_batched_tokens=budget, **engine_kw)
        outs = eng.generate(prompts, SamplingParams(max_tokens=12, **GREEDY))
        for o, (toks, lps) in zip(outs, want):
            s = o.samples[0]
            assert s.token_ids == toks
            assert max(abs(a - b) for a, b in zip(s.raw_logprobs, lps)) < 1e-5
            assert s.logprobs == [0.0] * 12 and s.finish_reason == "length"


def test_pool_size_from_ledger(hf_dirs):
    from orbitrl.ledger.kv import kv_blocks_for_budget, kv_bytes_per_block

    model = orbitrl.load_model(hf_dirs["qwen2"][0])
    cfg = model.config
    for kv, name, scale in [(None, "float32", 0), ("fp8", "fp8", 4)]:
        eng = Engine(model, kv_budget_bytes=100_000, block_size=8, kv_dtype=kv)
        bb = kv_bytes_per_block(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 8, name, scale)
        assert eng.pool.num_blocks == kv_blocks_for_budget(100_000, bb)
        assert eng.cache.nbytes == eng.pool.num_blocks * bb


def test_prefix_sharing_counters(hf_dirs):
    model = orbitrl.load_model(hf_dirs["qwen2"][0])
    eng = Engine(model, kv_budget_bytes=1 << 20, block_size=8)
    prompt = random_prompts([37])[0]  # 4 full blocks + 5 tokens
    out = eng.generate([prompt], SamplingParams(n=8, max_tokens=3, seed=1, ignore_eos=True))
    pool = eng.pool
    # prompt blocks allocated once (5); each sample but the last writer copies the partial one
    assert pool.cow == 7 and pool.allocated == 5 + 7 and pool.peak_used == 12
    assert len(out[0].samples) == 8
    assert len({tuple(s.token_ids) for s in out[0].samples}) > 1  # seeds differ per sample


def test_prefix_cache_across_requests(hf_dirs):
    model = orbitrl.load_model(hf_dirs["qwen2"][0])
    prompt = random_prompts([37])[0]
    reqs = [Request(prompt_ids=prompt, params=SamplingParams(n=8, max_tokens=3, seed=1)),
            Request(prompt_ids=prompt, params=SamplingParams(max_tokens=6, **GREEDY))]
    # the second request waits for the group (8 seqs max), then finds the 4 full blocks
    eng = Engine(model, kv_budget_bytes=1 << 20, block_size=8, max_num_seqs=8)
    out = eng.generate(reqs)
    assert eng.pool.prefix_hits == 4
    cold = Engine(model, kv_budget_bytes=1 << 20, block_size=8)
    b = cold.generate([prompt], SamplingParams(max_tokens=6, **GREEDY))[0].samples[0]
    assert out[1].samples[0].token_ids == b.token_ids
    # a new generate() call forgets cached prefixes (weights may have changed in between)
    eng.generate([prompt], SamplingParams(max_tokens=2, **GREEDY))
    assert eng.pool.prefix_hits == 4


def test_greedy_group_samples_identical(hf_dirs):
    path, hf = hf_dirs["llama"]
    model = orbitrl.load_model(path)
    eng = Engine(model, kv_budget_bytes=1 << 20, block_size=4)
    prompt = random_prompts([10])[0]
    out = eng.generate([prompt], SamplingParams(n=4, max_tokens=9, **GREEDY))[0]
    want, _ = _hf_greedy(hf, prompt, 9)
    assert all(s.token_ids == want for s in out.samples)


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_preemption_four_times_the_pool(hf_dirs, preempt):
    model = orbitrl.load_model(hf_dirs["qwen3"][0])
    prompts = random_prompts([5, 14, 9, 20, 3, 11])
    params = SamplingParams(n=2, max_tokens=24, **GREEDY)
    want, need, block_bytes = unconstrained_run(model, prompts, params)
    small = Engine(model, kv_budget_bytes=(need // 4) * block_bytes, block_size=4,
                   preempt=preempt)
    assert small.pool.num_blocks * 4 <= need
    got = small.generate(prompts, params)
    s = small.summary()
    assert s["preemptions"] > 0 and (s["swaps"] > 0) == (preempt == "swap")
    for a, b in zip(got, want):
        assert [x.token_ids for x in a.samples] == [x.token_ids for x in b.samples]
        for x, y in zip(a.samples, b.samples):
            assert max(abs(u - v) for u, v in zip(x.raw_logprobs, y.raw_logprobs)) < 1e-4


def test_seed_same_tokens_whatever_the_batch(hf_dirs):
    model = orbitrl.load_model(hf_dirs["qwen2"][0])
    target = Request(prompt_ids=random_prompts([7])[0],
                     params=SamplingParams(n=3, max_tokens=15, temperature=0.9, top_k=40,
                                           top_p=0.9, seed=1234, ignore_eos=True))
    alone = Engine(model, kv_budget_bytes=1 << 20).generate([target])[0]
    others = [Request(prompt_ids=p, params=SamplingParams(n=2, max_tokens=n, seed=i))
              for i, (p, n) in enumerate(zip(random_prompts([4, 30, 11], seed=5), [3, 20, 9]))]
    eng = Engine(model, kv_budget_bytes=1 << 20, block_size=4, max_num_seqs=5,
                 max_num_batched_tokens=8)
    mixed = eng.generate(others[:2] + [target] + others[2:])[2]
    assert [s.token_ids for s in mixed.samples] == [s.token_ids for s in alone.samples]
    assert len({tuple(s.token_ids) for s in alone.samples}) == 3
    for s in alone.samples:  # sampling logprob is under the filtered, tempered distribution
        assert all(lp <= 0 for lp in s.logprobs) and s.logprobs != s.raw_logprobs


def test_filter_matches_transformers_warpers():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    for k, p in [(5, 1.0), (0, 0.7), (10, 0.5)]:
        ref = x.clone()
        if k:
            ref = TopKLogitsWarper(k)(None, ref)
        if p < 1:
            ref = TopPLogitsWarper(p)(None, ref)
        got = filter_logits(x, torch.full((3,), k), torch.full((3,), p))
        assert torch.equal(torch.isinf(got), torch.isinf(ref))


def test_stop_token_ids_and_cap(hf_dirs):
    model = orbitrl.load_model(hf_dirs["qwen2"][0])
    eng = Engine(model, kv_budget_bytes=1 << 20)
    prompt = random_prompts([6])[0]
    full = eng.generate([prompt], SamplingParams(max_tokens=10, **GREEDY))[0].samples[0]
    stop = full.token_ids[4]
    first = full.token_ids.index(stop)
    out = eng.generate([prompt], SamplingParams(max_tokens=10, stop_token_ids=[stop],
                                                **GREEDY))[0].samples[0]
    assert out.token_ids == full.token_ids[:first + 1] and out.finish_reason == "stop"
    capped = eng.generate([prompt], [SamplingParams(max_tokens=3, **GREEDY)])[0].samples[0]
    assert capped.token_ids == full.token_ids[:3] and capped.finish_reason == "length"


def test_fp8_kv_logprob_change_measured(hf_dirs):
    model = orbitrl.load_model(hf_dirs["llama"][0])
    prompts = random_prompts([9, 21, 4])
    params = SamplingParams(max_tokens=16, **GREEDY)
    ref = Engine(model, kv_budget_bytes=1 << 20)
    fp8 = Engine(model, kv_budget_bytes=1 << 20, kv_dtype="fp8")
    assert fp8.block_bytes * 3 < ref.block_bytes  # 1 byte + 4/head_dim per element vs 4
    a, b = ref.generate(prompts, params), fp8.generate(prompts, params)
    # teacher-forced: score fp8's tokens under the full-precision cache
    diffs = []
    for x, y in zip(a, b):
        xs, ys = x.samples[0], y.samples[0]
        n = next((i for i, (u, v) in enumerate(zip(xs.token_ids, ys.token_ids)) if u != v), 16)
        diffs += [abs(u - v) for u, v in zip(xs.raw_logprobs[:n], ys.raw_logprobs[:n])]
    assert 0 < max(diffs) < 0.05, max(diffs)


def test_bad_requests_do_not_affect_others(hf_dirs):
    model = orbitrl.load_model(hf_dirs["qwen2"][0])
    eng = Engine(model, kv_budget_bytes=1 << 20, max_model_len=64)
    good = random_prompts([5])[0]
    reqs = [
        Request(prompt_ids=good, params=SamplingParams(max_tokens=4, **GREEDY)),
        Request(prompt_ids=[], params=SamplingParams()),
        Request(prompt_ids=list(range(64)), params=SamplingParams()),
        Request(prompt_ids=good, params=SamplingParams(max_tokens=0)),
        Request(prompt_ids=good, params=SamplingParams(n=0)),
        Request(prompt_ids=good, params=SamplingParams(stop_token_ids=[10_000])),
        Request(prompt="text", params=SamplingParams()),  # no tokenizer
        Request(prompt_ids=[5, 200], params=SamplingParams()),
        Request(prompt_ids=good, params=SamplingParams(max_tokens=4, **GREEDY)),
    ]
    outs = eng.generate(reqs)
    errs = [o.error for o in outs]
    assert errs[0] is None and errs[-1] is None
    for e, word in zip(errs[1:-1], ["empty", "context", "max_tokens", "n must",
                                    "stop token", "tokenizer", "prompt_ids"]):
        assert e is not None and word in e, e
    assert all(not o.samples for o in outs[1:-1])
    assert outs[0].samples[0].token_ids == outs[-1].samples[0].token_ids
    assert len(outs[0].samples[0].token_ids) == 4


def test_engine_sees_weight_updates(hf_dirs):
    """No copies: an in-place update of the model is what the next rollout samples."""
    model = orbitrl.load_model(hf_dirs["llama"][0])
    eng = Engine(model, kv_budget_bytes=1 << 20, block_size=4)
    prompt = random_prompts([8])[0]
    before = eng.generate([prompt], SamplingParams(max_tokens=1, **GREEDY))[0].samples[0]
    with torch.no_grad():  # an "optimizer step": the greedy token's logit flips sign
        model.lm_head.weight[before.token_ids[0]] *= -50.0
        model.model.layers[0].mlp.down_proj.weight.mul_(1.5)  # and the prompt's KV changes
    after = eng.generate([prompt], SamplingParams(max_tokens=1, **GREEDY))[0].samples[0]
    assert after.token_ids != before.token_ids
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([prompt]))[0, -1], -1)[after.token_ids[0]]
    assert abs(want.item() - after.raw_logprobs[0]) < 1e-5


def test_rollout_leaves_nothing_training_cannot_use(hf_dirs):
    """The runner's inference mode (dense models): the dequantized base it caches is a
    normal tensor, and a LoRA training step right after a rollout runs and trains."""
    from orbitrl.model.decoder import inference_safe
    from orbitrl.model.lora import adapter_parameters, apply_lora
    from orbitrl.model.quant import FrozenLinear, cache_dequantized

    model = orbitrl.load_model(hf_dirs["llama"][0])
    apply_lora(model, rank=4, alpha=8, base_format="nf4")
    assert cache_dequantized(model, 1 << 30) > 0
    eng = Engine(model, kv_budget_bytes=1 << 20, block_size=4)
    assert inference_safe(model)
    prompt = random_prompts([8])[0]
    eng.generate([prompt], SamplingParams(max_tokens=4, **GREEDY))
    cached = [m._cached[1] for m in model.modules() if isinstance(m, FrozenLinear)]
    assert cached and not any(w.is_inference() for w in cached)
    logits = model(torch.tensor([prompt]))
    logits.float().logsumexp(-1).sum().backward()
    assert all(p.grad is not None for p in adapter_parameters(model))


def test_fp8_dequantize_table_matches_the_conversion():
    """The CPU's 256-entry table gives what ``view(float8_e4m3fn).float()`` gives, for every
    code (NaN codes included), times the scale, in the requested dtype."""
    from orbitrl.engine.paged_attention import FP8, dequantize

    bits = torch.arange(256, dtype=torch.uint8).repeat(3).view(3, 4, 64)
    scale = torch.rand(3, 4, 1) + 0.5
    want = bits.view(FP8).float() * scale
    got = dequantize(bits, scale, torch.float32)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    typed = dequantize(bits.view(FP8), scale, torch.float32)  # an fp8-typed view of them
    assert torch.equal(typed.nan_to_num(), want.nan_to_num())
    half = dequantize(bits, scale, torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half.nan_to_num(),
                                                        want.to(torch.bfloat16).nan_to_num())
