"""Advantage estimators and reward shaping for GRPO, Dr. GRPO, RLOO, REINFORCE++ and PPO.

Pure functions over tensors. Group estimators take per-sample rewards [B] laid out as
contiguous groups: B = num_prompts * group_size, the samples of one prompt adjacent (the
order rollout produces). Token-level functions take [B, T] tensors aligned with `mask`
(1 for completion tokens that count, right padding 0).
"""

from __future__ import annotations

import torch
from torch import Tensor

from orbitrl.errors import OrbitError


def _groups(rewards: Tensor, group_size: int) -> Tensor:
    if group_size < 1 or rewards.dim() != 1 or rewards.numel() % group_size:
        raise OrbitError(
            f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    return rewards.float().view(-1, group_size)


def grpo_advantages(rewards: Tensor, group_size: int, normalize_std: bool = True,
                    eps: float = 1e-6) -> Tensor:
    """GRPO: reward minus its group mean, divided by the group std (unbiased) when asked.

    normalize_std=False is Dr. GRPO: the std division up-weights groups that are nearly all
    right or all wrong, a difficulty bias. A group of identical rewards gets 0 everywhere; a
    group of one sample too (no baseline to compare with).

    Args:
        rewards: [B] scalar reward per sample, B = num_groups * group_size.
        group_size: samples per prompt.

    Returns:
        [B] advantages (broadcast over tokens by the loss).
    """
    g = _groups(rewards, group_size)
    centred = g - g.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        centred = centred / (g.std(dim=1, keepdim=True) + eps)
    return centred.view(-1)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO: each reward minus the mean of the *other* samples of its group (unbiased baseline).

    Args:
        rewards: [B], B = num_groups * group_size, group_size >= 2.

    Returns:
        [B] advantages, equal to group_size / (group_size - 1) * (r - group mean).
    """
    if group_size < 2:
        raise OrbitError(f"RLOO needs at least 2 samples per prompt, got rollout.n={group_size}")
    g = _groups(rewards, group_size)
    others = (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
    return (g - others).view(-1)


def shape_token_rewards(rewards: Tensor, mask: Tensor, kl: Tensor | None = None,
                        kl_coef: float = 0.0, extra: Tensor | None = None) -> Tensor:
    """Token-level rewards: the sample's reward on its last valid token, minus kl_coef * kl
    on every valid token (KL as a reward penalty, as in PPO-RLHF and REINFORCE++).

    Args:
        rewards: [B] outcome reward per sample.
        mask: [B, T] completion mask (right padded).
        kl: [B, T] per-token KL estimate (see losses.kl_estimate; k1 is the usual choice here).
        extra: [B, T] rewards already placed on tokens (a trajectory's per-turn rewards at
            the end of each turn, ``turn_reward_tensor``), added where the mask is 1.

    Returns:
        [B, T] token rewards, 0 on padding.
    """
    m = mask.float()
    out = torch.zeros_like(m)
    lengths = m.sum(-1).long()
    has = lengths > 0
    # last valid index = position of the last 1 (robust to masks with holes)
    pos = torch.arange(m.shape[-1], device=m.device).expand_as(m)
    last = torch.where(m.bool(), pos, torch.full_like(pos, -1)).max(-1).values
    rows = torch.nonzero(has).squeeze(-1)
    out[rows, last[rows]] = rewards.float()[rows]
    if kl is not None and kl_coef:
        out = out - kl_coef * kl.detach().float() * m
    if extra is not None:
        out = out + extra.float() * m
    return out


def turn_reward_tensor(turn_rewards: list, shape, device=None) -> Tensor:
    """[B, T] token rewards from each sample's ``(completion index, reward)`` pairs (the
    environment's reward of a turn at that turn's last model token); 0 elsewhere."""
    out = torch.zeros(shape, device=device)
    for b, pairs in enumerate(turn_rewards):
        for j, r in pairs or ():
            out[b, j] += r
    return out


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Reward-to-go G_t = sum_{s >= t} gamma^(s - t) r_s over valid tokens. [B, T] -> [B, T]."""
    m = mask.float()
    out = torch.zeros_like(m)
    running = torch.zeros(m.shape[0], device=m.device)
    for t in reversed(range(m.shape[-1])):
        running = token_rewards[:, t].float() * m[:, t] + gamma * running * m[:, t] \
            + running * (1 - m[:, t])
        out[:, t] = running * m[:, t]
    return out


def whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise x over the valid entries of the whole batch (unbiased variance).

    Args:
        x, mask: [B, T].
        shift_mean: False keeps the mean (scale only), as some PPO setups do for advantages.

    Returns:
        [B, T], 0 on padding.
    """
    m = mask.float()
    n = m.sum()
    if n < 2:
        return torch.zeros_like(x, dtype=torch.float32)
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / (n - 1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * m


def reinforce_pp_advantages(rewards: Tensor, mask: Tensor, kl: Tensor | None = None,
                            kl_coef: float = 0.0, gamma: float = 1.0,
                            group_size: int | None = None) -> Tensor:
    """REINFORCE++: KL-penalised token rewards, reward-to-go, then whitening over all valid
    tokens of the batch (a global baseline instead of a per-prompt one).

    With group_size, the group mean reward is subtracted first ("REINFORCE++-baseline").

    Args:
        rewards: [B] outcome rewards.
        mask: [B, T] completion mask.
        kl: [B, T] per-token KL to the reference, or None; kl_coef its penalty weight.
        gamma: discount (1.0 for LLM outcome rewards).

    Returns:
        [B, T] advantages, 0 on padding.
    """
    r = rewards.float()
    if group_size is not None:
        g = _groups(r, group_size)
        r = (g - g.mean(dim=1, keepdim=True)).view(-1)
    token_rewards = shape_token_rewards(r, mask, kl, kl_coef)
    return whiten(discounted_returns(token_rewards, mask, gamma), mask)


def gae(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over masked token sequences.

    delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}, where t+1 is the
    next *valid* token and V after the last valid token is 0 (the episode ends). Padding
    values are ignored, whatever they hold.

    Args:
        token_rewards: [B, T] (e.g. from `shape_token_rewards`); values: [B, T] critic
            values at rollout time; mask: [B, T].

    Returns:
        (advantages [B, T], returns [B, T] = advantages + values), 0 on padding; whiten the
        advantages with `whiten` if wanted, never the returns.
    """
    m = mask.float()
    r, v = token_rewards.float().detach(), values.float().detach()
    B, T = m.shape
    adv = torch.zeros_like(m)
    next_value = torch.zeros(B, device=m.device)
    last_gae = torch.zeros(B, device=m.device)
    for t in reversed(range(T)):
        mt = m[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        cur = delta + gamma * lam * last_gae
        last_gae = mt * cur + (1 - mt) * last_gae
        next_value = mt * v[:, t] + (1 - mt) * next_value
        adv[:, t] = cur * mt
    return adv, (adv + v) * m


def dynamic_sampling_mask(rewards: Tensor, group_size: int, atol: float = 1e-6) -> Tensor:
    """DAPO dynamic sampling: keep groups whose rewards are not all equal.

    A group where every sample scores the same has zero advantage under GRPO/RLOO and only
    dilutes the batch. Count kept groups with `keep.view(-1, group_size)[:, 0].sum()`.

    Args:
        rewards: [B], B = num_groups * group_size.

    Returns:
        [B] bool, True for samples of informative groups.
    """
    g = _groups(rewards, group_size)
    informative = (g.max(dim=1).values - g.min(dim=1).values) > atol
    return informative.repeat_interleave(group_size)


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment, added to the rewards.

    0 up to max_len - buffer tokens, then falling linearly to -factor at max_len, and -factor
    beyond (a truncated sample has length max_len).

    Args:
        lengths: [B] completion lengths in tokens.
        max_len: the generation cap; buffer: the soft zone before it (0 < buffer <= max_len).

    Returns:
        [B] penalties <= 0.
    """
    if not 0 < buffer <= max_len:
        raise OrbitError(f"overlong buffer must be in (0, max_len={max_len}], got {buffer}")
    over = (lengths.float() - (max_len - buffer)).clamp(min=0.0)
    return -factor * (over / buffer).clamp(max=1.0)

