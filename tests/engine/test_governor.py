"""The KV pool shrinks when free memory falls below the floor and grows back when it returns;
outputs do not change, nothing deadlocks (tests/conftest.py's hard timeout covers tests/engine)."""

import pytest
import torch

import orbitrl
from orbitrl.engine import Engine, SamplingParams
from orbitrl.engine.governor import KVGovernor, available_memory, hand_back
from orbitrl.engine.paged_attention import KVCache
from hf_helpers import GREEDY, random_prompts, unconstrained_run


class FakeMemory:
    """Free memory that drops after ``drop_at`` calls and comes back at ``back_at``."""

    def __init__(self, high, low, drop_at, back_at):
        self.high, self.low, self.drop_at, self.back_at, self.calls = high, low, drop_at, back_at, 0

    def __call__(self):
        self.calls += 1
        return self.low if self.drop_at <= self.calls < self.back_at else self.high


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_throttle_then_grow_keeps_outputs(hf_dirs, preempt):
    model = orbitrl.load_model(hf_dirs["qwen3"][0])
    prompts = random_prompts([5, 14, 9, 20, 3, 11])
    params = SamplingParams(n=3, max_tokens=20, **GREEDY)
    want, need, block_bytes = unconstrained_run(model, prompts, params)

    eng = Engine(model, kv_budget_bytes=need * block_bytes, block_size=4, preempt=preempt)
    bb = eng.block_bytes
    floor = 100 * bb
    # free memory 40 blocks below the floor from the 4th step to the 30th, then plenty
    mem = FakeMemory(high=floor + 400 * bb, low=floor - 40 * bb, drop_at=4, back_at=30)
    gov = KVGovernor(floor, max_blocks=need, available_fn=mem)
    eng.memory_hook = gov
    got = eng.generate(prompts, params)
    s = eng.summary()
    assert gov.throttle_events >= 1 and gov.blocks_released > 0
    assert gov.low_blocks < need
    assert s["preemptions"] > 0  # the throttle preempted holders of the released blocks
    assert gov.grow_events >= 1 and eng.pool.num_blocks > gov.low_blocks
    assert eng.pool.num_blocks <= need  # never past the cap
    assert s["kv_throttle_events"] == gov.throttle_events
    for a, b in zip(got, want):
        assert [x.token_ids for x in a.samples] == [x.token_ids for x in b.samples]


def test_throttle_never_below_one_sample(hf_dirs):
    """Free memory stays far below the floor: the pool shrinks to one sample's blocks and the
    rollout still completes (one sequence at a time)."""
    model = orbitrl.load_model(hf_dirs["qwen2"][0])
    prompts = random_prompts([6, 9, 4])
    params = SamplingParams(n=2, max_tokens=10, **GREEDY)
    want = Engine(model, kv_budget_bytes=1 << 22, block_size=4).generate(prompts, params)
    eng = Engine(model, kv_budget_bytes=1 << 22, block_size=4)
    eng.memory_hook = gov = KVGovernor(1 << 40, max_blocks=eng.pool.num_blocks,
                                       available_fn=lambda: 0)
    got = eng.generate(prompts, params)
    # down to what the longest sample still queued needs (19 tokens -> 5 blocks, then 4)
    assert gov.low_blocks <= -(-(9 + 10) // 4)
    assert eng.cache.k.shape[1] == eng.pool.num_blocks * 4  # the memory really went
    for a, b in zip(got, want):
        assert [x.token_ids for x in a.samples] == [x.token_ids for x in b.samples]


def test_cache_resize_keeps_slots_and_fp8_scales():
    c = KVCache(2, 2, 4, num_blocks=3, block_size=4, dtype=torch.float32, device="cpu", fp8=True)
    k = torch.randn(5, 2, 4)
    c.write(1, torch.arange(5), k, k)
    before = c.read(1, torch.arange(5))[0]
    c.resize(6)
    assert c.k.shape[1] == 24 and bool((c.k_scale[:, 12:] == 1).all())
    torch.testing.assert_close(c.read(1, torch.arange(5))[0], before)
    c.resize(2)
    assert c.k.shape[1] == 8 and c.nbytes < 24 * 2 * 2 * 4 * 2
    torch.testing.assert_close(c.read(1, torch.arange(5))[0], before)


def test_available_memory_and_hand_back_on_host():
    free = available_memory("cpu")
    assert 0 < free < 1 << 50
    # many small freed objects leave heap pages that malloc_trim can return
    junk = [torch.empty(4000, dtype=torch.uint8) for _ in range(20000)]
    del junk
    released = hand_back("cpu")
    assert released >= 0
