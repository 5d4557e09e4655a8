"""Advantage estimators and reward shaping against hand-computed values."""

from types import SimpleNamespace

import pytest
import torch

from orbitrl.config import AlgoSection
from orbitrl.errors import OrbitError
from orbitrl.rl.advantages import (discounted_returns, dynamic_sampling_mask, gae,
                                   grpo_advantages, overlong_penalty,
                                   reinforce_pp_advantages, rloo_advantages,
                                   shape_token_rewards, whiten)
from orbitrl.rl.score import loss_mask


def close(t, expected, atol=1e-5):
    torch.testing.assert_close(t.float(), torch.tensor(expected, dtype=torch.float32),
                               atol=atol, rtol=0)


# two prompts x 4 samples, plus an all-correct group
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])


def test_grpo_std_normalised():
    # group 1: mean .25, unbiased std sqrt(.75/3) = .5 -> [1.5, -.5, -.5, -.5]
    # group 2: mean .5, std sqrt(1/3) -> +-0.866025; group 3: all equal -> 0
    h = 0.866025
    close(grpo_advantages(REWARDS, 4),
          [1.5, -0.5, -0.5, -0.5, h, h, -h, -h, 0, 0, 0, 0])


def test_dr_grpo_no_std():
    close(grpo_advantages(REWARDS, 4, normalize_std=False),
          [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5, 0, 0, 0, 0])


def test_rloo_leave_one_out():
    # r_i - mean of the other three
    t = 1 / 3
    close(rloo_advantages(REWARDS, 4),
          [1, -t, -t, -t, 2 * t, 2 * t, -2 * t, -2 * t, 0, 0, 0, 0])
    with pytest.raises(OrbitError, match="rollout.n=1"):
        rloo_advantages(torch.tensor([1.0]), 1)


def test_group_shape_errors():
    with pytest.raises(OrbitError, match="groups of 4"):
        grpo_advantages(torch.zeros(6), 4)
    close(grpo_advantages(torch.tensor([3.0, 5.0]), 1), [0, 0])


def test_shape_token_rewards():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    kl = torch.tensor([[0.1, 0.2, 9.0], [0.5, 9.0, 9.0], [9.0, 9.0, 9.0]])
    out = shape_token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask, kl, kl_coef=0.1)
    close(out, [[-0.01, 0.98, 0.0], [1.95, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_discounted_returns():
    # gamma .5: G2 = 2, G1 = 0 + .5*2 = 1, G0 = 1 + .5*1 = 1.5
    out = discounted_returns(torch.tensor([[1.0, 0.0, 2.0, 7.0]]), torch.tensor([[1, 1, 1, 0]]), 0.5)
    close(out, [[1.5, 1.0, 2.0, 0.0]])


def test_reinforce_pp_global_whitening():
    mask = torch.tensor([[1, 1], [1, 0]])
    # returns [1, 1 | 0]: mean 2/3, unbiased std sqrt(1/3)
    close(reinforce_pp_advantages(torch.tensor([1.0, 0.0]), mask),
          [[0.57735, 0.57735], [-1.154701, 0.0]])
    # KL penalty .1 * [[.5, .5], [1]]: token rewards [-.05, .95 | -.1] -> returns [.9, .95 | -.1]
    kl = torch.tensor([[0.5, 0.5], [1.0, 0.0]])
    close(reinforce_pp_advantages(torch.tensor([1.0, 0.0]), mask, kl, kl_coef=0.1),
          [[0.534628, 0.619043], [-1.153672, 0.0]])


def test_reinforce_pp_group_baseline():
    # rewards [1, 0] minus group mean -> [.5, -.5]; one token each -> whitened to +-0.707107
    out = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), torch.ones(2, 1), group_size=2)
    close(out, [[0.707107], [-0.707107]])


def test_whiten_degenerate():
    close(whiten(torch.tensor([[3.0, 4.0]]), torch.tensor([[1, 0]])), [[0.0, 0.0]])


def test_gae_three_step_toy():
    # gamma .9, lam .8, r = [0, 0, 1], V = [.5, .6, .7]
    # t2: delta = 1 - .7 = .3                        A2 = .3
    # t1: delta = .9*.7 - .6 = .03                   A1 = .03 + .72*.3 = .246
    # t0: delta = .9*.6 - .5 = .04                   A0 = .04 + .72*.246 = .21712
    # row 2 is padded at t2 (garbage there): t1: delta = 1 - .6 = .4; A0 = .04 + .72*.4 = .328
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 5.0]])
    v = torch.tensor([[0.5, 0.6, 0.7], [0.5, 0.6, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = gae(r, v, mask, gamma=0.9, lam=0.8)
    close(adv, [[0.21712, 0.246, 0.3], [0.328, 0.4, 0.0]])
    close(ret, [[0.71712, 0.846, 1.0], [0.828, 1.0, 0.0]])


def test_gae_lambda_one_is_return_minus_value():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.7]])
    adv, ret = gae(r, v, torch.ones(1, 3), gamma=1.0, lam=1.0)
    close(adv, [[0.5, 0.4, 0.3]])
    close(ret, [[1.0, 1.0, 1.0]])


def test_dynamic_sampling_drops_equal_groups():
    keep = dynamic_sampling_mask(torch.tensor([1.0, 1, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]), 4)
    assert keep.tolist() == [True] * 4 + [False] * 8


def test_overlong_penalty_and_filter():
    # cap 10, buffer 4: free up to 6, linear to -1 at 10
    close(overlong_penalty(torch.tensor([5, 6, 8, 10, 12]), max_len=10, buffer=4),
          [0.0, 0.0, -0.5, -1.0, -1.0])
    with pytest.raises(OrbitError):
        overlong_penalty(torch.tensor([1]), max_len=10, buffer=0)
    # the filter the run applies (rl/score.py loss_mask, algo.overlong: filter): a truncated
    # sample's loss mask is zeroed; a copy (the packed batches keep their own masks)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    kept = [SimpleNamespace(truncated=t) for t in (False, True, False)]
    got = loss_mask(mask, kept, AlgoSection(overlong="filter"))
    close(got, [[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert mask[1].sum() == 3
    for other in ("none", "shape"):
        close(loss_mask(mask, kept, AlgoSection(overlong=other)), mask.tolist())


def test_per_turn_rewards_sit_at_the_end_of_their_turns():
    # a trajectory: model tokens 0-1 (turn 1), environment tokens 2-3 (mask 0), model
    # tokens 4-5 (turn 2); the environment rewarded turn 1 with .5, the verifier the
    # answer with 1. gamma .9, lam .8, V = [.1, .2, -, -, .3, .4] (garbage on env tokens):
    # t5: delta = 1 - .4 = .6                          A5 = .6
    # t4: delta = .9*.4 - .3 = .06                     A4 = .06 + .72*.6 = .492
    # t1: delta = .5 + .9*.3 - .2 = .57                A1 = .57 + .72*.492 = .92424
    # t0: delta = .9*.2 - .1 = .08                     A0 = .08 + .72*.92424 = .7454528
    from orbitrl.config import AlgoSection
    from orbitrl.rl.advantages import turn_reward_tensor
    from orbitrl.rl.score import ppo_advantages

    mask = torch.tensor([[1.0, 1, 0, 0, 1, 1]])
    v = torch.tensor([[0.1, 0.2, 9.0, 9.0, 0.3, 0.4]])
    turn = turn_reward_tensor([[(1, 0.5)]], mask.shape)
    close(turn, [[0, 0.5, 0, 0, 0, 0]])
    tok = shape_token_rewards(torch.tensor([1.0]), mask, extra=turn)
    close(tok, [[0, 0.5, 0, 0, 0, 1.0]])
    adv, ret = gae(tok, v, mask, gamma=0.9, lam=0.8)
    close(adv, [[0.7454528, 0.92424, 0, 0, 0.492, 0.6]])
    algo = AlgoSection(name="ppo", gamma=0.9, lam=0.8, kl_in_reward=False)
    _, ret2 = ppo_advantages(algo, torch.tensor([1.0]), v, mask, None, 0.0, turn)
    close(ret2, [[0.8454528, 1.12424, 0, 0, 0.792, 1.0]])
    # the sum in the sequence reward instead credits turn 2 with turn 1's reward too
    _, summed = ppo_advantages(algo, torch.tensor([1.5]), v, mask, None, 0.0)
    assert summed[0, 5] == pytest.approx(1.5) and summed[0, 4] > ret2[0, 4] + 0.3
