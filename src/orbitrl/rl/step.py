"""The pieces of one RL step as functions: rollout, rewards -> advantages, the loss.

The loop in ``trainer.py`` calls these in order; each is testable on its own.
"""

from __future__ import annotations

import torch

from orbitrl.config import AlgoSection
from orbitrl.engine import Request, SamplingParams
from orbitrl.errors import OrbitError
from orbitrl.model.moe import replay_routing, router_losses
from orbitrl.rl import advantages as A
from orbitrl.rl.batch import PackedBatch, score
from orbitrl.rl.losses import kl_estimate, kl_loss, policy_loss, value_loss
from orbitrl.rl.types import Sample


def rollout(engine, prompts: list[list[int]], rows: list[dict], params: SamplingParams,
            version: int, seed: int, deadline_s: float | None = None,
            first: int = 0) -> list[Sample]:
    """n samples per prompt from the engine, groups adjacent, in prompt order. Past the
    watchdog deadline the engine drops unfinished samples; a group left with fewer than n
    samples is dropped whole (group statistics need all n). ``first``: the global index of
    ``prompts[0]`` in the step's batch (a rank's share starts there), so a prompt's sampling
    seed is the same whichever rank draws it."""
    reqs = [Request(prompt_ids=p, params=SamplingParams(**{**params.__dict__,
                                                            "seed": seed * 100003 + first + i}))
            for i, p in enumerate(prompts)]
    outs = engine.generate(reqs, deadline_s=deadline_s)
    samples = []
    for g, (out, p, row) in enumerate(zip(outs, prompts, rows)):
        if out.error is not None:
            raise OrbitError(f"rollout request {g}: {out.error}")
        if len(out.samples) < params.n:
            continue
        for c in out.samples:
            samples.append(Sample(first + g, p, c.token_ids, c.logprobs, c.finish_reason,
                                  c.text or "", row, version, routing=c.routing))
    return samples


def compute_advantages(algo: AlgoSection, rewards: torch.Tensor, group_size: int,
                       mask: torch.Tensor, kl: torch.Tensor | None, kl_coef: float
                       ) -> torch.Tensor:
    """Advantages [B, T] for the configured estimator (rewards [B], mask [B, T])."""
    if algo.name == "grpo":
        adv = A.grpo_advantages(rewards, group_size, normalize_std=algo.std_norm)
    elif algo.name == "rloo":
        adv = A.rloo_advantages(rewards, group_size)
    elif algo.name == "reinforce++":
        return A.reinforce_pp_advantages(rewards, mask, kl=kl if algo.kl_in_reward else None,
                                          kl_coef=kl_coef, gamma=algo.gamma)
    else:
        raise OrbitError(f"algo.name {algo.name!r}: advantages need the critic (ppo_advantages)")
    if algo.kl_in_reward and kl is not None:
        # KL as a per-sequence reward penalty, folded into the group-relative advantage
        pen = (kl * mask).sum(-1)
        adv = adv - kl_coef * (pen - pen.mean())
    return adv[:, None].expand_as(mask)


def actor_loss(model, mb: PackedBatch, old_logp, ref_logp, adv, algo: AlgoSection,
               kl_coef: float, temperature: float, denom: float, norm_len: int,
               critic=None, old_values=None, returns=None):
    """Policy loss (+ KL term, + the critic's value loss for PPO) of one micro-batch;
    returns (loss, metrics). ``old_logp`` None: the old policy is the one computing this
    forward (nothing changed the weights since the rollout was scored; see
    ``RLTrainer._old_from_update``), so its logprobs are this forward's, detached."""
    routing = replay_routing(model, mb.routing, aux=True)  # None for a dense model
    logp, ent, hidden = score(model, mb, temperature, with_entropy=True, return_hidden=True,
                              routing=routing)
    if old_logp is None:
        old_logp = logp.detach()
    loss, m = policy_loss(logp, old_logp, adv, mb.mask, clip_low=algo.clip_low,
                          clip_high=algo.clip_high,
                          ratio_level="sequence" if algo.seq_level_ratio else "token",
                          agg=algo.loss_agg, norm_len=norm_len, denom=denom,
                          rollout_logp=mb.rollout_logp, tis_cap=algo.tis_cap)
    if ref_logp is not None and kl_coef > 0 and not algo.kl_in_reward:
        kl_l, _ = kl_loss(logp, ref_logp, mb.mask, kind=algo.kl_estimator, agg=algo.loss_agg,
                          norm_len=norm_len, denom=denom)
        loss = loss + kl_coef * kl_l
    router_loss, router_m = router_losses(model, routing)  # mixtures: load balance, z-loss
    loss = loss + router_loss
    m.update(router_m)
    if critic is not None:
        values = mb.pad(critic(hidden.detach()))
        v_loss, vm = value_loss(values, old_values, returns, mb.mask, clip=algo.value_clip,
                                agg=algo.loss_agg, norm_len=norm_len, denom=denom)
        loss = loss + algo.vf_coef * v_loss
        m.update(vm)
    with torch.no_grad():
        msk = mb.mask
        m["entropy"] = float((ent * msk).sum() / msk.sum().clamp(min=1))
        if ref_logp is not None:
            m["kl"] = float((kl_estimate(logp, ref_logp, algo.kl_estimator) * msk).sum()
                            / msk.sum().clamp(min=1))
    return loss, m


def ppo_advantages(algo: AlgoSection, rewards: torch.Tensor, values: torch.Tensor,
                   mask: torch.Tensor, kl: torch.Tensor | None, kl_coef: float):
    """GAE over token rewards (the sequence reward on its last token, minus the KL penalty
    per token when ``kl_in_reward``); returns (whitened advantages [B, T], returns [B, T])."""
    tok = A.shape_token_rewards(rewards, mask, kl=kl if algo.kl_in_reward else None,
                                kl_coef=kl_coef)
    adv, ret = A.gae(tok, values, mask, gamma=algo.gamma, lam=algo.lam)
    return A.whiten(adv, mask), ret
