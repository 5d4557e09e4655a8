"""The RL loop: rollout -> rewards -> advantages -> score -> train, one step at a time.

``RLTrainer.step()`` is the whole step on one screen; the pieces are functions in
``step.py``, ``batch.py``, ``anchors.py`` and ``guards.py``.
"""

from __future__ import annotations

import math
import random
import time

import torch

from orbitrl.config import Config
from orbitrl.dist.batch import on_global_batch
from orbitrl.dist.env import Dist
from orbitrl.dist.fsdp import idle_backward, lockstep, rollout_weights, sum_grads
from orbitrl.engine import Engine, SamplingParams
from orbitrl.engine.governor import KVGovernor, available_memory, hand_back
from orbitrl.errors import OrbitError
from orbitrl.model.tokenizer import encode_prompt
from orbitrl.observe.memory import MemoryProbe, run_prediction
from orbitrl.observe.metrics import device_peak_bytes
from orbitrl.rewards import RewardRunner, RewardSource, get_reward
from orbitrl.rl.anchors import Anchors
from orbitrl.rl.batch import micro_batches, pack, score
from orbitrl.rl.evaluate import reward_fields
from orbitrl.rl.guards import GradNormGuard, Snapshot, layer_grad_norms
from orbitrl.rl.losses import kl_estimate, make_kl_controller
from orbitrl.rl.policy import build_policy, pick_device
from orbitrl.train.optim import is_fused
from orbitrl.rl.step import actor_loss, compute_advantages, ppo_advantages, rollout


def reward_sources(rc) -> list:
    """``reward.name`` plus ``reward.extra`` (weights in ``reward.weights``); a name
    ``rm:DIR`` is a reward model directory (see rl/reward_model.py)."""
    names = [rc.name] + list(rc.extra)
    weights = list(rc.weights) or [1.0] * len(names)
    if len(weights) != len(names):
        raise OrbitError(f"config key 'reward.weights': {len(weights)} weights for "
                         f"{len(names)} reward sources")
    out = []
    for n, w in zip(names, weights):
        if str(n).startswith("rm:"):
            from orbitrl.rl.reward_model import RewardModel

            out.append(RewardSource(RewardModel(n[3:]), weight=w, name="rm"))
        else:
            out.append(RewardSource(get_reward(n, rc), weight=w, name=n))
    return out


def seed_everything(seed: int, deterministic: bool = False):
    random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


class StepAbandoned(Exception):
    """A stop request (``RLTrainer.should_stop``, SIGTERM) ended the step in flight before
    anything was applied; the trainer is as it was before the step."""


class RLTrainer:
    """Holds the run's state (policy, engine, optimizer, anchors, guards, data position)."""

    def __init__(self, cfg: Config, train_rows: list[dict], heldout_rows: list[dict],
                 dist: Dist | None = None):
        self.cfg = cfg
        self.dist = dist or Dist()  # one process unless torchrun started several
        seed_everything(cfg.train.seed, cfg.train.deterministic)
        self.device = pick_device(cfg.model.device)
        self.mem = MemoryProbe(self.device)  # baseline: before the model is loaded
        if cfg.rollout.overlap and cfg.train.mode != "adapter":
            raise OrbitError("config key 'rollout.overlap': the overlapped mode needs "
                             "train.mode adapter (full mode would hold a second copy of the "
                             "weights for the rollout thread)")
        if cfg.rollout.overlap and self.dist.enabled:
            raise OrbitError("config key 'rollout.overlap': not supported under torchrun "
                             "(sharded forwards run in lockstep across ranks; a rollout "
                             "thread beside training would interleave their collectives)")
        if cfg.train.tiers and self.dist.enabled:
            raise OrbitError("config key 'train.tiers': one process only (under torchrun the "
                             "weights are sharded and gathered layer by layer already)")
        self.policy = build_policy(cfg, self.device)
        if self.dist.enabled:
            from orbitrl.dist.fsdp import shard_policy

            shard_policy(self.policy, self.dist, cfg)
        self.model, self.tok = self.policy.model, self.policy.tokenizer
        self.train_rows, self.heldout_rows = train_rows, heldout_rows
        prompt_len = max(len(self.encode(x[cfg.data.prompt_field])) for x in train_rows[:256])
        self.engine, self.kv_plan = self._engine(prompt_len)
        self.governor = None
        if self.kv_plan is not None:
            self.governor = KVGovernor(int(cfg.rollout.min_available_mb * 2**20),
                                       self.kv_plan["cap"], device=self.device)
            self.engine.memory_hook = self.governor
        self.order = list(range(len(train_rows)))
        random.Random(cfg.train.seed).shuffle(self.order)
        self.data_pos = 0
        self.rewards = RewardRunner(reward_sources(cfg.reward), timeout_s=cfg.reward.timeout_s)
        self.opt = self._optimizer()
        if self.dist.enabled and is_fused(self.opt):
            self.opt.reduce_sum = self.dist.all_sum  # norms and factored moments of shards
        self.anchors = Anchors(self.model, self.policy.reference, cfg.algo.anchor_refresh_steps,
                               cfg.algo.anchor_kl_threshold)
        self.kl_ctl = make_kl_controller("adaptive" if cfg.algo.adaptive_kl else "fixed",
                                         coef=cfg.algo.kl_coef, target=cfg.algo.target_kl,
                                         horizon=cfg.algo.kl_horizon)
        self.critic = self.critic_opt = None
        if cfg.algo.name == "ppo":
            from orbitrl.rl.critic import ValueHead

            self.critic = ValueHead(self.model.config.hidden_size).to(self.device)
            self.critic_opt = torch.optim.AdamW(self.critic.parameters(), lr=cfg.algo.value_lr)
        self.guard = GradNormGuard()
        self.snapshot = Snapshot(self.policy.trainable) if cfg.train.mode == "adapter" else None
        self.iteration = 0  # steps run (skipped ones included): the metrics row key
        self.step_idx = 0  # optimizer steps taken = policy version
        self._fused_applied = self._fused_held = 0
        self._peak_flops: float | None = None
        self.overlap = None  # the producer thread (rollout.overlap), started at the first step
        self._resume_snapshots: dict | None = None  # its adapter snapshots, from a checkpoint
        self._data_trained = None  # overlapped: (data_pos, order) as of the trained steps
        self._last_step_end: float | None = None
        # polled between decode steps and micro-batches: True abandons the step in flight
        # (run.py sets it from SIGTERM on one process; ranks under torchrun stop together
        # at step boundaries instead, since a rank leaving mid-step would hang the others)
        self.should_stop = lambda: False
        self.mem.prediction = run_prediction(cfg, self.model, self.engine, prompt_len,
                                             devices=self.dist.world)
        self.mem.settle(self.model, self.policy.reference, self.engine.cache, self.opt,
                        self.critic, self.critic_opt)

    # ---- setup ---------------------------------------------------------------------
    def _engine(self, prompt_len: int):
        """The engine, its KV pool from ``rollout.kv_budget_mb`` or, at 0, from the memory
        training's predicted need leaves (``ledger.memory.kv_pool_for_run``)."""
        from orbitrl.engine.engine import kv_block_bytes
        from orbitrl.ledger.memory import kv_pool_for_run
        from orbitrl.observe.memory import tensor_bytes

        cfg, r, c = self.cfg, self.cfg.rollout, self.model.config
        kv_dtype = "fp8" if r.kv_dtype == "fp8" else None
        plan, budget = None, int(r.kv_budget_mb * 2**20)
        if not budget:
            bb = kv_block_bytes(self.model, kv_dtype, r.block_size)
            plan = kv_pool_for_run(cfg, c.hf, prompt_len, bb,
                                   available=available_memory(self.device),
                                   resident=tensor_bytes(self.model, self.policy.reference,
                                                         device=self.device),
                                   device=self.device.type, devices=self.dist.world)
            budget = plan["blocks"] * bb
        engine = Engine(self.model, self.tok, kv_budget_bytes=budget,
                        kv_dtype=kv_dtype, block_size=r.block_size,
                        seed=cfg.train.seed)
        if plan is not None:
            engine.max_blocks = plan["cap"]
        return engine, plan

    def _optimizer(self):
        t = self.cfg.train
        params = self.policy.trainable
        name = t.optimizer
        if name == "auto":
            name = "adamw" if t.mode == "adapter" else "adalomo"
        if name == "adamw":
            return torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
        from orbitrl.train.optim import build_optimizer

        opt = build_optimizer(name, params, t.lr, clip=None if t.clip == "auto" else t.clip,
                              max_grad_norm=t.max_grad_norm)
        # two passes: the heartbeat vetoes a spiking update between them (nothing applied, so
        # no snapshot of the full weights is needed); one pass (grouped): it sees the norm so
        # far after each tensor and stops the update once that passes its limit
        opt.veto = lambda norm: not self.guard.ok(norm)
        return opt

    def lr_at(self, step: int) -> float:
        t = self.cfg.train
        warm = min(1.0, (step + 1) / t.warmup_steps) if t.warmup_steps else 1.0
        if t.lr_schedule == "cosine":
            frac = min(1.0, step / max(1, t.max_steps))
            return t.min_lr + (t.lr - t.min_lr) * warm * 0.5 * (1 + math.cos(math.pi * frac))
        return t.lr * warm

    def next_prompts(self) -> list[dict]:
        """This rank's share of the step's prompts (every rank advances the data position
        by the whole global batch; ``dist.share`` gives the share's global index)."""
        P = self.cfg.rollout.prompts_per_step
        rows = []
        for _ in range(P):
            if self.data_pos % len(self.order) == 0 and self.data_pos:
                random.Random(self.cfg.train.seed + self.data_pos).shuffle(self.order)
            rows.append(self.train_rows[self.order[self.data_pos % len(self.order)]])
            self.data_pos += 1
        a, b = self.dist.share(P)
        return rows[a:b]

    def _rollout_weights(self):
        """Generation over sharded weights (ranks in lockstep) or gathered ones."""
        d = self.cfg.dist
        return rollout_weights(self.model, self.dist, d.rollout_weights, d.reshard_after_forward)

    def encode(self, text: str) -> list[int]:
        return encode_prompt(self.tok, text, self.cfg.data.chat_template)

    # ---- evaluation ----------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, rows: list[dict], reward: str | None = None) -> float:
        """Greedy accuracy (mean reward) on rows, with the run's reward or a named one."""
        d = self.cfg.data
        total = len(rows)
        a, b = self.dist.share(total)  # each rank scores its share, the sum is reduced
        rows = rows[a:b]
        prompts = [self.encode(r[d.prompt_field]) for r in rows]
        params = SamplingParams(n=1, max_tokens=self.cfg.rollout.max_tokens, temperature=0.0)
        with self._rollout_weights():
            samples = rollout(self.engine, prompts, rows, params, self.step_idx, 0, first=a)
        runner = self.rewards if reward is None else RewardRunner(
            [RewardSource(get_reward(reward), name=reward)], timeout_s=self.cfg.reward.timeout_s)
        res = runner([r[d.prompt_field] for r in rows], [s.text for s in samples],
                     [reward_fields(r, d.prompt_field, d.answer_field) for r in rows])
        return float(self.dist.all_sum(float(sum(res.rewards))) / max(1, total))

    # ---- the step ------------------------------------------------------------------
    def step(self) -> dict:
        """One RL step: sequential (rollout, reward, score, train) or, with
        ``rollout.overlap``, training on a batch the producer thread made beside the
        previous step's training (see overlap.py)."""
        if self.cfg.rollout.overlap:
            return self._step_overlapped()
        t_step = time.perf_counter()
        timer = self.mem.timer()  # a PhaseTimer that also measures each phase's peak
        position = (self.data_pos, list(self.order))
        try:
            batch = self.produce(self.iteration, self.step_idx, timer=timer)
            self._data_trained = None
            return self._consume(batch, timer, t_step)
        except StepAbandoned:  # nothing was applied: the step's prompts come again
            self.data_pos, self.order = position
            self.opt.zero_grad(set_to_none=True)
            raise

    def _step_overlapped(self) -> dict:
        from orbitrl.rl.overlap import Overlap

        if self.overlap is None:
            self.overlap = Overlap(self, self.cfg.rollout.queue_size, self.iteration,
                                   self._resume_snapshots)
        t_step = self._last_step_end or time.perf_counter()
        timer = self.mem.timer()
        batch, waited = self.overlap.get(self.iteration)
        self._data_trained = batch["data_after"]
        row = self._consume(batch, timer, t_step, waited=waited)
        self.overlap.trained(self.iteration)
        self._last_step_end = time.perf_counter()
        return row

    def close(self):
        """Stop the overlapped mode's producer thread (before evaluation or exit)."""
        if self.overlap is not None:
            self.overlap.stop()

    def produce(self, j: int, version: int, timer=None, cancel=None) -> dict:
        """Step j's samples and their rewards, sampled with policy ``version``."""
        from orbitrl.observe.metrics import PhaseTimer

        cfg, r, d = self.cfg, self.cfg.rollout, self.cfg.data
        timer = timer or PhaseTimer(self.device)
        rows = self.next_prompts()
        data_after = (self.data_pos, list(self.order))
        self.engine.memory_hook = self._engine_hook(cancel)
        try:
            with timer.phase("rollout"), self._rollout_weights():
                if cancel is None:  # (the producer thread never flips modes: adapter_view)
                    self.model.eval()
                params = SamplingParams(n=r.n, max_tokens=r.max_tokens,
                                        temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
                gen0 = self.engine.stats["generated_tokens"]
                wd0 = self.engine.stats.get("watchdog_events", 0)
                seed = cfg.train.seed * 7919 + (j if cancel is not None else version)
                samples = rollout(self.engine, [self.encode(x[d.prompt_field]) for x in rows],
                                  rows, params, version, seed, deadline_s=r.timeout_s or None,
                                  first=self.dist.share(r.prompts_per_step)[0])
                gen_tokens = self.engine.stats["generated_tokens"] - gen0
        finally:
            self.engine.memory_hook = self.governor
        batch = dict(samples=samples, gen_tokens=gen_tokens,
                     watchdog=self.engine.stats.get("watchdog_events", 0) - wd0,
                     timeline=list(self.engine.timeline), data_after=data_after,
                     governor=self.governor.state() if self.governor else {})
        if samples or self.dist.enabled:  # (an empty rank joins the collectives below)
            with timer.phase("reward"):
                res = self.rewards([s.fields[d.prompt_field] for s in samples],
                                   [s.text for s in samples],
                                   [reward_fields(s.fields, d.prompt_field, d.answer_field)
                                    for s in samples])
            batch["res"] = res
        batch["seconds"] = dict(timer.seconds)
        return batch

    def _engine_hook(self, cancel):
        """Before each engine step: the producer thread's cancel (overlapped mode) or a stop
        request abandons the rollout; then the KV governor."""
        gov, stop = self.governor, cancel or self.should_stop

        def hook(engine):
            if stop():
                from orbitrl.rl.overlap import Cancelled

                engine.scheduler.abort_all()
                raise Cancelled() if cancel is not None else StepAbandoned()
            if gov is not None:
                gov(engine)
        return hook

    def _consume(self, batch: dict, timer, t_step: float, waited: float | None = None) -> dict:
        """Rewards -> advantages -> score -> train on one produced batch; the metrics row."""
        algo, r = self.cfg.algo, self.cfg.rollout
        samples, gen_tokens = batch["samples"], batch["gen_tokens"]
        prod = batch["seconds"]  # rollout/reward seconds (the producer's, when overlapped)
        extra = {"watchdog": batch["watchdog"], **batch["governor"]}
        if waited is not None:
            extra["time_wait_rollout_s"] = waited
        # the rollout's transient (KV growth, sampling) goes back before training; on the
        # host the memory probe already trims the heap at each phase, so once per step there
        back = self.cfg.train.hand_back_memory
        if back:
            extra["memory_handed_back_bytes"] = hand_back(self.device) \
                if self.device.type == "cuda" else 0
        if not self.dist.any(bool(samples)):  # the watchdog dropped every group
            row = {"step": self.iteration, "reward_mean": 0.0, "step_skipped": 1,
                   "groups_kept": 0, **extra}
            row.update(self._step_metrics([], gen_tokens, timer, prod))
            self.iteration += 1
            return row
        res = batch["res"]
        rewards = torch.tensor(res.rewards, dtype=torch.float32).reshape(-1)
        if algo.overlong == "shape":
            from orbitrl.rl.advantages import overlong_penalty

            lens = torch.tensor([len(s.completion_ids) for s in samples])
            rewards = rewards + overlong_penalty(lens, r.max_tokens, algo.overlong_buffer)
        row = {"step": self.iteration, "reward_mean": float(torch.tensor(res.rewards).mean()),
               "groups_kept": len(samples) // r.n, **extra}
        row.update({k: v for k, v in res.metrics.items() if k != "reward_mean"})
        stale = [self.step_idx - s.policy_version for s in samples] or [0]
        row["staleness_mean"] = sum(stale) / len(stale)
        row["staleness_max"] = max(stale)
        keep = torch.ones(len(samples), dtype=torch.bool)
        if algo.dynamic_sampling:
            from orbitrl.rl.advantages import dynamic_sampling_mask

            keep = dynamic_sampling_mask(rewards, r.n)
            row["dropped_groups"] = int((~keep).sum()) // r.n
        if self.should_stop():
            raise StepAbandoned()
        with timer.phase("score"):
            ctx = self._score(samples, rewards, keep)
        if self.dist.any(ctx is not None) and ctx is None:  # others train: join them
            ctx = self._empty_ctx()
        if ctx is None:
            row["step_skipped"] = 1
        else:
            with timer.phase("train"):
                row.update(self._update(**ctx))
        if back:
            row["memory_handed_back_bytes"] += hand_back(self.device)
        row.update(self._step_metrics(samples, gen_tokens, timer, prod))
        step_s = time.perf_counter() - t_step
        row["time_step_s"] = step_s
        row.update(self._mfu(samples, keep, ctx, timer, step_s, batch["timeline"], prod, waited))
        lg = self.cfg.log  # check-alignment every log.align_every steps (evals/alignment.py)
        if lg.align_every and self.iteration % lg.align_every == 0 and not self.dist.enabled:
            from orbitrl.evals.alignment import training_row

            row.update(training_row(self.model, self.tok, [s.prompt_ids for s in samples[
                ::r.n][:lg.align_prompts]], min(16, r.max_tokens)))
        self.iteration += 1
        return row

    def _mfu(self, samples, keep, ctx, timer, step_s, timeline, prod, waited) -> dict:
        """The step's model-FLOPs utilisation and its waterfall (observe/flops.py). When
        overlapped, the rollout costs the step only the seconds training waited for it:
        those are split between decode and long tail as the engine's timeline splits its
        own seconds."""
        from orbitrl.observe.flops import measure_peak_flops, waterfall

        if self._peak_flops is None:
            self._peak_flops = measure_peak_flops()
        c = self.model.config
        params = c.num_params - (0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size)
        tokens = sum(len(s.prompt_ids) + len(s.completion_ids)
                     for s, k in zip(samples, keep.tolist()) if k)
        # no-grad passes: the scoring forward (none when the update's own forward gave the
        # old logprobs) and the reference's
        old_scored = ctx is not None and bool(ctx["old"]) and ctx["old"][0] is not None
        passes = int(old_scored) + (ctx is not None and ctx["ref"][0] is not None)
        train = 0 if ctx is None else tokens * self.cfg.algo.epochs * (
            2 if is_fused(self.opt) and getattr(self.opt, "two_pass", False) else 1)
        seconds = {**prod, **timer.seconds}
        if waited is not None:
            exposed = waited / max(prod.get("rollout", 0.0) + prod.get("reward", 0.0), 1e-9)
            exposed = min(1.0, exposed)
            timeline = [(n, t, sec * exposed) for n, t, sec in timeline]
            seconds["rollout"] = prod.get("rollout", 0.0) * exposed
            seconds["reward"] = prod.get("reward", 0.0) * exposed
        return waterfall(params, self._peak_flops, sum(t for _, t, _ in timeline), timeline,
                         tokens if ctx is not None else 0, passes, train,
                         self.cfg.train.mode == "adapter", seconds, step_s)

    def _score(self, samples, rewards, keep) -> dict | None:
        """Old (trainer) and anchored reference logprobs, once per step; advantages."""
        cfg, algo = self.cfg, self.cfg.algo
        T = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        idx = [i for i in range(len(samples)) if keep[i]]
        # batch-wide statistics (PPO's and REINFORCE++'s whitening, the KL penalty's mean)
        # are over every rank's rows; GRPO / RLOO groups stay whole on one rank
        global_stats = self.critic is not None or algo.name == "reinforce++" or algo.kl_in_reward
        if not idx:
            if self.dist.enabled:  # nothing kept here: join the others' collectives
                with lockstep(self.model, self.dist):
                    pass
                if global_stats:
                    from orbitrl.dist.batch import join_empty

                    join_empty(self.dist, 4 if self.critic is not None else 3, self.device)
            return None
        kept = [samples[i] for i in idx]
        mbs = micro_batches(kept, cfg.train.micro_batch_tokens)
        # packed once per micro-batch; the whole batch's [B, T] layout is its own pack only
        # when there are several (with one, it is that micro-batch's)
        parts = [pack([kept[j] for j in g], self.device) for g in mbs]
        full = parts[0] if len(parts) == 1 else pack(kept, self.device)
        mask = full.mask.clone()
        if algo.overlong == "filter":
            trunc = torch.tensor([s.truncated for s in kept], device=mask.device)
            mask = mask * (~trunc)[:, None].float()
        kl_coef = self.kl_ctl.value
        need_ref = kl_coef > 0 or algo.kl_in_reward
        reuse = self._old_from_update()
        with torch.no_grad(), lockstep(self.model, self.dist):  # ranks' forwards in step
            if self.critic is not None:
                scored = [score(self.model, p, T, return_hidden=True) for p in parts]
                old = [o for o, _ in scored]
                old_v = [p.pad(self.critic(h)) for p, (_, h) in zip(parts, scored)]
            elif reuse:  # the update's own forward gives them (actor_loss)
                old = [None] * len(parts)
            else:
                old = [score(self.model, p, T) for p in parts]
            ref = [None] * len(parts)
            if need_ref:
                with self.anchors.anchored() as ref_model:
                    ref = [score(ref_model, p, T) for p in parts]
        out = {}
        if not reuse:  # (the update's policy loss reports the same pair, from its old logprobs)
            # the engine's logprobs against the trainer's recomputation, every sampled token
            mm = torch.cat([(o - p.rollout_logp).abs()[p.mask.bool()]
                            for o, p in zip(old, parts)])
            out = {"logprob_mismatch_max": float(mm.max()),
                   "logprob_mismatch_mean": float(mm.mean())}
        # per-token KL to the reference with the configured estimator (the reward penalty,
        # kl_in_reward, uses it as is; the step-0 check reads it; neither reuses old logprobs)
        kl_full = _cat_padded([kl_estimate(o, rf, algo.kl_estimator) for o, rf in zip(old, ref)],
                              full.mask.shape) if need_ref and not reuse else None
        if algo.check and self.step_idx == 0 and need_ref:
            k0 = float((kl_full.abs() * full.mask).max())
            tol = 1e-5 if cfg.train.mode == "adapter" else 5e-2
            assert k0 <= tol, f"check: KL to the reference at step 0 is {k0:.3g} > {tol}"
        values = returns = None
        if self.critic is not None:
            values = _cat_padded(old_v, full.mask.shape)
            adv, returns = on_global_batch(self.dist, lambda r_, v_, m_, k_: ppo_advantages(
                algo, r_, v_, m_, k_, kl_coef), rewards[idx].to(self.device), values,
                full.mask, kl_full)
        elif global_stats:
            adv = on_global_batch(self.dist, lambda r_, m_, k_: compute_advantages(
                algo, r_, cfg.rollout.n, m_, k_, kl_coef),
                rewards[idx].to(self.device), full.mask, kl_full)
        else:
            adv = compute_advantages(algo, rewards[idx].to(self.device), cfg.rollout.n,
                                     full.mask, kl_full, kl_coef)
        return dict(parts=parts, mbs=mbs, old=old, ref=ref, adv=adv, mask=mask,
                    kl_coef=kl_coef, T=T, out=out, values=values, returns=returns)

    def _old_from_update(self) -> bool:
        """Whether the old-policy logprobs can come from the update's own forward instead of
        a scoring pass: the weights stay as they are from scoring until every micro-batch
        has run its forward (one epoch, an optimizer that steps after the last micro-batch,
        not the fused one that updates during each backward), and nothing before the update
        needs them (PPO's values, the KL penalty in the reward, the step-0 check). The
        forward with gradients computes the same logprobs as one without (same kernels,
        same weights: bit for bit on CPU), so the ratio is 1 on the first epoch either way;
        one forward of the batch is saved."""
        algo = self.cfg.algo
        return (algo.epochs == 1 and self.critic is None and not algo.kl_in_reward
                and not is_fused(self.opt) and not (algo.check and self.step_idx == 0))

    def _update(self, parts, mbs, old, ref, adv, mask, kl_coef, T, out, values=None,
                returns=None) -> dict:
        cfg, algo = self.cfg, self.cfg.algo
        self.model.train()
        lr = self.lr_at(self.step_idx)
        for g in self.opt.param_groups:
            g["lr"] = lr
        denom = float(mask.sum()) if algo.loss_agg == "token-mean" else float(mask.shape[0])
        # global tokens (or samples): the summed gradient over ranks is the one-process one
        denom = self.dist.all_sum(denom)
        offsets = [0]
        for g in mbs:
            offsets.append(offsets[-1] + len(g))
        metrics_by_mb: dict = {}  # a fused two-pass step runs the closure twice: keep the last
        fused = is_fused(self.opt)
        # every rank runs the same number of micro-batches (each is a collective)
        n_mb = int(self.dist.all_max(len(parts)))
        for epoch in range(algo.epochs):
            for k in range(n_mb):
                if k >= len(parts):
                    self._idle_micro_batch(fused)
                    continue
                # a stop request leaves before the next micro-batch while nothing is applied
                # yet (a fused update and the critic's step apply as they go)
                if not fused and (self.critic is None or (k == 0 and epoch == 0)) \
                        and self.should_stop():
                    raise StepAbandoned()
                p = parts[k]
                a, b = offsets[k], offsets[k + 1]
                T_k = p.mask.shape[1]
                adv_k = adv[a:b, :T_k]
                p.mask = mask[a:b, :T_k]

                crit = {}
                if self.critic is not None:
                    crit = dict(critic=self.critic, old_values=values[a:b, :T_k],
                                returns=returns[a:b, :T_k])

                def closure(p=p, k=k, adv_k=adv_k, crit=crit):
                    if self.critic is not None:  # a fused two-pass step runs this twice
                        self.critic_opt.zero_grad(set_to_none=True)
                    loss, m = actor_loss(self.model, p, old[k], ref[k], adv_k, algo, kl_coef, T,
                                         denom, cfg.rollout.max_tokens, **crit)
                    if algo.check and self.step_idx == 0 and epoch == 0 and k == 0:
                        assert abs(m["ratio_mean"] - 1) < 1e-5, \
                            f"check: policy ratio at step 0 is {m['ratio_mean']}"
                    loss.backward()
                    metrics_by_mb[(epoch, k)] = m | {"loss": float(loss.detach())}
                    return loss

                if fused:
                    self.opt.step(closure)
                else:
                    closure()
                self._critic_step()
        self.model.eval()
        return out | self._apply(fused, list(metrics_by_mb.values()), lr)

    def _idle_micro_batch(self, fused: bool):
        """A rank out of micro-batches joins the others' collectives with a zero loss."""
        if self.critic is not None:
            self.critic_opt.zero_grad(set_to_none=True)
        if fused:
            self.opt.step(lambda: idle_backward(self.model))
        else:
            idle_backward(self.model)
        self._critic_step()

    def _critic_step(self):
        """The value head's update after a micro-batch (its gradients summed over ranks)."""
        if self.critic is None:
            return
        sum_grads(self.critic.parameters(), self.dist)
        torch.nn.utils.clip_grad_norm_(self.critic.parameters(), 1.0)
        self.critic_opt.step()
        self.critic_opt.zero_grad(set_to_none=True)

    def _empty_ctx(self) -> dict:
        """The training context of a rank left with no kept samples (others have some)."""
        z = torch.zeros(0, 1, device=self.device)
        return dict(parts=[], mbs=[], old=[], ref=[None], adv=z, mask=z, kl_coef=self.kl_ctl.value,
                    T=1.0, out={}, values=z, returns=z)

    def skip_counts(self) -> dict:
        """Steps skipped (or, one-pass, stopped) so far: spikes and non-finite gradients, from
        the heartbeat and from a fused optimizer's own checks."""
        st = self.opt.stats if is_fused(self.opt) else None
        return {"skipped_spike": self.guard.skipped_spike,
                "skipped_nonfinite": self.guard.skipped_nonfinite +
                (st.skipped + st.partial if st else 0)}

    def _apply(self, fused: bool, metrics: list[dict], lr: float) -> dict:
        out = {"lr": lr}
        if self.dist.enabled:  # every rank aggregates every micro-batch: the same decisions
            metrics = [m for ms in self.dist.gather_objects(metrics) for m in ms]
        if fused:
            st = self.opt.stats
            norm = st.last_grad_norm
            applied = st.micro_steps - self._fused_applied
            self._fused_applied = st.micro_steps
            ok = applied > 0
            out["grad_norm"] = norm
            size = self.opt.take_update_size()  # reset even when nothing was applied
            held, self._fused_held = st.held - self._fused_held, st.held
            if not self.opt.two_pass:  # one pass: tensors a stop left unchanged this step
                out["update_held"] = held
            if ok or held:  # a one-pass stop keeps the tensors updated before it
                out.update(size)
        else:
            named = [(n, q) for n, q in self.model.named_parameters() if q.requires_grad]
            layers = layer_grad_norms(named, reduce=self.dist.all_sum)  # a no-op on one process
            norm = math.sqrt(sum(v * v for v in layers.values()))
            loss_ok = all(math.isfinite(m["loss"]) for m in metrics)
            ok = self.guard.ok(norm if loss_ok else float("nan"))
            out["grad_norm"] = norm
            if ok:
                torch.nn.utils.clip_grad_norm_(self.policy.trainable, self.cfg.train.max_grad_norm)
                self.opt.step()
                self.guard.accept(norm, layers)
                if self.snapshot is not None:
                    out.update(self.snapshot.update_size(self.dist.all_sum))
                    self.snapshot.save()
            else:  # vetoed before opt.step: weights and moments are the last good state
                out["spike_layer"] = self.guard.worst_layer(layers)[0]
            self.opt.zero_grad(set_to_none=True)
        if fused and ok and not held:
            self.guard.accept(norm)  # a one-pass step stopped at a spike stays out of the mean
        out["step_skipped"] = 0 if ok else 1
        out.update(self.skip_counts())
        keys = set().union(*metrics) if metrics else set()
        for k in keys:
            vals = [m[k] for m in metrics if k in m and isinstance(m[k], (int, float))]
            if vals:
                out[k] = max(vals) if k.endswith("_max") else sum(vals) / len(vals)
        if ok:
            self.step_idx += 1
        reason = self.anchors.maybe_refresh(self.step_idx, out.get("kl", 0.0))
        if reason:
            out["anchor_refresh"] = reason
        out["anchor_refreshes"] = len(self.anchors.events)
        # the controller's horizon counts samples (Ziegler et al.): one step moves the
        # coefficient by at most 0.2 x (the step's global batch / horizon)
        r = self.cfg.rollout
        self.kl_ctl.update(out.get("kl", 0.0), r.prompts_per_step * r.n)
        out["kl_coef"] = self.kl_ctl.value
        return out

    def _step_metrics(self, samples, gen_tokens, timer, prod) -> dict:
        lens = [len(s.completion_ids) for s in samples] or [0]
        return {
            "policy_version": self.step_idx,
            "completion_len_mean": sum(lens) / len(lens),
            "truncated_frac": sum(s.truncated for s in samples) / max(1, len(samples)),
            "tokens_per_s": gen_tokens / max(prod.get("rollout", 0.0), 1e-9),
            "kv_blocks": self.engine.pool.num_blocks,
            "peak_memory_bytes": device_peak_bytes(self.device),
            **{f"time_{k}_s": v for k, v in {**prod, **timer.seconds}.items()},
            **{f"mem_{k}_bytes": v for k, v in timer.memory.items()},
            **self.mem.step_metrics(timer),
        }


def _cat_padded(tensors: list[torch.Tensor], shape) -> torch.Tensor:
    out = tensors[0].new_zeros(shape)
    r = 0
    for t in tensors:
        out[r:r + t.shape[0], :t.shape[1]] = t
        r += t.shape[0]
    return out
