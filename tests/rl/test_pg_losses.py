"""Policy, value, KL and entropy losses against hand-computed values.

Named test_pg_losses.py (not test_losses.py) so it cannot collide with tests/train's module
under pytest's default import mode.
"""

import math

import pytest
import torch

from orbitrl.errors import OrbitError
from orbitrl.rl.losses import (AdaptiveKLController, FixedKLController, actor_loss, aggregate,
                               entropy_from_logits, kl_estimate, kl_loss, make_kl_controller,
                               policy_loss, sequence_log_ratio, tis_weights, value_loss)

LOG2 = math.log(2.0)


def close(t, expected):
    torch.testing.assert_close(t, torch.tensor(expected, dtype=t.dtype), atol=1e-6, rtol=0)


def per_token_losses(ratios, advs, **kw):
    """Loss of each (ratio, advantage) pair as its own one-token batch."""
    out = []
    for r, a in zip(ratios, advs):
        logp = torch.tensor([[math.log(r)]])
        loss, _ = policy_loss(logp, torch.zeros(1, 1), torch.tensor([a]), torch.ones(1, 1), **kw)
        out.append(loss.item())
    return out


def test_ppo_clip_hand_values():
    # r=2,A=1: max(-2, -1.2) = -1.2 (clipped); r=2,A=-1: max(2, 1.2) = 2 (pessimistic, unclipped)
    # r=.5,A=1: max(-.5, -.8) = -.5; r=.5,A=-1: max(.5, .8) = .8 (clipped)
    got = per_token_losses([2, 2, 0.5, 0.5], [1, -1, 1, -1], clip_low=0.2, clip_high=0.2)
    assert got == pytest.approx([-1.2, 2.0, -0.5, 0.8], abs=1e-6)
    # slime's case: ratios [2, 2, 0.5], advantages [2, -1.5, 2]
    got = per_token_losses([2, 2, 0.5], [2, -1.5, 2], clip_low=0.2, clip_high=0.2)
    assert got == pytest.approx([-2.4, 3.0, -1.0], abs=1e-6)


def test_ppo_batch_mean_and_clip_frac():
    logp = torch.tensor([[math.log(2), math.log(2), math.log(0.5), math.log(0.5)]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    loss, m = policy_loss(logp, torch.zeros(1, 4), adv, torch.ones(1, 4), clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx((-1.2 + 2.0 - 0.5 + 0.8) / 4, abs=1e-6)
    assert m["clip_frac"] == pytest.approx(0.5)
    assert m["clip_frac_high"] == pytest.approx(0.25) and m["clip_frac_low"] == pytest.approx(0.25)
    assert m["ratio_max"] == pytest.approx(2.0) and m["ratio_min"] == pytest.approx(0.5)


def test_default_clip_is_0_1():
    assert per_token_losses([2.0], [1.0]) == pytest.approx([-1.1], abs=1e-6)


def test_clip_higher():
    # low 0.2, high 0.28: r=2,A=1 -> -1.28; r=1.25,A=1 -> -1.25 (inside); r=.5,A=-1 -> .8
    got = per_token_losses([2, 1.25, 0.5], [1, 1, -1], clip_low=0.2, clip_high=0.28)
    assert got == pytest.approx([-1.28, -1.25, 0.8], abs=1e-6)
    # symmetric 0.2 clips the 1.25 ratio
    assert per_token_losses([1.25], [1], clip_low=0.2, clip_high=0.2) == pytest.approx([-1.2], abs=1e-6)


def test_dual_clip():
    # r=4,A=-1: max(4, 1.2) = 4, capped at -A*3 = 3; r=2,A=-1: 2 < 3 stays; A>0 untouched
    got = per_token_losses([4, 2, 4], [-1, -1, 1], clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    assert got == pytest.approx([3.0, 2.0, -1.2], abs=1e-6)
    with pytest.raises(OrbitError):
        per_token_losses([1], [1], dual_clip=1.0)


def test_gspo_sequence_ratio_value_and_gradient():
    # seq 0: token ratios 2 and 8 -> geometric mean 4; third token masked out
    # seq 1: token ratios 0.5 and 2 -> 1
    log_r = torch.tensor([[LOG2, 3 * LOG2, 5.0], [-LOG2, LOG2, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    old = torch.zeros(2, 3)
    assert sequence_log_ratio(log_r, old, mask).exp().tolist() == pytest.approx([4.0, 1.0])
    logp = log_r.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0])
    loss, m = policy_loss(logp, old, adv, mask, ratio_level="sequence", agg="seq-mean-token-mean",
                          clip_low=10.0, clip_high=10.0)
    # per sequence -A*s: -4 and +1, mean -1.5
    assert loss.item() == pytest.approx(-1.5, abs=1e-6)
    loss.backward()
    # d/dlogp_t of mean_i(-A_i s_i) = -A_i s_i / (|y_i| * B): -4/4 = -1, +1/4
    close(logp.grad, [[-1.0, -1.0, 0.0], [0.25, 0.25, 0.0]])
    # clipped at sequence level: 4 -> 1.2 with clip 0.2
    loss, m = policy_loss(log_r, old, adv, mask, ratio_level="sequence", agg="seq-mean-token-mean",
                          clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx((-1.2 + 1.0) / 2, abs=1e-6)
    assert m["clip_frac"] == pytest.approx(0.5)


def test_tis_weights_capped_and_detached():
    trainer = torch.tensor([[math.log(1.5), math.log(3.0), math.log(0.5)]], requires_grad=True)
    w = tis_weights(trainer, torch.zeros(1, 3))
    close(w, [[1.5, 2.0, 0.5]])
    assert not w.requires_grad
    # applied as a multiplier at ratio 1, A = 1: token-mean of -w
    logp = trainer.detach()
    loss, m = policy_loss(logp, logp, torch.ones(1), torch.ones(1, 3), rollout_logp=torch.zeros(1, 3))
    assert loss.item() == pytest.approx(-4.0 / 3.0, abs=1e-6)
    assert m["tis_weight_mean"] == pytest.approx(4.0 / 3.0, abs=1e-6)
    assert m["tis_clip_frac"] == pytest.approx(1.0 / 3.0, abs=1e-6)
    assert m["logprob_mismatch_max"] == pytest.approx(math.log(3.0), abs=1e-6)


def test_ratio_one_gives_minus_mean_advantage_and_zero_kl():
    torch.manual_seed(0)
    logp = torch.randn(3, 5).clamp(max=0)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.float)
    adv = torch.tensor([0.5, -1.0, 2.0])
    loss, m = policy_loss(logp.clone().requires_grad_(True), logp, adv, mask)
    token_mean_adv = (0.5 * 5 - 1.0 * 3 + 2.0 * 1) / 9
    assert loss.item() == pytest.approx(-token_mean_adv, abs=1e-6)
    loss, _ = policy_loss(logp, logp, adv, mask, agg="seq-mean-token-mean")
    assert loss.item() == pytest.approx(-adv.mean().item(), abs=1e-6)
    assert m["approx_kl"] == 0.0 and m["clip_frac"] == 0.0 and m["ratio_mean"] == 1.0
    for kind in ("k1", "k2", "k3"):
        assert kl_loss(logp, logp, mask, kind)[1]["kl"] == 0.0


def test_kl_estimators():
    logp = torch.tensor([math.log(0.5), math.log(0.25)])
    ref = torch.tensor([math.log(0.25), math.log(0.5)])
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([0.693147, -0.693147], abs=1e-6)
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx([0.240227, 0.240227], abs=1e-6)
    # k3 = exp(ref - logp) - (ref - logp) - 1: 0.5 + ln2 - 1, 2 - ln2 - 1
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx([0.193147, 0.306853], abs=1e-6)
    with pytest.raises(OrbitError, match="k4"):
        kl_estimate(logp, ref, "k4")


def test_aggregation_modes():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate(v, mask, "token-mean").item() == pytest.approx(2.5)
    assert aggregate(v, mask, "seq-mean-token-mean").item() == pytest.approx(3.0)
    assert aggregate(v, mask, "seq-mean-token-sum").item() == pytest.approx(5.0)
    assert aggregate(v, mask, "seq-mean-token-sum-norm").item() == pytest.approx(10 / 6)
    assert aggregate(v, mask, "seq-mean-token-sum-norm", norm_len=5).item() == pytest.approx(1.0)
    assert aggregate(v, mask, "token-mean", denom=8).item() == pytest.approx(1.25)
    assert aggregate(v, torch.zeros(2, 3), "token-mean").item() == 0.0
    with pytest.raises(OrbitError, match="token-sum-nrom"):
        aggregate(v, mask, "token-sum-nrom")


def test_value_loss_clipped():
    values = torch.tensor([[1.0, 2.0]], requires_grad=True)
    old, ret, mask = torch.tensor([[0.5, 2.0]]), torch.tensor([[2.0, 1.0]]), torch.ones(1, 2)
    # token 0: max((1-2)^2, (0.7-2)^2) = 1.69 -> .845; token 1: (2-1)^2 -> .5
    loss, m = value_loss(values, old, ret, mask, clip=0.2)
    assert loss.item() == pytest.approx((0.845 + 0.5) / 2, abs=1e-6)
    assert m["value_clip_frac"] == pytest.approx(0.5)
    loss, _ = value_loss(values, old, ret, mask, clip=None)
    assert loss.item() == pytest.approx(0.5, abs=1e-6)


def test_entropy_from_logits():
    logits = torch.log(torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.75, 0.25, 1e-30, 1e-30]]))
    assert entropy_from_logits(logits).tolist() == pytest.approx([math.log(4), 0.562335], abs=1e-5)


def test_actor_loss_combines_terms():
    logp = torch.full((1, 2), math.log(0.5))
    ref = torch.full((1, 2), math.log(0.25))
    loss, m = actor_loss(logp, logp, torch.ones(1), torch.ones(1, 2), ref_logp=ref, kl_coef=0.1,
                         entropy=torch.full((1, 2), 2.0), entropy_coef=0.01)
    assert loss.item() == pytest.approx(-1.0 + 0.1 * 0.193147 - 0.02, abs=1e-6)
    assert m["kl"] == pytest.approx(0.193147, abs=1e-6) and m["entropy"] == pytest.approx(2.0)


def test_kl_controllers():
    fixed = make_kl_controller("fixed")
    assert isinstance(fixed, FixedKLController) and fixed.update(5.0, 10) == 0.01
    ctl = AdaptiveKLController(0.01, target=0.1, horizon=100)  # 10 samples of 100
    # error 0.5 clipped to 0.2: x(1 + 0.2 * 10/100)
    assert ctl.update(0.15, 10) == pytest.approx(0.0102)
    # error -0.1: x(1 - 0.1 * 10/100)
    assert ctl.update(0.09, 10) == pytest.approx(0.0102 * 0.99)
    # a batch larger than the horizon moves it by one horizon's worth: never to 0 or below
    big = AdaptiveKLController(0.01, target=0.1, horizon=100)
    assert big.update(0.0, 10_000) == pytest.approx(0.008)
    with pytest.raises(OrbitError):
        make_kl_controller("pid")


def test_empty_mask_is_finite():
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, m = policy_loss(logp, torch.ones(2, 3), torch.ones(2), torch.zeros(2, 3),
                          rollout_logp=torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0.0 and m["ratio_max"] == 1.0 and m["clip_frac"] == 0.0
    assert all(math.isfinite(v) for v in m.values())
