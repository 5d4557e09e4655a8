"""Multi-turn sequences: a parked sequence keeps (or swaps out) its KV between turns and
prefills only the tokens a turn added; its tokens and logprobs equal a from-scratch run of
the whole history."""

import pytest
import torch

import orbitrl
from orbitrl.engine import Engine, Request, SamplingParams
from orbitrl.engine.sequence import Status
from orbitrl.errors import OrbitError
from hf_helpers import random_prompts


def _drain(eng):
    done = []
    while eng.scheduler.has_work():
        done += eng.step()
    return done


def _fresh(model, history, max_tokens):
    eng = Engine(model, kv_budget_bytes=1 << 20, block_size=4)
    out = eng.generate([history], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                 ignore_eos=True))[0].samples[0]
    return out, eng.stats["prompt_tokens"]


@pytest.mark.parametrize("wait", ["resident", "swap"])
def test_five_turns_prefill_only_the_new_tokens(hf_dirs, wait):
    model = orbitrl.load_model(hf_dirs["qwen2"][0])
    eng = Engine(model, kv_budget_bytes=1 << 20, block_size=4, max_num_seqs=4)
    prompts = random_prompts([5, 9])
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, keep_kv=True)
    eng.begin([(Request(prompt_ids=p), params) for p in prompts])
    seqs = sorted(_drain(eng), key=lambda s: s.req_index)
    assert [s.prefilled for s in seqs] == [5, 9]  # turn 1: the prompt
    assert all(s.status == Status.PARKED and s.block_table for s in seqs)
    for turn in range(1, 5):  # four more turns: five in all
        envs = random_prompts([2 + turn, 7 - turn], seed=turn)
        before = [s.prefilled for s in seqs]
        for s, env in zip(seqs, envs):
            if wait == "swap":
                assert eng.swap_parked(s) > 0 and s.block_table == [] and s.swap is not None
            eng.resume(s, env, max_tokens=2 + turn % 2)
        done = _drain(eng)
        assert sorted(id(s) for s in done) == sorted(id(s) for s in seqs)
        for s, env, b in zip(seqs, envs, before):
            # the environment's tokens plus the last turn's final token, never the history
            assert s.prefilled - b == len(env) + 1
            history = s.token_ids[:s.num_prompt]
            want, recomputed = _fresh(model, history, 2 + turn % 2)
            assert s.completion_ids == want.token_ids
            assert max(abs(a - c) for a, c in zip(s.raw_logprobs, want.raw_logprobs)) < 1e-5
            assert recomputed == len(history)  # what a re-prefill would have cost
    if wait == "swap":
        assert eng.stats["kv_swapped_bytes"] > 0
        assert eng.stats["kv_swapped_in_bytes"] == eng.stats["kv_swapped_bytes"]
    for s in seqs:
        eng.release(s)
    assert eng.pool.num_free == eng.pool.num_blocks and not eng.scheduler.parked


def test_parked_kv_goes_to_host_before_running_work_is_preempted(hf_dirs):
    """A pool too small for the parked trajectories and a new request: the parked KV is
    swapped out (not the running sequence preempted), and resumes exactly."""
    model = orbitrl.load_model(hf_dirs["qwen2"][0])
    eng = Engine(model, kv_budget_bytes=1 << 20, block_size=4, max_num_seqs=4)
    eng.resize_pool(8)
    park = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, keep_kv=True)
    eng.begin([(Request(prompt_ids=p), park) for p in random_prompts([9, 9])])
    a, b = sorted(_drain(eng), key=lambda s: s.req_index)
    assert eng.pool.num_free < 4
    eng.begin([(Request(prompt_ids=random_prompts([17], seed=5)[0]),
                SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))])
    _drain(eng)
    assert eng.scheduler.num_parked_evicted >= 1 and eng.scheduler.num_preempted == 0
    evicted = [s for s in (a, b) if s.swap is not None]
    assert evicted
    s = evicted[0]
    eng.resume(s, [3, 4])
    _drain(eng)
    want, _ = _fresh(model, s.token_ids[:s.num_prompt], 3)
    assert s.completion_ids == want.token_ids


def test_governor_shrink_and_watchdog_cover_parked(hf_dirs):
    model = orbitrl.load_model(hf_dirs["qwen2"][0])
    eng = Engine(model, kv_budget_bytes=1 << 20, block_size=4)
    park = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, keep_kv=True)
    eng.begin([(Request(prompt_ids=p), park) for p in random_prompts([9, 13])])
    seqs = _drain(eng)
    high = max(b for s in seqs for b in s.block_table)
    eng.resize_pool(high)  # the holder of the last block goes to the host
    assert any(s.swap is not None for s in seqs)
    dropped = eng.abort()
    assert set(map(id, seqs)) <= set(map(id, dropped))
    assert eng.pool.num_free == eng.pool.num_blocks


def test_resume_rejects_bad_input(hf_dirs):
    model = orbitrl.load_model(hf_dirs["qwen2"][0])
    eng = Engine(model, kv_budget_bytes=1 << 20, block_size=4, max_model_len=16)
    eng.begin([(Request(prompt_ids=[1, 2, 3]), SamplingParams(max_tokens=2, keep_kv=True))])
    (s,) = _drain(eng)
    with pytest.raises(OrbitError, match="token ids"):
        eng.resume(s, [10 ** 6])
    with pytest.raises(OrbitError, match="no room"):
        eng.resume(s, [5] * 20)
    eng.resume(s, [5])
    with pytest.raises(OrbitError, match="not parked"):
        eng.resume(s, [5])
