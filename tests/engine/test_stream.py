"""The engine's request stream (separate pools' rollout ranks): weights replaced between two
steps, a sample in flight continues on its KV or is cut and re-prefilled under the new
weights (``Engine.weights_changed``)."""

import pytest
import torch

import orbitrl
from orbitrl.engine import Engine, Request, SamplingParams
from hf_helpers import random_prompts


def _teacher_forced(model, ids: list[int], start: int) -> list[float]:
    """log p(ids[t] | ids[:t]) for t >= start, temperature 1, one dense forward."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0].float().log_softmax(-1)
    return [float(logits[t - 1, ids[t]]) for t in range(start, len(ids))]


@pytest.mark.parametrize("recompute", [False, True])
def test_weights_changed_mid_sample(hf_dirs, recompute):
    model = orbitrl.load_model(hf_dirs["qwen2"][0])
    prompt = random_prompts([9])[0]
    eng = Engine(model, kv_budget_bytes=1 << 20, block_size=4, static_decode=False)
    eng.begin_stream()
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True)
    eng.add_request(0, Request(prompt_ids=prompt), params)
    for _ in range(4):  # prefill + 3 decode steps: 4 tokens under the old weights
        assert not eng.step()
    seq = eng.scheduler.running[0]
    assert seq.num_completion == 4
    old = [float(x) for x in seq.logprobs]
    with torch.no_grad():  # "version 2": a different model in place, same tensors
        for p in model.parameters():
            p.mul_(1.3)
    cut = eng.weights_changed(recompute)
    assert cut == (1 if recompute else 0)
    if recompute:  # its KV is gone; its tokens so far stay and are re-prefilled
        assert not eng.scheduler.running and eng.scheduler.waiting[0] is seq
        assert seq.num_computed == 0 and seq.num_completion == 4
    done = []
    while eng.scheduler.has_work():
        done += eng.step()
    assert done == [seq] and seq.num_completion == 10
    assert seq.logprobs[:4] == old  # the tokens sampled before the swap keep their logprobs
    fresh = _teacher_forced(model, seq.token_ids, len(prompt) + 4)
    gap = max(abs(a - b) for a, b in zip(seq.logprobs[4:], fresh))
    if recompute:  # re-prefilled: exactly the new weights' distribution
        assert gap < 1e-4, gap
    else:  # continued on the old weights' KV of the first tokens: not the new model's
        assert gap > 1e-3, gap
