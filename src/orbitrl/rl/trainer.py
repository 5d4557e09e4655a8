"""The RL step: rollout -> score -> update, one typed object along each arrow.

``RLTrainer`` builds the run's components and wires them into the three phases: a rollout
source (``sources.py``: colocated, one-step overlap or separate pools, chosen once) gives
each step's judged ``Rollout``; ``score.py`` turns it into a ``Scored`` batch (rewards,
shaping, reference, values, advantages); ``update.py`` into an ``Update`` (the optimizer
step behind its guards). ``step()`` calls them in turn; ``observe/step.py`` assembles the
metrics row; checkpoints (``rl/checkpoint/``) read the components' own state. Evaluation
and reporting are the caller's (``run.py``, ``evals/``).
"""

from __future__ import annotations

import random
import time
from functools import partial

import torch

from orbitrl.config import Config
from orbitrl.distributed.collective import Collective
from orbitrl.distributed.env import Dist
from orbitrl.engine.governor import KVGovernor, hand_back
from orbitrl.ledger.runtime import micro_batch_tokens, resolve_recompute
from orbitrl.model.tokenizer import opens_thinking, prompt_encoder
from orbitrl.observe.memory import MemoryProbe, run_prediction
from orbitrl.observe.metrics import PhaseTimer
from orbitrl.observe.step import StepFlops, StepRow
from orbitrl.rewards import RewardRunner
from orbitrl.rl.alignment import training_row
from orbitrl.rl.anchors import Anchors
from orbitrl.rl.critic import build_critic
from orbitrl.rl.cursor import DataCursor
from orbitrl.rl.evaluate import Evaluator
from orbitrl.rl.guards import GradNormGuard, Snapshot
from orbitrl.rl.losses import make_kl_controller
from orbitrl.rl.parallel import Workers, resolve_workers
from orbitrl.rl.policy import build_policy, pick_device, policy_tokenizer, resolve_base
from orbitrl.rl.refill import Refill
from orbitrl.rl.rollout import Rollouts, build_engine
from orbitrl.rl.score import Scorer, reward_sources
from orbitrl.rl.sources import StepClock, check_modes, rollout_source
from orbitrl.rl.trajectory import trajectories_fn
from orbitrl.rl.types import StepAbandoned, StepScore, Update
from orbitrl.rl.update import Updater, build_optimizer
from orbitrl.train.optim import is_fused

__all__ = ["RLTrainer", "StepAbandoned", "seed_everything"]


def seed_everything(seed: int, deterministic: bool = False):
    random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


class RLTrainer:
    """Holds the run's state (policy, engine, optimizer, anchors, guards, data position).

    ``roles``: separate pools (distributed/roles.py); ``dist`` is then the training pool's.
    ``heldout_rows``: unused here (evaluation is the caller's: run.py), kept for callers.
    """

    def __init__(self, cfg: Config, train_rows: list[dict], heldout_rows: list[dict],
                 dist: Dist | None = None, roles=None):
        self.cfg, self.coll = cfg, Collective(dist)  # one process unless under torchrun
        seed_everything(cfg.train.seed, cfg.train.deterministic)
        self.device = pick_device(cfg.model.device)
        check_modes(cfg, self.coll)
        tok = policy_tokenizer(cfg)  # the prompts' length prices the run
        self.encode = prompt_encoder(tok, cfg.data)  # every prompt, as data.* says
        prompt_len = max(len(self.encode(x[cfg.data.prompt_field])) for x in train_rows[:256])
        resolve_base(cfg, self.device, prompt_len, self.coll.enabled or roles is not None)
        # baseline: before the model is loaded (torchao holds a quantized base, and full
        # mode's int8 reference)
        self.mem = MemoryProbe(self.device, quantized=cfg.train.mode == "full"
                               or cfg.model.base_dtype in ("int8", "nf4mix", "nf4"))
        self.policy = build_policy(cfg, self.device, tokenizer=tok)
        self.coll.shard(self.policy, cfg)
        model = self.policy.model
        # train.recompute auto: the ledger's choice for these prompts (micro-batch, scoring and
        # the memory prediction all read model.recompute)
        model.recompute = resolve_recompute(cfg, model.config.hf, prompt_len,
                                            self.device.type, self.coll.world)
        self.engine, kv_plan = build_engine(cfg, model, self.tok, self.policy.reference,
                                            self.device, prompt_len, self.coll.world)
        self.engine.kv_plan = kv_plan
        if kv_plan is not None:  # (tr.governor)
            self.engine.memory_hook = KVGovernor(int(cfg.rollout.min_available_mb * 2**20),
                                                 kv_plan["cap"], device=self.device)
        self.data = DataCursor(train_rows, cfg.train.seed)
        self.opt = build_optimizer(cfg.train, self.policy.trainable,
                                   lambda norm: not self.guard.ok(norm))
        self.coll.attach(self.opt)
        self.guard = GradNormGuard()
        self.iteration = 0  # steps run (skipped ones included): the metrics row key
        self.step_idx = 0  # optimizer steps taken = policy version
        # polled between decode steps and micro-batches: True abandons the step in flight
        # (run.py sets it from SIGTERM where the source allows it)
        self.should_stop = lambda: False
        self._wire(prompt_len, roles)

    def _wire(self, prompt_len: int, roles):
        """The phases over the components, the rollout source, the memory prediction."""
        cfg, model = self.cfg, self.model
        critic = build_critic(cfg, model, self.device, self.coll, self.coll.enabled)
        self.workers = Workers(resolve_workers(cfg, self.device, self.coll.enabled,
                                               is_fused(self.opt), critic is not None,
                                               model.config.moe is not None),
                               max(1, cfg.train.threads))
        rewards = RewardRunner(reward_sources(cfg.reward, self.device, cfg.model.dtype),
                               timeout_s=cfg.reward.timeout_s,
                               strip_thinking=cfg.reward.strip_thinking,
                               opened=opens_thinking(self.tok, self.encode))
        a = cfg.algo
        anchors = Anchors(model, self.policy.reference, a.anchor_refresh_steps,
                          a.anchor_kl_threshold)
        kl_ctl = make_kl_controller("adaptive" if a.adaptive_kl else "fixed", coef=a.kl_coef,
                                    target=a.target_kl, horizon=a.kl_horizon)
        mb_tokens = micro_batch_tokens(cfg, model.config.hf, self.device.type, model.recompute,
                                       self.workers.n, self.coll.world)
        self.scorer = Scorer(a, cfg.rollout, cfg.data, model, self.device, rewards, anchors,
                             kl_ctl, critic, self.opt, self.coll, self.workers,
                             mb_tokens=mb_tokens, frozen_base=cfg.train.mode == "adapter",
                             replay_check_every=cfg.moe.replay_check_every)
        turns = (partial(trajectories_fn, self.engine, self.engine.tokenizer, self.encode, cfg)
                 if cfg.env.name else None)
        rollouts = Rollouts(cfg.rollout, cfg.dist, cfg.train.seed, cfg.data.prompt_field,
                            self.engine, self.governor, model, self.encode, self.data,
                            self.coll, turns)
        # judged rollouts, with dynamic sampling's refill rounds (either thread draws them)
        refill = Refill(a, cfg.rollout, rollouts, self.scorer.judge, self.scorer.informative,
                        self.coll)
        snapshot = Snapshot(self.policy.trainable) if cfg.train.mode == "adapter" else None
        self.updater = Updater(a, cfg.train, cfg.rollout.max_tokens, model,
                               self.policy.trainable, self.opt, self.guard, snapshot, critic,
                               self.coll, self.workers)
        self.evaluator = Evaluator(self.engine, self.encode, cfg.data, cfg.rollout.max_tokens,
                                   cfg.reward.timeout_s, rollouts.weights, self.coll,
                                   trajectories=rollouts.trajectories if cfg.env.name
                                   else None)
        self.source = rollout_source(cfg, roles, self.data, refill, model, self.device,
                                     self.scorer.judge, self.coll)
        two_pass = is_fused(self.opt) and getattr(self.opt, "two_pass", False)
        flops = StepFlops(model.config, cfg.train.mode == "adapter",
                          cfg.algo.epochs * (2 if two_pass else 1))
        # the planner's step time beside the measured one (not for the in-process overlap:
        # the simulator's one_step shape needs two devices)
        predictor = self.source.predictor(cfg, self.engine.scheduler.max_num_seqs,
                                          self.coll.world, prompt_len)
        self.report = StepRow(self.device, self.engine, self.mem, flops, predictor)
        self.mem.predict_at = partial(run_prediction, cfg, model, self.engine, prompt_len,
                                      self.coll.world, self.workers.n)
        self.mem.prediction = self.mem.predict_at(0)
        self.mem.settle(model, self.policy.reference, self.engine.cache, self.opt,
                        *((critic.module, critic.opt) if critic else ()))

    # ---- what the lifecycle, checkpoints and tests read ------------------------------------
    model = property(lambda self: self.policy.model)
    tok = property(lambda self: self.policy.tokenizer)
    dist = property(lambda self: self.coll.dist)
    governor = property(lambda self: self.engine.memory_hook)
    kv_plan = property(lambda self: self.engine.kv_plan)
    rewards = property(lambda self: self.scorer.runner)
    anchors = property(lambda self: self.scorer.anchors)
    kl_ctl = property(lambda self: self.scorer.kl_ctl)
    critic = property(lambda self: self.updater.critic)
    snapshot = property(lambda self: self.updater.snapshot)
    predictor = property(lambda self: self.report.predictor)
    train_rows = property(lambda self: self.data.rows)
    # multi-turn: the last step's trajectories (run.py logs them)
    last_trajectories = property(lambda self: self.report.trajectories)

    def skip_counts(self) -> dict:
        return self.updater.skip_counts()

    def evaluate(self, rows: list[dict], reward: str | None = None) -> float:
        """Greedy accuracy (mean reward) on rows, with the run's reward or a named one."""
        return self.evaluator.accuracy(rows, self.rewards if reward is None else reward,
                                       self.step_idx)

    # ---- the step ------------------------------------------------------------------
    def step(self) -> dict:
        """One RL step: rollout, score, update; the metrics row."""
        t_step = time.perf_counter()
        # phase peaks on probe steps only: a host probe trims the heap before each phase
        # (a device's probe trims nothing and costs what the plain timer does: every step)
        every = self.cfg.log.memory_every
        probed = (self.iteration < 2 or self.iteration % every == 0
                  or self.device.type == "cuda")
        timer = self.mem.timer() if probed else PhaseTimer(self.device)
        position = self.source.position()
        try:
            ro, waited, t_step = self.source.next_batch(StepClock(
                self.step_idx, self.iteration, timer, t_step, self.should_stop))
            back = self._hand_back()
            sc = self.scorer(ro, self.step_idx, timer, self.should_stop)
            upd = self.update(sc, timer)
        except StepAbandoned:
            if position is not None:  # nothing was applied: the step's prompts come again
                self.data.rewind(position)
                self.opt.zero_grad(set_to_none=True)
            raise
        if back and sc.anything and probed:  # (a device's steps are all probed)
            back["memory_handed_back_bytes"] += hand_back(self.device)
        row = self.report(self.iteration, self.step_idx, ro, sc, upd, timer, t_step, waited,
                          self.source, back)
        row.update(self._alignment(ro.samples))
        self.report.trajectories = ro.trajectories
        self.iteration += 1
        self.source.trained(self.iteration, self.step_idx)
        return row

    def update(self, sc: StepScore, timer) -> Update:
        """Train on the scored batch; then the policy version, anchors and KL coefficient."""
        if sc.batch is None:
            return Update(applied=False, metrics={"step_skipped": 1} if sc.anything else {})
        with timer.phase("train"):
            upd = self.updater(sc.batch, self.step_idx, self.should_stop)
        if upd.applied:
            self.step_idx += 1
            upd.metrics.update(self.source.published(self.step_idx))  # e.g. to rollout ranks
        upd.metrics.update(self.scorer.after_update(self.step_idx, upd.metrics.get("kl", 0.0)))
        return upd

    def close(self):
        """Stop the source (the overlap's producer thread, the rollout ranks) and the
        workers (before evaluation or exit)."""
        self.source.close()
        self.workers.close()

    def _alignment(self, samples) -> dict:
        """check-alignment every ``log.align_every`` steps (rl/alignment.py), one process."""
        lg, r = self.cfg.log, self.cfg.rollout
        if not lg.align_every or self.iteration % lg.align_every or self.coll.enabled:
            return {}
        return training_row(self.model, self.tok, [s.prompt_ids for s in samples[::r.n]]
                            [:lg.align_prompts], min(16, r.max_tokens))

    def _hand_back(self) -> dict:
        """The rollout's transient (KV growth, sampling) goes back before training; on the
        host the memory probe already trims the heap at each phase, so once per step there."""
        if not self.cfg.train.hand_back_memory:
            return {}
        return {"memory_handed_back_bytes": hand_back(self.device)
                if self.device.type == "cuda" else 0}
