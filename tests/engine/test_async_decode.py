"""``async_decode``: the static decode runner launches step k+1 before the host reads step
k's values. Every sample (tokens, logprobs, finish reasons, text), the blocks hashed for
prefix reuse and the block pool end as in the synchronous engine, through forks, stop ids, stop strings,
``stop_fn``, bucket padding, a pool too small (preemption), a pool resize, new weights,
multi-turn resumes and the watchdog."""

import pytest
import torch

import orbitrl
from orbitrl.engine import Engine, Request, SamplingParams
from hf_helpers import random_prompts


class _Letters:
    """A tokenizer for stop strings: token t decodes to one letter."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + t % 26) for t in ids)


def _engines(model, tokenizer=None, **kw):
    kw = dict(dict(static_decode=True, kv_budget_bytes=1 << 20, block_size=4), **kw)
    return (Engine(model, tokenizer, async_decode=False, **kw),
            Engine(model, tokenizer, async_decode=True, **kw))


def _samples(outs):
    return [[(s.token_ids, s.logprobs, s.raw_logprobs, s.finish_reason, s.text)
             for s in o.samples] for o in outs]


def _pool_empty(eng):
    assert eng.pool.num_free == eng.pool.num_blocks
    assert not eng.scheduler.has_work() and eng._flight is None


@pytest.fixture(scope="module")
def model(hf_dirs):
    return orbitrl.load_model(hf_dirs["qwen2"][0])


def test_default_is_cuda_only(model):
    assert not Engine(model, static_decode=True, kv_budget_bytes=1 << 20).async_decode
    assert not Engine(model, static_decode=False, async_decode=True,
                      kv_budget_bytes=1 << 20).async_decode  # needs the static runner


def test_samples_equal_the_synchronous_engine(model):
    """Forks (n=3), block crossings (block 4), a long-tailed stop_fn, stop ids, mixed
    temperatures and top-p, bucket padding; twice."""
    sync, asy = _engines(model, _Letters())
    prompts = random_prompts([6, 10, 3, 13])
    lengths = {0: [3, 9, 25], 1: [6, 1, 30], 2: [2, 2, 20], 3: [5, 11, 8]}
    stop_fn = lambda i, j, c: len(c) >= lengths[i][j]  # noqa: E731
    params = [SamplingParams(n=3, max_tokens=20, seed=1, ignore_eos=True),
              SamplingParams(n=3, max_tokens=14, seed=2, temperature=0.7, top_p=0.9,
                             ignore_eos=True),
              SamplingParams(n=3, max_tokens=18, seed=3, ignore_eos=True,
                             stop_token_ids=[7, 11, 13, 17, 19, 23]),
              SamplingParams(n=3, max_tokens=16, seed=4, ignore_eos=True, stop=["ab", "q"])]
    for eng in (sync, asy):
        eng.decode_runner.buckets = [4, 16, eng.decode.capacity]  # padded rows
    launches, launch = [], asy.decode_runner.launch
    asy.decode_runner.launch = lambda: launches.append(1) or launch()
    for _ in range(2):
        a = sync.generate(prompts, params, stop_fn=stop_fn)
        b = asy.generate(prompts, params, stop_fn=stop_fn)
        assert _samples(a) == _samples(b)
        assert {s.finish_reason for o in b for s in o.samples} == {"stop", "length"}
        _pool_empty(sync)
        _pool_empty(asy)
        # the same blocks hashed for reuse, decode-filled ones included
        assert sorted(asy.pool.cached) == sorted(sync.pool.cached)
        assert len(asy.pool.cached) > sum(len(p) // 4 for p in prompts) + 10
    assert asy.stats["generated_tokens"] == sync.stats["generated_tokens"]
    assert len(launches) >= 30  # decode steps through the runner


def test_no_extra_step_when_every_row_ends_by_length(model):
    sync, asy = _engines(model)
    params = SamplingParams(n=2, max_tokens=9, seed=0, ignore_eos=True)
    prompts = random_prompts([5, 8])
    assert _samples(sync.generate(prompts, params)) == _samples(asy.generate(prompts, params))
    assert asy.stats["steps"] == sync.stats["steps"]


def test_small_pool_preempts_and_resize_mid_run(model):
    prompts = random_prompts([5, 14, 9, 20])
    params = SamplingParams(n=2, max_tokens=24, seed=5, ignore_eos=True)
    outs, preempted = [], []
    for async_decode in (False, True):
        eng = Engine(model, static_decode=True, async_decode=async_decode,
                     kv_budget_bytes=1 << 22, block_size=4)
        eng.resize_pool(eng.min_blocks() + 3)  # too small for all eight samples
        full = eng.pool.num_blocks

        def hook(e):  # shrink hard, then grow (the step in flight is read first)
            if e.stats["steps"] == 9:
                e.resize_pool(e.min_blocks())
            elif e.stats["steps"] == 20:
                e.resize_pool(full + 40)

        eng.memory_hook = hook
        outs.append(eng.generate(prompts, params))
        preempted.append(eng.summary()["preemptions"])
        _pool_empty(eng)
    # the async engine claims each step's blocks one step earlier, so it may preempt at
    # another step; a sequence re-prefilled at another point rounds its logprobs apart
    assert [[s[0] for s in o] for o in _samples(outs[0])] == \
        [[s[0] for s in o] for o in _samples(outs[1])] and preempted[1] > 0
    assert max(abs(x - y) for a, b in zip(*outs) for s, t in zip(a.samples, b.samples)
               for x, y in zip(s.logprobs, t.logprobs)) < 1e-5


def test_new_weights_mid_stream(model, hf_dirs):
    """weights_changed reads the step in flight first: the tokens before the change are
    the old weights', as in the synchronous engine."""
    got = []
    for async_decode in (False, True):
        m = orbitrl.load_model(hf_dirs["qwen2"][0])
        eng = Engine(m, static_decode=True, async_decode=async_decode,
                     kv_budget_bytes=1 << 20, block_size=4)
        eng.begin_stream()
        for i, p in enumerate(random_prompts([9, 4])):
            eng.add_request(i, Request(prompt_ids=p),
                            SamplingParams(n=2, max_tokens=12, seed=i, ignore_eos=True))
        done = []
        for _ in range(6):
            done += eng.step()
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(1.1)
        eng.weights_changed(recompute=False)
        while eng.scheduler.has_work():
            done += eng.step()
        eng.reset_decode()
        done += eng._with_early([])
        got.append(sorted((s.req_index, s.sample, tuple(s.token_ids), tuple(s.logprobs))
                          for s in done))
    assert got[0] == got[1] and len(got[0]) == 4


def test_multi_turn_resume(model):
    """Parked sequences (keep_kv) resumed for three more turns: the same tokens and the
    same prefill counts (a finished row's extra step leaves its KV accounting as it was)."""
    runs = []
    for async_decode in (False, True):
        eng = Engine(model, static_decode=True, async_decode=async_decode,
                     kv_budget_bytes=1 << 20, block_size=4, max_num_seqs=4)
        park = SamplingParams(n=2, max_tokens=12, seed=9, ignore_eos=True, keep_kv=True)
        # turns of 3-6 tokens: two samples end where their last token starts a block
        eng.begin([(Request(prompt_ids=p), park) for p in random_prompts([5, 11])],
                  stop_fn=lambda i, j, c: len(c) >= 3 + 2 * i + j)
        seqs, log = [], []
        while eng.scheduler.has_work():
            seqs += eng.step()
        seqs.sort(key=lambda s: (s.req_index, s.sample))
        for turn in range(3):
            for k, (s, env) in enumerate(zip(seqs, random_prompts([2, 3, 4, 5], seed=turn))):
                eng.resume(s, env, max_tokens=2 + turn + k)
            done = []
            while eng.scheduler.has_work():
                done += eng.step()
            assert len(done) == len(seqs)
            log.append([(s.token_ids[:], s.logprobs[:], s.prefilled, s.num_computed,
                         len(s.block_table)) for s in seqs])
        for s in seqs:
            eng.release(s)
        _pool_empty(eng)
        runs.append(log)
    assert runs[0] == runs[1]


def test_watchdog_reads_the_step_in_flight(model):
    import time

    eng = Engine(model, static_decode=True, async_decode=True, kv_budget_bytes=1 << 20,
                 block_size=4)
    seen = []

    def hook(e):  # past the deadline at the sixth step, a decode step in flight
        if e.stats["steps"] == 5:
            seen.append(e._flight is not None)
            time.sleep(3.1)

    eng.memory_hook = hook
    outs = eng.generate(random_prompts([5, 7]),
                        SamplingParams(n=2, max_tokens=60, seed=0, ignore_eos=True),
                        deadline_s=3.0)
    assert seen == [True] and eng.stats["aborted"] == 4 and all(not o.samples for o in outs)
    _pool_empty(eng)
    eng.memory_hook = None  # the next batch starts clean: nothing of the last one returns
    again = eng.generate(random_prompts([5, 7]),
                         SamplingParams(n=2, max_tokens=6, seed=0, ignore_eos=True))
    assert [len(s.token_ids) for o in again for s in o.samples] == [6] * 4


def test_abort_from_a_hook_then_a_new_batch(model):
    """A caller's abort (a rollout's stop request) reads the step in flight first; the
    engine then runs the next batch as a fresh one."""
    eng = Engine(model, static_decode=True, async_decode=True, kv_budget_bytes=1 << 20,
                 block_size=4)

    class Stop(Exception):
        pass

    def hook(e):
        if e.stats["steps"] == 7:
            e.abort()
            raise Stop

    eng.memory_hook = hook
    with pytest.raises(Stop):
        eng.generate(random_prompts([5, 7]), SamplingParams(n=2, max_tokens=30, seed=0,
                                                            ignore_eos=True))
    assert not eng.scheduler.has_work() and eng._flight is None
    eng.memory_hook = None
    sync = Engine(model, static_decode=True, kv_budget_bytes=1 << 20, block_size=4)
    p, params = random_prompts([9, 4]), SamplingParams(n=2, max_tokens=8, seed=1,
                                                       ignore_eos=True)
    assert _samples(eng.generate(p, params)) == _samples(sync.generate(p, params))
    _pool_empty(eng)


def test_off_while_hooked(model):
    """A forward hook sees every step the engine runs: with one on the head, no step is
    launched ahead (the alignment probe pairs the head's outputs with the tokens)."""
    eng = Engine(model, static_decode=True, async_decode=True, kv_budget_bytes=1 << 20,
                 block_size=4)
    rows = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: rows.append(o.shape[0]))
    try:
        out = eng.generate([random_prompts([6])[0]],
                           SamplingParams(max_tokens=8, seed=0, ignore_eos=True),
                           stop_fn=lambda i, j, c: len(c) >= 5)[0]
    finally:
        hook.remove()
    assert len(out.samples[0].token_ids) == 5 and len(rows) == 5


def test_resize_every_step_reads_the_last_rows(model):
    """A governor resizing the pool before every step reads the step in flight; when that
    step finished every sample, the next step() returns them (no empty schedule)."""
    runs = []
    for async_decode in (False, True):
        eng = Engine(model, static_decode=True, async_decode=async_decode,
                     kv_budget_bytes=1 << 20, block_size=4)
        flip = [0]

        def hook(e):
            flip[0] ^= 1
            e.resize_pool(e.pool.num_blocks + (1 if flip[0] else -1))

        eng.memory_hook = hook
        runs.append(_samples(eng.generate(random_prompts([5, 7]), SamplingParams(
            n=2, max_tokens=9, seed=1, ignore_eos=True))))
        _pool_empty(eng)
    assert runs[0] == runs[1]
