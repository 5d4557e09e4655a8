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


def _groups(n_groups=4, n=5, seed=1, vocab=90, P=(3, 10), C=(0, 9)):
    """GRPO-shaped samples: n completions per prompt (an empty completion included)."""
    rng = random.Random(seed)
    out = []
    for g in range(n_groups):
        prompt = [rng.randrange(2, vocab) for _ in range(rng.randint(*P))]
        for _ in range(n):
            c = rng.randint(*C)
            out.append(Sample(g, list(prompt), [rng.randrange(2, vocab) for _ in range(c)],
                              [-rng.random() for _ in range(c)], "length", ""))
    return out


def test_a_group_shares_one_prompt_copy_when_it_fits_the_row():
    s = _groups()
    P = {g: len(x.prompt_ids) for x in s for g in [x.group]}
    shared = pack(s, "cpu", row_tokens=200)
    assert shared.parent_ids is not None
    assert shared.num_tokens == sum(P.values()) + sum(len(x.completion_ids) for x in s)
    flat_ids, flat_pos = shared.input_ids.flatten(), shared.positions.flatten()
    flat_sid, flat_par = shared.seq_ids.flatten(), shared.parent_ids.flatten()
    for i, x in enumerate(s):
        mine = (flat_sid == i).nonzero()[:, 0]
        assert flat_ids[mine].tolist() == x.completion_ids
        # positions continue from the prompt; the prompt copy is this completion's parent
        assert flat_pos[mine].tolist() == list(range(P[x.group], P[x.group] + len(mine)))
        parent = set(flat_par[mine].tolist())
        if mine.numel():
            (p,) = parent
            assert flat_ids[flat_sid == p].tolist() == x.prompt_ids
    # a row too narrow for a whole group: every sample gets its own prompt copy
    alone = pack(s, "cpu", row_tokens=0)
    assert alone.parent_ids is None
    assert alone.num_tokens == sum(len(x.prompt_ids) + len(x.completion_ids) for x in s)
    assert pack(s, "cpu", row_tokens=200, share_prompts=False).parent_ids is None


def test_a_long_prompt_group_widens_its_row(model):
    """A chat prompt longer than its completions: the group is laid out whole in a row
    wider than the longest sample when that costs no more attention ((P + sum C)^2 <= sum
    (P + C)^2); its logprobs equal one prompt copy per sample. Long completions keep their
    own rows."""
    from orbitrl.rl.batch import positions

    rng = random.Random(3)

    def group(g, P, C, n):
        prompt = [rng.randrange(2, 90) for _ in range(P)]
        return [Sample(g, prompt, [rng.randrange(2, 90) for _ in range(C)], [-0.5] * C,
                       "length", "") for _ in range(n)]

    s = group(0, 47, 16, 8) + group(1, 47, 14, 8)
    shared = pack(s, "cpu")
    assert shared.parent_ids is not None and shared.input_ids.shape == (2, 47 + 8 * 16)
    assert positions(s) == 2 * 175 < 8 * 63 + 8 * 61
    with torch.no_grad():
        got = score(model, shared)
        ref = score(model, pack(s, "cpu", share_prompts=False))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    long = group(2, 8, 40, 8)  # (8 + 320)^2 > 8 x 48^2: one row each
    assert pack(long, "cpu").parent_ids is None and positions(long) == 8 * 48


@pytest.fixture(scope="module")
def window_model(tmp_path_factory):
    """A tiny Mistral-shaped model with a sliding window of 5 (shorter than the samples)."""
    from hf_helpers import make_hf_model

    d = tmp_path_factory.mktemp("mistral")
    make_hf_model("mistral").save_pretrained(d)
    return load_model(d).eval()


@pytest.mark.parametrize("which", ["builtin", "window"])
@pytest.mark.parametrize("row_tokens", [64, 200])
def test_shared_prompt_logprobs_match_one_copy_per_sample(model, window_model, which,
                                                          row_tokens):
    m = model if which == "builtin" else window_model
    s = _groups(vocab=90)
    with torch.no_grad():
        got = score(m, pack(s, "cpu", row_tokens=row_tokens))
        ref = score(m, pack(s, "cpu", row_tokens=row_tokens, share_prompts=False))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert got.abs().sum() > 0


def test_shared_prompt_gradients_match_one_copy_per_sample():
    """The prompt copy's gradient is the sum of what each sample's own copy received."""
    from orbitrl.model.lora import adapter_parameters, apply_lora

    torch.manual_seed(0)
    m = load_model(resolve_model_path("builtin:tiny-arith"), base_format="nf4")
    apply_lora(m, rank=4)
    params = adapter_parameters(m)
    with torch.no_grad():  # B starts at zero: give the adapters a nonzero delta
        for p in params:
            p.add_(0.05 * torch.randn_like(p))
    s = _groups(vocab=90)
    grads = []
    for share in (True, False):
        b = pack(s, "cpu", row_tokens=200, share_prompts=share)
        (score(m, b) * b.mask).sum().backward()
        grads.append([p.grad.clone() for p in params])
        for p in params:
            p.grad = None
    for g1, g2 in zip(*grads):  # float sums in another order: relative to the whole tensor
        assert float((g1 - g2).norm() / g2.norm()) < 1e-5
    assert sum(float(g.abs().sum()) for g in grads[0]) > 0


def test_micro_batches_count_the_padded_positions_pack_computes():
    """A micro-batch's rows x row length stays within the budget (what the memory ledger
    prices as its tokens), padding included; counting sample tokens alone let three short
    samples into a budget that two rows of the longest fill."""
    from orbitrl.rl.batch import micro_batches, positions

    s = _samples(40, seed=3)
    for budget in (24, 40, 64, 100):
        groups = micro_batches(s, budget)
        assert sorted(i for g in groups for i in g) == list(range(len(s)))  # in order, all
        for g in groups:
            b = pack([s[i] for i in g], "cpu")
            assert positions([s[i] for i in g]) == b.input_ids.numel()
            assert b.input_ids.numel() <= budget or len(g) == 1
    # the case that overflowed: rows padded to the longest sample (each its own row)
    long = [Sample(0, [5] * 40, [6] * 23, [-1.0] * 23, "length", ""),
            Sample(1, [7] * 40, [6] * 20, [-1.0] * 20, "length", ""),
            Sample(2, [8] * 40, [6] * 16, [-1.0] * 16, "length", "")]
    assert sum(len(x.prompt_ids) + len(x.completion_ids) for x in long) == 179
    assert positions(long) == 3 * 63 and micro_batches(long, 180) == [[0, 1], [2]]


@pytest.mark.parametrize("prompt,cap,group,samples,budget", [
    (47, 16, 8, 32, 359),    # SmolLM2's chat prompts: two shared groups of 175
    (10, 20, 1, 5, 4096),    # unshared samples of 30 in rows of 64: padding counts
    (5, 10, 2, 10, 4096),    # short groups sharing a row
    (100, 30, 2, 6, 300),    # the budget cuts a group
    (6, 8, 8, 64, 4096),     # the built-in task at its cap
])
def test_the_ledger_prices_the_first_micro_batch_the_trainer_cuts(prompt, cap, group, samples,
                                                                  budget):
    """``ledger.memory.cap_micro_positions`` (the a-priori micro-batch, every reply at the
    cap) equals the positions ``micro_batches`` + ``pack`` give real samples of that shape."""
    from orbitrl.ledger.memory import cap_micro_positions
    from orbitrl.rl.batch import micro_batches

    ss = [Sample(g // group, [3 + g // group] * prompt, [5] * cap, [0.0] * cap, "length", "")
          for g in range(samples)]
    first = micro_batches(ss, budget)[0]
    want = pack([ss[i] for i in first], "cpu").input_ids.numel()
    assert cap_micro_positions(prompt, cap, group, samples, budget) == want
