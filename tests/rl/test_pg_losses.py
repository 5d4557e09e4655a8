"""Policy (clip, dual-clip, mismatch correction, entropy bonus), value and KL losses
against hand-computed values, and the ``algo.*`` keys reaching them through the update.

Named test_pg_losses.py (not test_losses.py) so it cannot collide with tests/train's module
under pytest's default import mode.
"""

import math

import pytest
import torch

from orbitrl.config import AlgoSection, load_config
from orbitrl.errors import OrbitError
from orbitrl.rl.losses import (AdaptiveKLController, FixedKLController, aggregate, kl_estimate,
                               kl_loss, make_kl_controller, mismatch_weights, policy_loss,
                               sequence_log_ratio, value_loss)

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
    with pytest.raises(OrbitError):
        per_token_losses([1], [1], dual_clip=0.5)


def test_dual_clip_batch_loss_and_gradient():
    # ratios [4, 2, 4, .5], advantages [-1, -1, 1, -2], clip .2:
    #   PPO per token: max(4, 1.2) = 4; max(2, 1.2) = 2; max(-4, -1.2) = -1.2;
    #                  max(.5 * 2, .8 * 2) = 1.6            -> token-mean 6.4 / 4 = 1.6
    #   dual clip 3:   min(4, 3) = 3; 2; (A > 0) -1.2; min(1.6, 6) = 1.6 -> 5.4 / 4 = 1.35
    logp0 = torch.tensor([[math.log(4), LOG2, math.log(4), -LOG2]])
    adv = torch.tensor([[-1.0, -1.0, 1.0, -2.0]])
    mask = torch.ones(1, 4)
    off, m_off = policy_loss(logp0, torch.zeros(1, 4), adv, mask, clip_low=0.2, clip_high=0.2)
    assert off.item() == pytest.approx(1.6, abs=1e-6) and "dual_clip_frac" not in m_off
    logp = logp0.clone().requires_grad_(True)
    on, m = policy_loss(logp, torch.zeros(1, 4), adv, mask, clip_low=0.2, clip_high=0.2,
                        dual_clip=3.0)
    assert on.item() == pytest.approx(1.35, abs=1e-6)
    assert m["dual_clip_frac"] == pytest.approx(0.25) and m["pg_loss"] == pytest.approx(1.35)
    on.backward()
    # the capped token is a constant (no gradient); r=2, A=-1: d(-A r)/dlogp / 4 = 2 / 4;
    # the clipped ones (r=4 A=1 past 1.2, r=.5 A=-2 below .8) none
    close(logp.grad, [[0.0, 0.5, 0.0, 0.0]])


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
    w = mismatch_weights(trainer, torch.zeros(1, 3), torch.ones(1, 3))
    close(w, [[1.5, 2.0, 0.5]])
    assert not w.requires_grad
    # applied as a multiplier at ratio 1, A = 1: token-mean of -w
    logp = trainer.detach()
    loss, m = policy_loss(logp, logp, torch.ones(1), torch.ones(1, 3), rollout_logp=torch.zeros(1, 3))
    assert loss.item() == pytest.approx(-4.0 / 3.0, abs=1e-6)
    assert m["tis_weight_mean"] == pytest.approx(4.0 / 3.0, abs=1e-6)
    assert m["tis_clip_frac"] == pytest.approx(1.0 / 3.0, abs=1e-6)
    assert m["logprob_mismatch_max"] == pytest.approx(math.log(3.0), abs=1e-6)


# log(old / rollout) per token for three sequences; mask 0 on row 1's last token, whose
# huge ratio would move row 1's sequence weight if it counted
LOG_RATIO = torch.tensor([[math.log(3.0), math.log(1.5), math.log(1 / 4.5)],
                          [math.log(9.0), 0.0, 5.0],
                          [math.log(125.0), 0.0, 0.0]])
MISMATCH_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
CAP = 4.0
# by hand, cap 4:
#   tis      min(r, 4):               [3, 1.5, .2222], [4, 1, 4], [4, 1, 1]
#   mis      1 inside [1/4, 4]:       [1, 1, 0 (.2222 < .25)], [0 (9 > 4), 1, 0], [0, 1, 1]
#   seq_tis  geometric mean, capped:  row 0 (3 x 1.5 / 4.5)^(1/3) = 1; row 1 sqrt(9 x 1) = 3
#            (the masked token left out); row 2 125^(1/3) = 5 -> 4
#   off      1
MISMATCH_CASES = {
    "tis": ([[3.0, 1.5, 1 / 4.5], [4.0, 1.0, 4.0], [4.0, 1.0, 1.0]], 2 / 8),
    "mis": ([[1.0, 1.0, 0.0], [0.0, 1.0, 0.0], [0.0, 1.0, 1.0]], 3 / 8),
    "seq_tis": ([[1.0] * 3, [3.0] * 3, [4.0] * 3], 3 / 8),
    "off": ([[1.0] * 3] * 3, 0.0),
}


@pytest.mark.parametrize("mode", list(MISMATCH_CASES))
def test_mismatch_modes_hand_values(mode):
    want, clip_frac = MISMATCH_CASES[mode]
    old = torch.full((3, 3), -1.0)
    rollout = old - LOG_RATIO
    w = mismatch_weights(old, rollout, MISMATCH_MASK, mode, CAP)
    torch.testing.assert_close(w, torch.tensor(want), atol=1e-5, rtol=0)
    # in the loss at ratio 1 with A = 1: per token -w, token-mean over the 8 valid tokens
    loss, m = policy_loss(old.clone(), old, torch.ones(3), MISMATCH_MASK, rollout_logp=rollout,
                          mismatch=mode, tis_cap=CAP)
    valid_sum = (torch.tensor(want) * MISMATCH_MASK).sum().item()
    assert loss.item() == pytest.approx(-valid_sum / 8, abs=1e-5)
    assert m["tis_weight_mean"] == pytest.approx(valid_sum / 8, abs=1e-5)
    assert m["tis_clip_frac"] == pytest.approx(clip_frac, abs=1e-6)
    assert m["logprob_mismatch_max"] == pytest.approx(math.log(125.0), abs=1e-5)


def test_mismatch_sums_by_hand():
    # the sums behind the table above: tis 4.7222 + 5 + 6, mis 2 + 1 + 2, seq_tis 3 + 6 + 12
    old = torch.zeros(3, 3)
    for mode, total in (("tis", 3 + 1.5 + 1 / 4.5 + 5 + 6), ("mis", 5.0), ("seq_tis", 21.0),
                        ("off", 8.0)):
        loss, _ = policy_loss(old, old, torch.ones(3), MISMATCH_MASK, rollout_logp=-LOG_RATIO,
                              mismatch=mode, tis_cap=CAP)
        assert loss.item() == pytest.approx(-total / 8, abs=1e-5), mode
    with pytest.raises(OrbitError, match="'is'"):
        policy_loss(old, old, torch.ones(3), MISMATCH_MASK, rollout_logp=old, mismatch="is")


def test_default_tis_is_the_truncated_weight_bit_for_bit():
    """The default (mismatch tis, cap 2) is min(exp(old - rollout), 2) per token on the
    clipped surrogate, to the bit."""
    torch.manual_seed(0)
    logp = torch.randn(4, 6).clamp(max=0)
    old = (logp + 0.3 * torch.randn(4, 6)).clamp(max=0)
    rollout = (old + 0.5 * torch.randn(4, 6)).clamp(max=0)
    adv = torch.randn(4)
    mask = (torch.rand(4, 6) > 0.2).float()
    got, m = policy_loss(logp, old, adv, mask, rollout_logp=rollout)
    r = (logp - old).exp()
    a = adv[:, None].expand_as(logp)
    per_token = torch.maximum(-a * r, -a * r.clamp(0.9, 1.1))
    w = (old - rollout).clamp(max=20.0).exp().clamp(max=2.0)
    assert torch.equal(got, (per_token * w * mask).sum() / mask.sum())
    at_cap = float(((w >= 2.0).float() * mask).sum() / mask.sum())
    assert m["tis_clip_frac"] == pytest.approx(at_cap)


@pytest.mark.parametrize("agg,shift", [("token-mean", (1 + 2 + 3 + 4) / 4),
                                       ("seq-mean-token-mean", (6 / 3 + 4 / 1) / 2),
                                       ("seq-mean-token-sum", (6 + 4) / 2),
                                       ("seq-mean-token-sum-norm", (6 / 3 + 4 / 3) / 2)])
def test_entropy_bonus_shifts_the_loss_by_coef_times_entropy(agg, shift):
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -4.0, -4.0]])
    old = logp - 0.1
    adv = torch.tensor([1.0, -0.5])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    ent = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], requires_grad=True)
    base, m0 = policy_loss(logp, old, adv, mask, agg=agg)
    loss, m = policy_loss(logp, old, adv, mask, agg=agg, entropy=ent, entropy_coef=0.1)
    assert loss.item() - base.item() == pytest.approx(-0.1 * shift, abs=1e-6)
    assert m["pg_loss"] == m0["pg_loss"] and m["entropy"] == pytest.approx(2.5)
    loss.backward()  # the bonus carries the entropy's gradient, padding none
    assert ent.grad[1, 1:].abs().sum() == 0 and (ent.grad[0] < 0).all()
    # coefficient 0: the entropy is only a metric, the loss is the bit-identical surrogate
    zero, mz = policy_loss(logp, old, adv, mask, agg=agg, entropy=ent, entropy_coef=0.0)
    assert torch.equal(zero, base) and mz["entropy"] == pytest.approx(2.5)


def test_entropy_bonus_under_accumulation_denominator():
    # token-mean with the whole batch's 8 tokens as denominator: shift -0.1 * 10 / 8
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    ent = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    base, _ = policy_loss(logp, logp, torch.ones(2), mask, denom=8.0)
    loss, _ = policy_loss(logp, logp, torch.ones(2), mask, denom=8.0, entropy=ent,
                          entropy_coef=0.1)
    assert base.item() == pytest.approx(-4 / 8)
    assert loss.item() - base.item() == pytest.approx(-0.125)


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


# ---- the algo.* keys through the update the trainer runs (rl/update.py actor_loss) -------

@pytest.fixture(scope="module")
def tiny_batch():
    """The built-in model, a packed batch of two completions (4 and 3 tokens), and that
    batch's logprobs and entropy as the update's forward computes them."""
    import orbitrl
    from orbitrl.model.builtin import resolve_model_path
    from orbitrl.rl import update as U
    from orbitrl.rl.batch import pack
    from orbitrl.rl.types import Sample

    model = orbitrl.load_model(resolve_model_path("builtin:tiny-arith"))
    s = [Sample(0, [5, 6, 7], [20, 21, 22, 23], [-1.0] * 4, "stop", ""),
         Sample(0, [5, 6, 7], [24, 25, 26], [-1.0] * 3, "stop", "")]
    mb = pack(s, torch.device("cpu"))
    assert mb.mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    with torch.no_grad():
        logp, ent = U.score(model, mb, 1.0, with_entropy=True)
    return model, mb, logp, ent


def update_loss(tiny_batch, old, rollout, adv, *overrides):
    """The update's micro-batch loss under ``--set`` overrides (KL term off)."""
    import dataclasses

    from orbitrl.rl import update as U

    model, mb, _, _ = tiny_batch
    cfg = load_config(None, ["algo.loss_agg=token-mean", *overrides])
    mb = dataclasses.replace(mb, rollout_logp=rollout)
    loss, m = U.actor_loss(model, mb, old, None, adv, cfg.algo, kl_coef=0.0, temperature=1.0,
                           denom=float(mb.mask.sum()), norm_len=mb.mask.shape[1])
    return loss.item(), m


def test_entropy_coef_reaches_the_update_loss(tiny_batch):
    _, mb, logp, ent = tiny_batch
    adv = torch.ones(2, 4)
    # ratio 1, rollout = old (weights 1), A = 1: the surrogate is -1
    base, m0 = update_loss(tiny_batch, logp, logp, adv)
    assert base == pytest.approx(-1.0, abs=1e-6)
    got, m = update_loss(tiny_batch, logp, logp, adv, "algo.entropy_coef=0.1")
    mean_ent = float((ent * mb.mask).sum() / mb.mask.sum())
    assert mean_ent > 0.5 and m["entropy"] == pytest.approx(mean_ent, rel=1e-6)
    assert got - base == pytest.approx(-0.1 * mean_ent, abs=1e-5)
    assert m0["entropy"] == m["entropy"]  # logged with or without the bonus


def test_dual_clip_reaches_the_update_loss(tiny_batch):
    _, _, logp, _ = tiny_batch
    old = logp - math.log(4.0)  # ratio 4 on every token; A = -1
    adv = -torch.ones(2, 4)
    off, _ = update_loss(tiny_batch, old, old, adv)
    on, m = update_loss(tiny_batch, old, old, adv, "algo.dual_clip=3")
    assert off == pytest.approx(4.0, abs=1e-5)  # max(4, 1.1): the pessimistic term
    assert on == pytest.approx(3.0, abs=1e-6) and m["dual_clip_frac"] == 1.0


@pytest.mark.parametrize("mode,total", [("tis", 3 + 1.5 + 1 / 4.5 + 1 + 4 + 1 + 1),
                                        ("mis", 3.0 + 2.0), ("seq_tis", 4 * 1.0 + 3 * 2.0),
                                        ("off", 7.0)])
def test_mismatch_reaches_the_update_loss(tiny_batch, mode, total):
    # log(old / rollout): row 0 [3, 1.5, 1/4.5, 1] (geometric mean 1), row 1 [8, 1, 1]
    # (geometric mean 2) and a padding token the mask leaves out; cap 4:
    #   tis [3, 1.5, .2222, 1], [4, 1, 1]; mis [1, 1, 0, 1], [0, 1, 1]; seq_tis 1 x 4, 2 x 3
    _, _, logp, _ = tiny_batch
    lr = torch.tensor([[math.log(3.0), math.log(1.5), math.log(1 / 4.5), 0.0],
                       [math.log(8.0), 0.0, 0.0, 5.0]])
    got, m = update_loss(tiny_batch, logp, logp - lr, torch.ones(2, 4), "algo.tis_cap=4",
                         f"algo.mismatch={mode}")
    assert got == pytest.approx(-total / 7, abs=1e-5)
    assert m["tis_weight_mean"] == pytest.approx(total / 7, abs=1e-5)


def test_mismatch_off_survives_yaml(tmp_path):
    # YAML reads a bare `off` as false; the key keeps meaning "off"
    f = tmp_path / "c.yaml"
    f.write_text("algo:\n  mismatch: off\n")
    assert load_config(f).algo.mismatch == "off"
    assert load_config(None, ["algo.mismatch=off"]).algo.mismatch == "off"
    assert load_config(None, ["algo.mismatch=seq_tis"]).algo.mismatch == "seq_tis"


def test_mismatch_mis_needs_a_cap_of_at_least_1():
    with pytest.raises(OrbitError, match="'algo.tis_cap'"):
        load_config(None, ["algo.mismatch=mis", "algo.tis_cap=0.5"])
    assert AlgoSection(mismatch="mis", tis_cap=1.0).tis_cap == 1.0


def test_trainer_step_passes_the_keys_to_the_loss(monkeypatch):
    """A real step (RLTrainer -> Updater -> actor_loss) with the keys set: the loss gets
    them, and with every reward equal (advantages 0) and no KL term the step's loss is
    exactly the entropy bonus, -entropy_coef x the step's mean entropy."""
    from orbitrl.rewards import register
    from orbitrl.rl import update as U
    from trainer_helpers import make_trainer

    register("test_constant_reward", override=True)(lambda prompt, completion, **f: 1.0)
    seen = []
    real = U.policy_loss

    def spy(*a, **k):
        seen.append(k)
        return real(*a, **k)

    monkeypatch.setattr(U, "policy_loss", spy)
    tr = make_trainer("rollout.prompts_per_step=2", "rollout.n=4", "rollout.max_tokens=4",
                      "data.heldout_size=8", "model.base_dtype=int8",
                      "reward.name=test_constant_reward", "algo.kl_coef=0",
                      "algo.dual_clip=3", "algo.entropy_coef=0.05", "algo.mismatch=seq_tis",
                      "algo.tis_cap=3")
    row = tr.step()
    assert seen and all(k["dual_clip"] == 3.0 and k["entropy_coef"] == 0.05 and
                        k["mismatch"] == "seq_tis" and k["tis_cap"] == 3.0 and
                        k["entropy"] is not None for k in seen)
    assert row["entropy"] > 0
    assert row["loss"] == pytest.approx(-0.05 * row["entropy"], rel=1e-4)
