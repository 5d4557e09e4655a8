"""The engine on mixtures: greedy tokens equal transformers' generate, and the routing it
records per sample is the routing a plain forward over the same tokens chooses."""

import pytest
import torch

import orbitrl
from hf_helpers import GREEDY, MOE_CONFIGS, hf_greedy as _hf_greedy, random_prompts
from orbitrl.engine import Engine, SamplingParams
from orbitrl.model import moe


@pytest.mark.parametrize("family", list(MOE_CONFIGS))
def test_greedy_matches_transformers(hf_dirs, family):
    path, hf = hf_dirs[family]
    model = orbitrl.load_model(path)
    prompts = random_prompts([3, 17, 9, 12])
    want = [_hf_greedy(hf, p, 10) for p in prompts]
    # continuous batching with chunked prefill, and one sequence at a time
    for max_seqs, budget in [(4, 2048), (1, 7)]:
        eng = Engine(model, kv_budget_bytes=1 << 20, block_size=4, max_num_seqs=max_seqs,
                     max_num_batched_tokens=budget)
        outs = eng.generate(prompts, SamplingParams(max_tokens=10, **GREEDY))
        for o, (toks, lps) in zip(outs, want):
            s = o.samples[0]
            assert s.token_ids == toks
            assert max(abs(a - b) for a, b in zip(s.raw_logprobs, lps)) < 1e-5


@pytest.mark.parametrize("kv_dtype", [None, "fp8"])
def test_recorded_routing_is_the_forward_routing(hf_dirs, kv_dtype):
    """n samples share their prompt's blocks (prefill once, then forked); each sample's record
    covers prompt and completion, the last sampled token (never fed back) is -1."""
    path, _ = hf_dirs["qwen3_moe"]
    model = orbitrl.load_model(path)
    prompt = random_prompts([6], seed=3)[0]
    eng = Engine(model, kv_budget_bytes=1 << 20, block_size=4, kv_dtype=kv_dtype)
    out = eng.generate([prompt], SamplingParams(n=3, max_tokens=5, seed=2, ignore_eos=True))
    assert len(out[0].samples) == 3
    S, k = len(model.config.moe.sparse_layers), model.config.moe.top_k
    for s in out[0].samples:
        rec = s.routing
        full = prompt + s.token_ids
        assert rec.shape == (S, len(full), k) and rec.dtype == torch.int16
        assert (rec[:, -1] == -1).all() and (rec[:, :-1] >= 0).all()
        r = moe.Routing(record=True)
        with torch.no_grad():
            model(torch.tensor([full[:-1]]), routing=r)
        got = r.chosen_tensor().sort(-1).values
        same = (got == rec[:, :-1].long().sort(-1).values).all(-1).float().mean()
        # fp8 KV moves hidden states enough to flip near ties (what replay is for); a
        # misaligned record would agree by chance only (1 in 56 for 3 of 8 experts)
        assert same >= (0.8 if kv_dtype else 1.0)


def test_dense_model_records_nothing(hf_dirs):
    path, _ = hf_dirs["qwen2"]
    eng = Engine(orbitrl.load_model(path), kv_budget_bytes=1 << 20, block_size=4)
    out = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=3, **GREEDY))
    assert out[0].samples[0].routing is None


def test_mixtures_decode_on_the_general_path(hf_dirs):
    """Even when asked for, a mixture never takes the static decode runner (which records
    no routing and cannot capture the experts' host-side grouping)."""
    model = orbitrl.load_model(hf_dirs[next(iter(MOE_CONFIGS))][0])
    eng = Engine(model, kv_budget_bytes=1 << 20, static_decode=True)
    assert not eng.static_decode
    out = eng.generate(random_prompts([4, 6]), SamplingParams(max_tokens=5, **GREEDY))
    assert all(o.samples[0].routing is not None for o in out)
