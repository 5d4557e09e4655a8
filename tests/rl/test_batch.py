"""Packing samples into rows: layout, and logprobs equal to scoring each sample alone."""

import random

import pytest
import torch

from orbitrl.model.builtin import resolve_model_path
from orbitrl.model.weights import load_model
from orbitrl.rl.batch import pack, score
from orbitrl.rl.types import Sample


def _samples(n=13, seed=0, vocab=100):
    rng = random.Random(seed)
    out = []
    for g in range(n):
        P, C = rng.randint(2, 12), rng.randint(1, 9)
        out.append(Sample(g, [rng.randrange(2, vocab) for _ in range(P)],
                          [rng.randrange(2, vocab) for _ in range(C)],
                          [-rng.random() for _ in range(C)], "length", ""))
    return out


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return load_model(resolve_model_path("builtin:tiny-arith"), base_format="nf4").eval()


def test_rows_hold_each_sample_whole_and_targets_map_back():
    s = _samples()
    b = pack(s, "cpu", row_tokens=24)
    R, L = b.input_ids.shape
    lens = [len(x.prompt_ids) + len(x.completion_ids) for x in s]
    assert L <= max(max(lens), 24) and R > 1  # several rows, none longer than the width
    assert b.num_tokens == sum(lens) == int((b.seq_ids >= 0).sum())
    flat_ids, flat_sid = b.input_ids.flatten(), b.seq_ids.flatten()
    for i, x in enumerate(s):
        where = (flat_sid == i).nonzero()[:, 0]
        assert where.numel() == lens[i] and (where.diff() == 1).all()  # one contiguous run
        assert flat_ids[where].tolist() == x.prompt_ids + x.completion_ids
    # every target is the token after its source position, in the same sample
    assert torch.equal(flat_ids[b.src + 1], b.targets)
    assert torch.equal(flat_sid[b.src], flat_sid[b.src + 1])
    T = b.mask.shape[1]
    for i, x in enumerate(s):
        C = len(x.completion_ids)
        assert b.mask[i].tolist() == [1.0] * C + [0.0] * (T - C)
        assert b.rollout_logp[i, :C].tolist() == pytest.approx(x.rollout_logprobs)


@pytest.mark.parametrize("row_tokens", [0, 24, 64, 10**6])
def test_logprobs_match_scoring_each_sample_alone(model, row_tokens):
    """Rows (any width, one row included) give each sample the logprobs it has alone:
    attention never crosses samples and padding changes nothing."""
    s = _samples()
    with torch.no_grad():
        got = score(model, pack(s, "cpu", row_tokens=row_tokens))
        for i, x in enumerate(s):
            alone = score(model, pack([x], "cpu"))[0]
            C = len(x.completion_ids)
            torch.testing.assert_close(got[i, :C], alone[:C], atol=1e-5, rtol=1e-5)
            assert (got[i, C:] == 0).all()
