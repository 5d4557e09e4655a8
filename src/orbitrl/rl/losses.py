"""Policy-gradient (with the entropy bonus), value and KL losses for the GRPO/PPO family.

Pure functions over tensors. B sequences, T completion positions; every [B, T] tensor is
aligned with `mask` (1 for tokens that count, 0 for padding). Losses return
`(loss, metrics)`: a scalar tensor carrying the gradient and a dict of Python floats.
"""

from __future__ import annotations

import torch
from torch import Tensor

from orbitrl.errors import OrbitError

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
MISMATCH_MODES = ("tis", "mis", "seq_tis", "off")
_MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: finite in fp32/bf16, far past any clip range


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of `x` over positions where `mask` is 1; 0 when the mask is empty. In fp32 (a
    bf16 sum of a long mask is not exact)."""
    x, mask = x.float(), mask.float()
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def aggregate(values: Tensor, mask: Tensor, mode: str = "token-mean",
              norm_len: int | None = None, denom: float | None = None) -> Tensor:
    """Reduce per-token losses to a scalar.

    Modes: "token-mean" weighs every valid token equally (DAPO); "seq-mean-token-mean"
    averages within each sequence first (original GRPO, so long answers' tokens weigh less);
    "seq-mean-token-sum" sums within a sequence; "seq-mean-token-sum-norm" divides each
    sequence's sum by the constant `norm_len` (Dr. GRPO: no length bias).

    Args:
        values: [B, T] per-token losses.
        mask: [B, T] 1 for tokens that count.
        mode: one of AGG_MODES.
        norm_len: the Dr. GRPO constant (default T, i.e. the generation cap when padded to it).
        denom: under gradient accumulation, the whole batch's count (valid tokens for
            "token-mean", sequences otherwise) so that micro-batch losses sum to the batch loss.

    Returns:
        Scalar tensor.
    """
    values, mask = values.float(), mask.float()
    total = values * mask
    if mode == "token-mean":
        return total.sum() / (denom if denom is not None else mask.sum().clamp(min=1.0))
    n_seq = denom if denom is not None else values.shape[0]
    if mode == "seq-mean-token-mean":
        per_seq = total.sum(-1) / mask.sum(-1).clamp(min=1.0)
    elif mode == "seq-mean-token-sum":
        per_seq = total.sum(-1)
    elif mode == "seq-mean-token-sum-norm":
        per_seq = total.sum(-1) / float(norm_len or values.shape[-1])
    else:
        raise OrbitError(f"unknown loss aggregation {mode!r}; expected one of {', '.join(AGG_MODES)}")
    return per_seq.sum() / max(n_seq, 1)


def sequence_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """GSPO's per-sequence log importance ratio: mean token log-ratio over valid tokens.

    exp() of it is the geometric mean of the token ratios. logp, old_logp, mask: [B, T].
    Returns [B].
    """
    mask = mask.to(logp.dtype)
    return ((logp - old_logp) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


def mismatch_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, mode: str = "tis",
                     cap: float = 2.0) -> Tensor:
    """Per-token weights [B, T] (detached, fp32) correcting for the gap between the policy
    that sampled (the rollout engine: its kernels, or an older version) and the one the
    trainer computes, from the ratio r = exp(old_logp - rollout_logp).

    Modes (``algo.mismatch``): "tis" min(r, cap) per token (truncated importance sampling);
    "mis" 1 where 1/cap <= r <= cap, else 0 (masked importance sampling: the token is dropped);
    "seq_tis" min(exp(mean over the sequence's valid tokens of log r), cap), the geometric
    mean of the sequence's ratios, on every token of the sequence; "off" 1.

    Args:
        old_logp: [B, T] the trainer's logprobs of the sampling policy; rollout_logp: [B, T]
            the engine's; mask: [B, T] (only "seq_tis" reads it).
    """
    log_w = old_logp.detach().float() - rollout_logp.detach().float()
    if mode == "tis":
        return log_w.clamp(max=_MAX_LOG_RATIO).exp().clamp(max=cap)
    if mode == "mis":
        r = log_w.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
        return ((r <= cap) & (r >= 1.0 / cap)).to(log_w.dtype)
    if mode == "seq_tis":
        seq = sequence_log_ratio(old_logp.detach().float(), rollout_logp.detach().float(), mask)
        w = seq.clamp(max=_MAX_LOG_RATIO).exp().clamp(max=cap)
        return w[:, None].expand_as(log_w)
    if mode == "off":
        return torch.ones_like(log_w)
    raise OrbitError(f"unknown mismatch correction {mode!r}; expected one of "
                     f"{', '.join(MISMATCH_MODES)}")


def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                clip_low: float = 0.1, clip_high: float = 0.1, dual_clip: float = 0.0,
                ratio_level: str = "token", agg: str = "token-mean",
                norm_len: int | None = None, denom: float | None = None,
                rollout_logp: Tensor | None = None, mismatch: str = "tis", tis_cap: float = 2.0,
                entropy: Tensor | None = None, entropy_coef: float = 0.0
                ) -> tuple[Tensor, dict[str, float]]:
    """The actor loss: PPO/GRPO clipped surrogate with clip-higher, dual-clip, GSPO, the
    rollout/trainer mismatch correction and an entropy bonus (``rl/update.py`` `actor_loss`
    calls it with the ``algo.*`` keys).

    Per token: max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)); with dual_clip = c > 1,
    tokens with A < 0 are further capped at -A c (Ye et al. 2020; verl's clip_ratio_c). With
    ratio_level="sequence" (GSPO) every token of sequence i uses the sequence ratio
    s_i = exp(sequence_log_ratio) for value and clipping, and the gradient of s_i (GSPO-token
    form: logp - sg(logp) + sg(log s_i)); pair it with agg="seq-mean-token-mean" and small clip
    ranges (GSPO uses 3e-4 / 4e-4). If `rollout_logp` is given, each token's loss is multiplied
    by mismatch_weights(old_logp, rollout_logp, mask, mismatch, tis_cap). The per-token losses
    are reduced by `aggregate`; with entropy_coef > 0 the loss then loses
    entropy_coef * aggregate(entropy) (the same reduction).

    Args:
        logp: [B, T] current policy logprobs of the sampled tokens (with grad).
        old_logp: [B, T] logprobs of the policy that sampled, as the trainer computes them.
        advantages: [B, T], or [B] broadcast over tokens.
        mask: [B, T].
        dual_clip: 0 = off, else > 1.
        rollout_logp: [B, T] logprobs recorded by the rollout engine, or None.
        mismatch: "tis", "mis", "seq_tis" or "off" (see `mismatch_weights`); tis_cap its cap.
        entropy: [B, T] per-token entropy of the current policy (with grad for the bonus),
            or None; entropy_coef: the bonus' weight (0 = metric only).
        Others: see `aggregate` for agg, norm_len, denom.

    Returns:
        (loss, metrics) with metrics pg_loss (the surrogate, before the entropy bonus),
        clip_frac, clip_frac_low, clip_frac_high, ratio_mean, ratio_max, ratio_min, approx_kl
        (k3 estimate of KL(old || current)); with rollout_logp tis_weight_mean, tis_clip_frac
        (tokens at the cap; under "mis" the masked ones), logprob_mismatch_max/mean; with dual
        clip dual_clip_frac; with entropy entropy (its mean over valid tokens).
    """
    if mismatch not in MISMATCH_MODES:
        raise OrbitError(f"unknown mismatch correction {mismatch!r}; expected one of "
                         f"{', '.join(MISMATCH_MODES)}")
    logp, old_logp = logp.float(), old_logp.detach().float()
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)
    advantages = advantages.detach().float()
    token_log_ratio = logp - old_logp
    ratio = _ratio(logp, old_logp, token_log_ratio, mask, ratio_level)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(loss1, loss2)
    m = mask.float()
    metrics: dict[str, Tensor] = {}  # turned into floats with one device sync at the end
    if dual_clip:
        if dual_clip <= 1.0:
            raise OrbitError(f"dual_clip must be 0 (off) or > 1, got {dual_clip}")
        loss3 = -advantages * dual_clip
        capped = (advantages < 0) & (per_token > loss3)
        per_token = torch.where(advantages < 0, torch.minimum(per_token, loss3), per_token)
        metrics["dual_clip_frac"] = masked_mean(capped.to(m.dtype), m)
    if rollout_logp is not None:
        per_token = _correct(per_token, old_logp, rollout_logp, mismatch, tis_cap, m, metrics)
    loss = pg_loss = aggregate(per_token, mask, agg, norm_len, denom)
    if entropy is not None and entropy_coef:
        loss = pg_loss - entropy_coef * aggregate(entropy, mask, agg, norm_len, denom)

    with torch.no_grad():
        metrics.update(_ratio_metrics(ratio.detach(), token_log_ratio.detach(), advantages, m,
                                      clip_low, clip_high, pg_loss.detach()))
        if entropy is not None:
            metrics["entropy"] = masked_mean(entropy.detach(), m)
        values = torch.stack([v.float() for v in metrics.values()]).tolist()
    return loss, dict(zip(metrics.keys(), values))


def _correct(per_token: Tensor, old_logp: Tensor, rollout_logp: Tensor, mode: str, cap: float,
             m: Tensor, metrics: dict) -> Tensor:
    """Per-token losses weighted by `mismatch_weights` (unchanged under "off"); the weights'
    and the logprob gap's statistics into metrics."""
    w = mismatch_weights(old_logp, rollout_logp, m, mode, cap)
    gap = (old_logp - rollout_logp.detach()).abs()
    metrics["tis_weight_mean"] = masked_mean(w, m)
    if mode == "mis":
        clipped = w == 0
    elif mode == "off":
        clipped = torch.zeros_like(w, dtype=torch.bool)
    else:
        clipped = w >= cap
    metrics["tis_clip_frac"] = masked_mean(clipped.to(m.dtype), m)
    metrics["logprob_mismatch_max"] = (gap * m).max() if m.numel() else gap.new_zeros(())
    metrics["logprob_mismatch_mean"] = masked_mean(gap, m)
    return per_token if mode == "off" else per_token * w


def _ratio(logp: Tensor, old_logp: Tensor, token_log_ratio: Tensor, mask: Tensor,
           ratio_level: str) -> Tensor:
    """The importance ratio [B, T] per token, or GSPO's per sequence (token-level gradient)."""
    if ratio_level == "token":
        log_ratio = token_log_ratio
    elif ratio_level == "sequence":
        seq = sequence_log_ratio(logp.detach(), old_logp, mask)
        log_ratio = logp - logp.detach() + seq[:, None]
    else:
        raise OrbitError(f"unknown ratio_level {ratio_level!r}; expected 'token' or 'sequence'")
    return log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()


def _ratio_metrics(r: Tensor, tlr: Tensor, advantages: Tensor, m: Tensor, clip_low: float,
                   clip_high: float, pg_loss: Tensor) -> dict[str, Tensor]:
    """Clip fractions, ratio statistics and the k3 KL(old || current), as device scalars
    (the caller syncs once for all of them)."""
    high = (advantages > 0) & (r > 1.0 + clip_high)
    low = (advantages < 0) & (r < 1.0 - clip_low)
    valid = m.bool()
    inf = torch.tensor(float("inf"), device=r.device)
    any_valid = valid.any()  # stays on device: no sync until the caller's
    return dict(
        pg_loss=pg_loss,
        clip_frac=masked_mean((high | low).to(m.dtype), m),
        clip_frac_high=masked_mean(high.to(m.dtype), m),
        clip_frac_low=masked_mean(low.to(m.dtype), m),
        ratio_mean=torch.where(any_valid, masked_mean(r, m), 1.0),
        ratio_max=torch.where(any_valid, torch.where(valid, r, -inf).max(), 1.0),
        ratio_min=torch.where(any_valid, torch.where(valid, r, inf).min(), 1.0),
        approx_kl=masked_mean(tlr.clamp(max=_MAX_LOG_RATIO).exp() - 1.0 - tlr, m),
    )


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimators of KL(pi || pi_ref) from samples of pi (Schulman, 2020).

    k1 = logp - ref (unbiased, high variance, can be negative); k2 = (logp - ref)^2 / 2
    (biased, low variance; as a loss its gradient is the on-policy reverse-KL gradient);
    k3 = exp(ref - logp) - (ref - logp) - 1 (unbiased, always >= 0; GRPO's choice).
    k1's gradient as a loss is zero in expectation: use it as a reward penalty instead.
    Shapes: [B, T] -> [B, T].
    """
    d = logp.float() - ref_logp.float()
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        neg = (-d).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return neg.exp() - neg - 1.0
    raise OrbitError(f"unknown KL estimator {kind!r}; expected one of {', '.join(KL_ESTIMATORS)}")


def kl_loss(logp: Tensor, ref_logp: Tensor, mask: Tensor, kind: str = "k3",
            agg: str = "token-mean", norm_len: int | None = None, denom: float | None = None
            ) -> tuple[Tensor, dict[str, float]]:
    """KL-to-reference loss term (multiply by the controller's coefficient).

    Args:
        logp: [B, T] with grad; ref_logp: [B, T] reference (anchor) logprobs; mask: [B, T].

    Returns:
        (loss, {"kl": mean estimate over valid tokens}).
    """
    per_token = kl_estimate(logp, ref_logp.detach(), kind)
    loss = aggregate(per_token, mask, agg, norm_len, denom)
    return loss, {"kl": masked_mean(per_token.detach(), mask).item()}


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *,
               clip: float | None = 0.2, agg: str = "token-mean",
               norm_len: int | None = None, denom: float | None = None
               ) -> tuple[Tensor, dict[str, float]]:
    """Clipped PPO critic loss: 0.5 max((V - R)^2, (V_old + clip(V - V_old, +-clip) - R)^2).

    Args:
        values: [B, T] critic predictions (with grad); old_values: [B, T] at rollout time;
        returns: [B, T] targets (e.g. from `gae`); mask: [B, T]; clip: None for unclipped.

    Returns:
        (loss, metrics) with value_loss, value_clip_frac, value_mean, explained_var.
    """
    values, returns = values.float(), returns.detach().float()
    err = (values - returns) ** 2
    m = mask.float()
    if clip is not None:
        old_values = old_values.detach().float()
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        err_clipped = (clipped - returns) ** 2
        per_token = 0.5 * torch.maximum(err, err_clipped)
        clip_frac = masked_mean((err_clipped > err).to(m.dtype), m).item()
    else:
        per_token, clip_frac = 0.5 * err, 0.0
    loss = aggregate(per_token, mask, agg, norm_len, denom)
    with torch.no_grad():
        resid = returns - values
        var_r = masked_mean((returns - masked_mean(returns, m)) ** 2, m)
        var_e = masked_mean((resid - masked_mean(resid, m)) ** 2, m)
        ev = (1.0 - var_e / var_r).item() if var_r > 0 else 0.0
    return loss, {"value_loss": loss.item(), "value_clip_frac": clip_frac,
                  "value_mean": masked_mean(values.detach(), m).item(), "explained_var": ev}


class FixedKLController:
    """Constant KL coefficient (MISSION default 0.01)."""

    def __init__(self, coef: float = 0.01):
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        """No-op; returns the coefficient."""
        return self.value

    def state_dict(self) -> dict:
        return {"kl_coef": self.value}

    def load_state_dict(self, sd: dict):
        self.value = sd["kl_coef"]


class AdaptiveKLController:
    """Ziegler et al. (2019): steer the KL toward `target` with a clipped proportional rule.

    coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * min(1, n_steps / horizon). `target` is in the
    units of the KL passed to `update` (per-token mean or per-sequence sum: be consistent).
    """

    def __init__(self, init_coef: float = 0.01, target: float = 0.1, horizon: int = 10000):
        if target <= 0 or horizon <= 0:
            raise OrbitError(f"adaptive KL needs target > 0 and horizon > 0, got {target}, {horizon}")
        self.value, self.target, self.horizon = float(init_coef), float(target), int(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Adjust after `n_steps` samples (or steps) at the observed KL; returns the new coef."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        # a batch larger than the horizon moves it by one horizon's worth at most, so the
        # factor stays in [0.8, 1.2] and the coefficient positive
        self.value *= 1.0 + error * min(1.0, n_steps / self.horizon)
        return self.value

    def state_dict(self) -> dict:
        return {"kl_coef": self.value}

    def load_state_dict(self, sd: dict):
        self.value = sd["kl_coef"]


def make_kl_controller(kind: str = "fixed", coef: float = 0.01, target: float = 0.1,
                       horizon: int = 10000) -> FixedKLController | AdaptiveKLController:
    """Build a KL controller from config values: kind is "fixed" or "adaptive"."""
    if kind == "fixed":
        return FixedKLController(coef)
    if kind == "adaptive":
        return AdaptiveKLController(coef, target, horizon)
    raise OrbitError(f"unknown KL controller {kind!r}; expected 'fixed' or 'adaptive'")
