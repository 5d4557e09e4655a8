"""Score: from a ``Rollout`` to a ``Scored`` batch (the second arrow of the step).

Everything that turns samples into training signal lives here: the verifiers' rewards
(``judge``), every kind of reward shaping (the overlong penalty on the reward, the overlong
filter on the loss mask, the KL penalty in the reward), dynamic sampling, the packed
micro-batches, the no-grad scoring passes (the old policy's logprobs, the anchored
reference's, PPO's values) and the advantages. The anchors and the KL controller move after
each update (``after_update``).

Batch-wide statistics (PPO's and REINFORCE++'s whitening, the KL penalty's batch mean) run
over every rank's rows (``Collective.on_global_batch``); GRPO / RLOO groups stay whole on
one rank.
"""

from __future__ import annotations

import torch

from orbitrl.config import AlgoSection
from orbitrl.errors import OrbitError
from orbitrl.model.decoder import inference_safe
from orbitrl.model.hf_fallback import HFDecoder
from orbitrl.rewards import RewardSource, get_reward
from orbitrl.rl import advantages as A
from orbitrl.rl.batch import micro_batches, pack, score
from orbitrl.rl.evaluate import reward_fields
from orbitrl.rl.losses import kl_estimate
from orbitrl.rl.parallel import Workers, split_parts
from orbitrl.rl.reward_model import RewardModel
from orbitrl.rl.routing import attach_routing, replay_check
from orbitrl.rl.types import Rollout, Scored, StepAbandoned, StepScore
from orbitrl.train.optim import is_fused


def reward_sources(rc, device=None, dtype: str = "fp32") -> list:
    """``reward.name`` plus ``reward.extra`` (weights in ``reward.weights``); a name
    ``rm:PATH`` is a reward model (a directory, a Hub id or builtin:NAME; see
    rl/reward_model.py), scored ``reward.rm_batch_size`` sequences per forward on
    ``device`` (None: a GPU when there is one, as ``model.device: auto``) in ``dtype``
    (``model.dtype``); its metrics are ``reward_rm_*`` (``rm2``, ... for more than one)."""
    names = [rc.name] + list(rc.extra)
    weights = list(rc.weights) or [1.0] * len(names)
    if len(weights) != len(names):
        raise OrbitError(f"config key 'reward.weights': {len(weights)} weights for "
                         f"{len(names)} reward sources")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out, models = [], 0
    for n, w in zip(names, weights):
        if str(n).startswith("rm:"):
            models += 1
            rm = RewardModel(n[3:], device, dtype, rc.rm_batch_size)
            out.append(RewardSource(rm, weight=w, name="rm" if models == 1 else f"rm{models}"))
        else:
            out.append(RewardSource(get_reward(n, rc), weight=w, name=n))
    return out


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


def ppo_advantages(algo: AlgoSection, rewards: torch.Tensor, values: torch.Tensor,
                   mask: torch.Tensor, kl: torch.Tensor | None, kl_coef: float,
                   turn: torch.Tensor | None = None):
    """GAE over token rewards (the sequence reward on its last token, a trajectory's
    per-turn rewards ``turn`` [B, T] at the end of their turns, minus the KL penalty per
    token when ``kl_in_reward``); returns (whitened advantages [B, T], returns [B, T])."""
    tok = A.shape_token_rewards(rewards, mask, kl=kl if algo.kl_in_reward else None,
                                kl_coef=kl_coef, extra=turn)
    adv, ret = A.gae(tok, values, mask, gamma=algo.gamma, lam=algo.lam)
    return A.whiten(adv, mask), ret


def shaped_rewards(raw: list[float], samples, algo: AlgoSection, max_tokens: int
                   ) -> torch.Tensor:
    """The rewards [B] training sees: the verifiers' plus a trajectory's environment
    rewards (summed over its turns) plus the overlong penalty (DAPO's soft length penalty,
    ``algo.overlong: shape``)."""
    rewards = torch.tensor(raw, dtype=torch.float32).reshape(-1)
    if any(s.env_reward for s in samples):  # trajectories: the environment's turn rewards
        rewards = rewards + torch.tensor([s.env_reward for s in samples])
    if algo.overlong == "shape":
        lens = torch.tensor([len(s.completion_ids) for s in samples])
        rewards = rewards + A.overlong_penalty(lens, max_tokens, algo.overlong_buffer)
    return rewards


def loss_mask(mask: torch.Tensor, kept, algo: AlgoSection) -> torch.Tensor:
    """The completion mask [B, T] with truncated samples zeroed under ``algo.overlong:
    filter`` (a copy: the packed batches keep their own masks)."""
    mask = mask.clone()
    if algo.overlong == "filter":
        trunc = torch.tensor([s.truncated for s in kept], device=mask.device)
        mask = mask * (~trunc)[:, None].float()
    return mask


def mismatch(old: list, parts: list) -> dict:
    """The engine's logprobs against the trainer's recomputation, every sampled token."""
    mm = torch.cat([(o - p.rollout_logp).abs()[p.mask.bool()] for o, p in zip(old, parts)])
    return {"logprob_mismatch_max": float(mm.max()), "logprob_mismatch_mean": float(mm.mean())}


def cat_padded(tensors: list[torch.Tensor], shape) -> torch.Tensor:
    """Micro-batches' [B_k, T_k] stacked into one zero-padded [B, T]."""
    out = tensors[0].new_zeros(shape)
    r = 0
    for t in tensors:
        out[r:r + t.shape[0], :t.shape[1]] = t
        r += t.shape[0]
    return out


def step_metrics(res, samples, version: int) -> dict:
    """The reward and staleness columns of the step's row (raw rewards, before shaping)."""
    row = {"reward_mean": float(torch.tensor(res.rewards).mean())}
    row.update({k: v for k, v in res.metrics.items() if k != "reward_mean"})
    stale = [version - s.policy_version for s in samples] or [0]
    row["staleness_mean"] = sum(stale) / len(stale)
    row["staleness_max"] = max(stale)
    return row


class Scorer:
    """Rewards, reference, values and advantages for the run's steps.

    Args:
        algo, rollout, data: the run's ``algo``, ``rollout`` and ``data`` sections.
        mb_tokens: tokens per micro-batch (``ledger.runtime.micro_batch_tokens``: the key,
            or the ledger's auto choice the memory prediction prices).
        frozen_base: adapter mode (the step-0 KL check's tolerance).
        replay_check_every: ``moe.replay_check_every``.
        model: the policy; ``device`` where its batches go.
        runner: the RewardRunner of the run's reward sources.
        anchors, kl_ctl: the reference anchors and the KL controller.
        critic: PPO's ``rl.critic.Critic`` (None otherwise).
        opt: the policy's optimizer (whether the update's own forward can give the old
            logprobs depends on it).
        coll: the Collective.
        workers: ``rl/parallel.py`` Workers: the micro-batches' scoring passes side by
            side (the batch is cut into at least that many micro-batches).
    """

    def __init__(self, algo, rollout, data, model, device, runner, anchors, kl_ctl, critic,
                 opt, coll, workers=None, *, mb_tokens: int, frozen_base: bool = True,
                 replay_check_every: int = 0):
        self.algo, self.rollout_cfg, self.data = algo, rollout, data
        self.model, self.device = model, device
        self.runner, self.anchors, self.kl_ctl = runner, anchors, kl_ctl
        self.critic, self.opt, self.coll = critic, opt, coll
        self.workers = workers or Workers(1)
        self.mb_tokens, self.frozen_base = mb_tokens, frozen_base
        self.replay_check_every = replay_check_every
        t = rollout.temperature
        self.T = t if t > 0 else 1.0

    def judge(self, rollout: Rollout, timer) -> Rollout:
        """The verifiers' rewards for the rollout's samples (an empty rank's too: it joins
        the others' collectives after)."""
        d = self.data
        samples = rollout.samples
        if samples or self.coll.enabled:
            with timer.phase("reward"):
                rollout.rewards = self.runner(
                    [s.fields[d.prompt_field] for s in samples], [s.text for s in samples],
                    [reward_fields(s.fields, d.prompt_field, d.answer_field) for s in samples])
        rollout.seconds = dict(timer.seconds)
        return rollout

    def informative(self, rollout: Rollout) -> int:
        """This rank's groups of a judged rollout that dynamic sampling keeps (their
        rewards, as training shapes them, are not all equal): refill.py's count."""
        r, samples = self.rollout_cfg, rollout.samples
        if not samples:
            return 0
        rewards = shaped_rewards(rollout.rewards.rewards, samples, self.algo, r.max_tokens)
        return int(A.dynamic_sampling_mask(rewards, r.n).sum()) // r.n

    def __call__(self, rollout: Rollout, version: int, timer, stop) -> StepScore:
        """Shape, select and score a judged rollout; ``version`` is the policy version the
        update will train (the staleness reference, step 0's checks)."""
        r, samples = self.rollout_cfg, rollout.samples
        if not self.coll.any(bool(samples)):  # the watchdog dropped every group
            return StepScore({"reward_mean": 0.0, "step_skipped": 1, "groups_kept": 0,
                              **rollout.refill}, None, anything=False)
        res = rollout.rewards
        rewards = shaped_rewards(res.rewards, samples, self.algo, r.max_tokens)
        metrics = {"reward_mean": 0.0, "groups_kept": len(samples) // r.n}
        metrics.update(step_metrics(res, samples, version))
        keep = torch.ones(len(samples), dtype=torch.bool)
        if self.algo.dynamic_sampling:  # (every refill round's groups: refill.py)
            keep = A.dynamic_sampling_mask(rewards, r.n)
            metrics["dropped_groups"] = int((~keep).sum()) // r.n
            metrics.update(rollout.refill)
        if stop():
            raise StepAbandoned()
        with timer.phase("score"):
            batch = self.batch(samples, rewards, keep, version)
        if self.coll.any(batch is not None) and batch is None:  # others train: join them
            batch = self.empty()
        return StepScore(metrics, batch)

    # ---- the batch -------------------------------------------------------------------------
    def batch(self, samples, rewards: torch.Tensor, keep: torch.Tensor, version: int
              ) -> Scored | None:
        """Old (trainer) and anchored reference logprobs, once per step; advantages."""
        idx = [i for i in range(len(samples)) if keep[i]]
        if not idx:  # nothing kept here: join the others' collectives
            self.coll.join_scoring(self.model, self._global_tensors(), self.device)
            return None
        kept = [samples[i] for i in idx]
        mbs = split_parts(micro_batches(kept, self.mb_tokens), kept,
                          self.workers.n)
        # packed once per micro-batch; the whole batch's [B, T] layout is its own pack only
        # when there are several (with one, it is that micro-batch's)
        parts = [pack([kept[j] for j in g], self.device) for g in mbs]
        attach_routing(self.model, parts, [[kept[j] for j in g] for g in mbs])  # mixtures
        full = parts[0] if len(parts) == 1 else pack(kept, self.device)
        kl_coef = self.kl_ctl.value
        need_ref = kl_coef > 0 or self.algo.kl_in_reward
        reuse = self.old_from_update(version, len(parts))
        old, old_v, ref = self._passes(parts, need_ref, reuse)
        # (when reused, the update's policy loss reports the mismatch from its old logprobs)
        metrics = {} if reuse else mismatch(old, parts)
        # the most positions live at once (the workers take the micro-batches n at a time, in
        # order): the ledger's shape for this step (observe/memory.py, at the step's shape)
        sizes, n = [p.input_ids.numel() for p in parts], self.workers.n
        metrics["mem_train_positions"] = max(sum(sizes[i:i + n]) for i in range(0, len(sizes), n))
        # mixtures: the gap routing replay removes, measured without it every N steps
        metrics.update(replay_check(self.model, parts, self.T, version,
                                    self.replay_check_every))
        # per-token KL to the reference with the configured estimator (the reward penalty,
        # kl_in_reward, uses it as is; the step-0 check reads it; neither reuses old logprobs)
        kl = cat_padded([kl_estimate(o, rf, self.algo.kl_estimator) for o, rf in zip(old, ref)],
                        full.mask.shape) if need_ref and not reuse else None
        if self.algo.check and version == 0 and need_ref:
            k0 = float((kl.abs() * full.mask).max())
            tol = 1e-5 if self.frozen_base else 5e-2
            assert k0 <= tol, f"check: KL to the reference at step 0 is {k0:.3g} > {tol}"
        values = None if old_v is None else cat_padded(old_v, full.mask.shape)
        adv, returns = self._advantages(rewards[idx].to(self.device), full.mask, values, kl,
                                        kl_coef, kept)
        tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in kept)
        return Scored(parts, [len(g) for g in mbs], old, ref, adv,
                      loss_mask(full.mask, kept, self.algo), kl_coef, self.T, values, returns,
                      metrics, tokens)

    def _passes(self, parts, need_ref: bool, reuse: bool):
        """The no-grad forwards: old logprobs (and PPO's values), the reference's."""
        old_v = None
        with torch.no_grad(), self.coll.lockstep(self.model):  # ranks' forwards in step
            if self.critic is not None:
                scored = [score(self.model, p, self.T, return_hidden=True) for p in parts]
                old = [o for o, _ in scored]
                old_v = [p.pad(self.critic(p, h)) for p, (_, h) in zip(parts, scored)]
            elif reuse:  # the update's own forward gives them (actor_loss)
                old = [None] * len(parts)
            else:
                old = self.workers.map(lambda p: self._logprobs(self.model, p), parts)
            ref = [None] * len(parts)
            if need_ref:  # (the anchor is set up once, here, for every worker's pass)
                with self.anchors.anchored() as ref_model:
                    ref = self.workers.map(lambda p: self._logprobs(ref_model, p), parts)
        return old, old_v, ref

    def _logprobs(self, model, part):
        """One no-grad scoring pass, under inference mode where the model allows it
        (``decoder.inference_safe``; the result copied out of it for the loss)."""
        # (a transformers module: dense, no layer hooks, as inference_safe asks)
        if not isinstance(model, HFDecoder) and not inference_safe(model):
            return score(model, part, self.T)
        with torch.inference_mode():
            out = score(model, part, self.T)
        return out.clone()

    def _advantages(self, rewards, mask, values, kl, kl_coef, kept):
        """(advantages [B, T], PPO's returns [B, T] or None). PPO takes a trajectory's
        per-turn environment rewards at the end of each turn (token-level rewards for GAE)
        instead of in the sequence reward; the other estimators see their sum."""
        algo, n = self.algo, self.rollout_cfg.n
        if self.critic is not None:
            env = torch.tensor([s.env_reward for s in kept], device=rewards.device)
            turn = A.turn_reward_tensor([s.turn_rewards for s in kept], mask.shape,
                                        mask.device)
            return self.coll.on_global_batch(lambda r_, v_, m_, k_, t_: ppo_advantages(
                algo, r_, v_, m_, k_, kl_coef, t_), rewards - env, values, mask, kl, turn)
        if self._global_tensors():
            return self.coll.on_global_batch(lambda r_, m_, k_: compute_advantages(
                algo, r_, n, m_, k_, kl_coef), rewards, mask, kl), None
        return compute_advantages(algo, rewards, n, mask, kl, kl_coef), None

    def _global_tensors(self) -> int | None:
        """How many tensors the batch-wide advantages gather (None: they are per group)."""
        if self.critic is not None:
            return 5
        return 3 if self.algo.name == "reinforce++" or self.algo.kl_in_reward else None

    def empty(self) -> Scored:
        """The batch of a rank left with no kept samples while others have some."""
        z = torch.zeros(0, 1, device=self.device)
        return Scored([], [], [], [None], z, z, self.kl_ctl.value, 1.0, z, z)

    def old_from_update(self, version: int, parts: int = 1) -> bool:
        """Whether the old-policy logprobs can come from the update's own forward instead of
        a scoring pass: the weights stay as they are from scoring until every micro-batch
        has run its forward (one epoch; an optimizer that steps after the last micro-batch,
        or the fused one that updates during each backward when the step is one micro-batch
        on one process: its forward runs before any update), and nothing before the update
        needs them (PPO's values, the KL penalty in the reward, the step-0 check). The
        forward with gradients computes the same logprobs as one without (same kernels,
        same weights: bit for bit on CPU), so the ratio is 1 on the first epoch either way;
        one forward of the batch is saved (SmolLM2's full mode: 4.1 s of a 23.6 s step)."""
        algo = self.algo
        one_update = not is_fused(self.opt) or (parts == 1 and not self.coll.enabled)
        return (algo.epochs == 1 and self.critic is None and not algo.kl_in_reward
                and one_update and not (algo.check and version == 0))

    def after_update(self, version: int, kl: float) -> dict:
        """Move the anchor (on schedule or drift) and the KL coefficient after an update."""
        out = {}
        reason = self.anchors.maybe_refresh(version, kl)
        if reason:
            out["anchor_refresh"] = reason
        out["anchor_refreshes"] = len(self.anchors.events)
        # the controller's horizon counts samples (Ziegler et al.): one step moves the
        # coefficient by at most 0.2 x (the step's global batch / horizon)
        r = self.rollout_cfg
        self.kl_ctl.update(kl, r.prompts_per_step * r.n)
        out["kl_coef"] = self.kl_ctl.value
        return out
