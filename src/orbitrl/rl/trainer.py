"""The RL step: rollout -> score -> update, one typed object along each arrow.

``RLTrainer`` builds the run's components (policy, engine, data cursor, reward runner,
optimizer, anchors, guard, KL controller) and wires them into the three phases:
``rollout.py`` (prompts -> ``Rollout``), ``score.py`` (-> ``Scored``: rewards, shaping,
reference, values, advantages) and ``update.py`` (-> ``Update``: the optimizer step behind
its guards). ``step()`` calls them in turn; the metrics row is assembled by
``observe/step.py``; checkpoints (``rl/checkpoint/``) read the components' own state.
"""

from __future__ import annotations

import random
import time

import torch

from orbitrl.config import Config
from orbitrl.distributed.collective import Collective
from orbitrl.distributed.env import Dist
from orbitrl.engine.governor import KVGovernor, hand_back
from orbitrl.errors import OrbitError
from orbitrl.ledger.runtime import resolve_recompute
from orbitrl.model.tokenizer import encode_prompt
from orbitrl.observe.memory import MemoryProbe, run_prediction
from orbitrl.observe.metrics import PhaseTimer
from orbitrl.observe.step import StepFlops, phase_metrics, sample_metrics
from orbitrl.rewards import RewardRunner
from orbitrl.rl.alignment import training_row
from orbitrl.rl.anchors import Anchors
from orbitrl.rl.cursor import DataCursor
from orbitrl.rl.evaluate import Evaluator
from orbitrl.rl.guards import GradNormGuard, Snapshot
from orbitrl.rl.losses import make_kl_controller
from orbitrl.rl.policy import build_policy, pick_device
from orbitrl.rl.parallel import Workers, resolve_workers
from orbitrl.rl.refill import Refill
from orbitrl.rl.rollout import Rollouts, build_engine
from orbitrl.rl.score import Scorer, reward_sources
from orbitrl.rl.types import Rollout, StepAbandoned, StepScore, Update
from orbitrl.rl.update import Updater, build_optimizer
from orbitrl.train.optim import is_fused

__all__ = ["RLTrainer", "StepAbandoned", "seed_everything"]


def seed_everything(seed: int, deterministic: bool = False):
    random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


def check_modes(cfg: Config, coll: Collective):
    """Combinations refused before anything loads."""
    if cfg.rollout.overlap and cfg.train.mode != "adapter":
        raise OrbitError("config key 'rollout.overlap': the overlapped mode needs "
                         "train.mode adapter (full mode would hold a second copy of the "
                         "weights for the rollout thread)")
    if cfg.rollout.overlap and coll.enabled:
        raise OrbitError("config key 'rollout.overlap': not supported under torchrun "
                         "(sharded forwards run in lockstep across ranks; a rollout "
                         "thread beside training would interleave their collectives)")
    if cfg.train.tiers and coll.enabled:
        raise OrbitError("config key 'train.tiers': one process only (under torchrun the "
                         "weights are sharded and gathered layer by layer already)")


class RLTrainer:
    """Holds the run's state (policy, engine, optimizer, anchors, guards, data position)."""

    def __init__(self, cfg: Config, train_rows: list[dict], heldout_rows: list[dict],
                 dist: Dist | None = None, roles=None):
        # roles: separate pools (distributed/roles.py); ``dist`` is then the training pool's
        self.roles = roles
        self.cfg, self.coll = cfg, Collective(dist)  # one process unless under torchrun
        self.dist = self.coll.dist
        seed_everything(cfg.train.seed, cfg.train.deterministic)
        self.device = pick_device(cfg.model.device)
        # baseline: before the model is loaded (torchao holds a quantized base, and full
        # mode's int8 reference)
        self.mem = MemoryProbe(self.device, quantized=cfg.train.mode == "full"
                               or cfg.model.base_dtype in ("int8", "nf4"))
        check_modes(cfg, self.coll)
        self.policy = build_policy(cfg, self.device)
        self.coll.shard(self.policy, cfg)
        self.model, self.tok = self.policy.model, self.policy.tokenizer
        self.train_rows, self.heldout_rows = train_rows, heldout_rows
        prompt_len = max(len(self.encode(x[cfg.data.prompt_field])) for x in train_rows[:256])
        # train.recompute auto: the ledger's choice for these prompts (micro-batch, scoring and
        # the memory prediction all read model.recompute)
        self.model.recompute = resolve_recompute(cfg, self.model.config.hf, prompt_len,
                                                 self.device.type, self.coll.world)
        self.engine, self.kv_plan = build_engine(cfg, self.model, self.tok,
                                                 self.policy.reference, self.device,
                                                 prompt_len, self.coll.world)
        self.governor = None
        if self.kv_plan is not None:
            self.governor = KVGovernor(int(cfg.rollout.min_available_mb * 2**20),
                                       self.kv_plan["cap"], device=self.device)
            self.engine.memory_hook = self.governor
        self.data = DataCursor(train_rows, cfg.train.seed)
        self.rewards = RewardRunner(reward_sources(cfg.reward), timeout_s=cfg.reward.timeout_s)
        self.opt = build_optimizer(cfg.train, self.policy.trainable,
                                   lambda norm: not self.guard.ok(norm))
        self.coll.attach(self.opt)
        self.anchors = Anchors(self.model, self.policy.reference, cfg.algo.anchor_refresh_steps,
                               cfg.algo.anchor_kl_threshold)
        self.kl_ctl = make_kl_controller("adaptive" if cfg.algo.adaptive_kl else "fixed",
                                         coef=cfg.algo.kl_coef, target=cfg.algo.target_kl,
                                         horizon=cfg.algo.kl_horizon)
        self.critic, self.critic_opt = self._critic()
        self.guard = GradNormGuard()
        self.snapshot = Snapshot(self.policy.trainable) if cfg.train.mode == "adapter" else None
        self._wire(prompt_len)

    def _critic(self):
        """PPO's value head and its optimizer (None, None for the other algorithms)."""
        if self.cfg.algo.name != "ppo":
            return None, None
        from orbitrl.rl.critic import ValueHead

        critic = ValueHead(self.model.config.hidden_size).to(self.device)
        return critic, torch.optim.AdamW(critic.parameters(), lr=self.cfg.algo.value_lr)

    def _wire(self, prompt_len: int):
        """The phases over the components, the step counters, the memory prediction."""
        cfg = self.cfg
        self.rollouts = Rollouts(cfg, self.engine, self.governor, self.model, self.encode,
                                 self.data, self.coll)
        self.workers = Workers(resolve_workers(cfg, self.device, self.coll.enabled,
                                               is_fused(self.opt), self.critic is not None,
                                               self.model.config.moe is not None),
                               max(1, cfg.train.threads))
        self.scorer = Scorer(cfg, self.model, self.device, self.rewards, self.anchors,
                             self.kl_ctl, self.critic, self.opt, self.coll, self.workers)
        # judged rollouts, with dynamic sampling's refill rounds (either thread draws them)
        self.refill = Refill(cfg, self.rollouts, self.scorer.judge, self.scorer.informative,
                             self.coll)
        self.updater = Updater(cfg, self.model, self.policy.trainable, self.opt, self.guard,
                               self.snapshot, self.critic, self.critic_opt, self.coll,
                               self.workers)
        self.evaluator = Evaluator(self.engine, self.encode, cfg.data, cfg.rollout.max_tokens,
                                   cfg.reward.timeout_s, self.rollouts.weights, self.coll,
                                   trajectories=self.rollouts.trajectories if cfg.env.name
                                   else None)
        two_pass = is_fused(self.opt) and getattr(self.opt, "two_pass", False)
        self.flops = StepFlops(self.model.config, cfg.train.mode == "adapter",
                               cfg.algo.epochs * (2 if two_pass else 1))
        self.iteration = 0  # steps run (skipped ones included): the metrics row key
        self.step_idx = 0  # optimizer steps taken = policy version
        self.last_trajectories: list = []  # multi-turn: the last step's logged trajectories
        self.overlap = None  # the producer thread (rollout.overlap), started at the first step
        self.resume_snapshots: dict | None = None  # its adapter snapshots, from a checkpoint
        self._last_step_end: float | None = None
        self.pool, self._pool_row = self._pools(), {}
        self.predictor = self._predictor(prompt_len)
        # polled between decode steps and micro-batches: True abandons the step in flight
        # (run.py sets it from SIGTERM on one process; ranks under torchrun stop together
        # at step boundaries instead, since a rank leaving mid-step would hang the others)
        self.should_stop = lambda: False
        self.mem.prediction = run_prediction(cfg, self.model, self.engine, prompt_len,
                                             devices=self.coll.world,
                                             workers=self.workers.n)
        self.mem.settle(self.model, self.policy.reference, self.engine.cache, self.opt,
                        self.critic, self.critic_opt)

    def _pools(self):
        """The leader's side of separate pools (None: colocated)."""
        if self.roles is None:
            return None
        from orbitrl.rl.pools import PoolRollouts, PoolShare

        if not self.roles.is_leader:  # another rank of a training pool: the leader's share
            return PoolShare(self.roles, self.model)
        return PoolRollouts(self.cfg, self.roles, self.data, self.model)

    def _predictor(self, prompt_len: int):
        """The planner's step time beside the measured one (not for the in-process
        overlap: the simulator's one_step shape needs two devices)."""
        from orbitrl.observe.schedule import StepPredictor

        if self.cfg.rollout.overlap:
            return None
        s = self.cfg.schedule
        slots = self.engine.scheduler.max_num_seqs
        if self.roles is None:  # each rank generates and trains its share: one device each
            return StepPredictor("colocated", 1, 1, 1, slots, self.coll.world,
                                 self.coll.world, prompt_len=prompt_len)
        from orbitrl.rl.pools import steps_ahead

        r = self.roles
        if not r.is_leader:  # the leader predicts the whole step
            return None
        return StepPredictor(s.shape, r.world, len(r.rollout_ranks), steps_ahead(self.cfg),
                             slots, r.world, len(r.train_ranks),
                             "reprefill" if s.partial == "cut" else "keep_kv",
                             s.stale_policy, prompt_len)

    def encode(self, text: str) -> list[int]:  # as data.chat_template says
        return encode_prompt(self.tok, text, self.cfg.data.chat_template)

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
        every = self.cfg.log.memory_every
        # (a device's probe trims nothing and costs what the plain timer does: every step)
        self._probed = (self.iteration < 2 or self.iteration % every == 0
                        or self.device.type == "cuda")
        timer = self.mem.timer() if self._probed else PhaseTimer(self.device)
        position = None if self.cfg.rollout.overlap or self.pool else self.data.position()
        try:
            ro, waited, t_step = self.rollout(timer, t_step)
            back = self._hand_back()
            sc = self.scorer(ro, self.step_idx, timer, self.should_stop)
            upd = self.update(sc, timer)
        except StepAbandoned:
            if position is not None:  # nothing was applied: the step's prompts come again
                self.data.rewind(position)
                self.opt.zero_grad(set_to_none=True)
            raise
        return self._row(ro, sc, upd, timer, t_step, waited, back)

    def rollout(self, timer, t_step: float) -> tuple[Rollout, float | None, float]:
        """The step's judged rollout: drawn now, or (``rollout.overlap``) the one the
        producer thread made beside the previous step's training. Returns it, the seconds
        waited for it (overlapped) and when the step began."""
        if self.pool is not None:
            return self._pool_rollout(timer, t_step)
        if not self.cfg.rollout.overlap:
            return self.refill(self.step_idx, self.step_idx, self.should_stop, StepAbandoned,
                               timer, eval_mode=True), None, t_step
        if self.overlap is None:
            from orbitrl.rl.overlap import Overlap, producer

            produce = producer(self.refill, self.device)
            self.overlap = Overlap(produce, self.model, self.cfg.train.max_steps,
                                   self.cfg.rollout.queue_size, self.iteration, self.step_idx,
                                   self.resume_snapshots)
        ro, waited = self.overlap.get(self.iteration)
        self.data.trained(ro.data_after)
        return ro, waited, self._last_step_end or t_step

    def _pool_rollout(self, timer, t_step: float):
        """The step's samples from the rollout ranks (the first call sends them the
        weights), judged here."""
        self._pool_row = self.pool.push(self.step_idx)
        ro, waited, row = self.pool.get(self.iteration, self.step_idx)
        self._pool_row.update(row)
        self.data.trained(ro.data_after)
        generated = ro.seconds
        ro = self.scorer.judge(ro, timer)
        ro.seconds = {**generated, **ro.seconds}
        return ro, waited, t_step

    def update(self, sc: StepScore, timer) -> Update:
        """Train on the scored batch; then the policy version, anchors and KL coefficient."""
        if sc.batch is None:
            return Update(applied=False, metrics={"step_skipped": 1} if sc.anything else {})
        with timer.phase("train"):
            upd = self.updater(sc.batch, self.step_idx, self.should_stop)
        if upd.applied:
            self.step_idx += 1
            if self.pool is not None:  # the new version to the rollout ranks
                upd.metrics.update(self.pool.push(self.step_idx))
        upd.metrics.update(self.scorer.after_update(self.step_idx, upd.metrics.get("kl", 0.0)))
        return upd

    def close(self):
        """Stop the overlapped mode's producer thread, or the rollout ranks (before
        evaluation or exit)."""
        if self.overlap is not None:
            self.overlap.stop()
        if self.pool is not None:
            self.pool.stop()
            self.pool = None
        self.workers.close()

    # ---- the row -------------------------------------------------------------------
    def _alignment(self, samples) -> dict:
        """check-alignment every ``log.align_every`` steps (rl/alignment.py), one process."""
        lg, r = self.cfg.log, self.cfg.rollout
        if not lg.align_every or self.iteration % lg.align_every or self.coll.enabled:
            return {}
        return training_row(self.model, self.tok, [s.prompt_ids for s in samples[::r.n]]
                            [:lg.align_prompts], min(16, r.max_tokens))

    def _predicted(self, ro: Rollout, seconds: dict, row: dict, waited: float | None) -> dict:
        """The planner's step time from the measured rates (observe/schedule.py)."""
        if self.predictor is None:
            return {}
        g = {k: seconds.get(k, 0.0) for k in ("rollout", "reward", "score", "train")}
        sync = row.get("time_sync_s", 0.0)
        lens, gen = [len(s.completion_ids) for s in ro.samples], ro.gen_tokens
        if self.pool is not None:  # (the whole step's, not this training rank's share)
            step_s, width = row["rollout_engine_step_s"], row["rollout_width"]
            gen_rate, front = row["rollout_tokens_per_s"], waited or 0.0
            lens, gen = self.pool.lens, self.pool.gen_tokens
        else:
            tl = ro.timeline
            step_s = sum(t for _, _, t in tl) / max(1, len(tl))
            width = sum(n for n, _, _ in tl) / max(1, len(tl))
            gen_rate = ro.gen_tokens / g["rollout"] if g["rollout"] > 0 else 0.0
            front = g["rollout"]
        other = row["time_step_s"] - front - g["reward"] - g["score"] - g["train"] - sync
        return self.predictor(
            lens, rollout_s=g["rollout"], engine_step_s=step_s, width=width,
            score_s=g["score"] + g["reward"], train_s=g["train"], sync_s=sync, other_s=other,
            gen_tokens=gen, gen_tok_s=gen_rate)

    def _hand_back(self) -> dict:
        """The rollout's transient (KV growth, sampling) goes back before training; on the
        host the memory probe already trims the heap at each phase, so once per step there."""
        if not self.cfg.train.hand_back_memory:
            return {}
        return {"memory_handed_back_bytes": hand_back(self.device)
                if self.device.type == "cuda" else 0}

    def _row(self, ro: Rollout, sc: StepScore, upd: Update, timer, t_step: float,
             waited: float | None, back: dict) -> dict:
        row = {"step": self.iteration, "watchdog": ro.watchdog, **ro.governor}
        if waited is not None:
            row["time_wait_rollout_s"] = waited
        row.update(back)
        row.update(self._pool_row)
        row.update(sc.metrics)
        if sc.batch is not None:
            row.update(sc.batch.metrics)
        row.update(upd.metrics)
        if back and sc.anything and self._probed:  # (a device's steps are all probed)
            row["memory_handed_back_bytes"] += hand_back(self.device)
        seconds = {**ro.seconds, **timer.seconds}
        row["policy_version"] = self.step_idx
        row.update(sample_metrics(ro.samples, ro.gen_tokens, ro.seconds))
        row.update(ro.env)  # multi-turn: turns, tool calls, waits, swapped KV, prefill
        self.last_trajectories = ro.trajectories
        row.update(phase_metrics(self.device, self.engine.pool.num_blocks, seconds, timer,
                                 self.mem))
        if sc.anything:
            step_s = time.perf_counter() - t_step
            row["time_step_s"] = step_s
            b = sc.batch
            row.update(self.flops(b.tokens if b else 0, b.scoring_passes if b else 0,
                                  b is not None, ro.timeline, seconds, ro.seconds, step_s,
                                  waited))
            row.update(self._predicted(ro, seconds, row, waited))
        row.update(self._alignment(ro.samples))
        if self.overlap is not None:
            self.overlap.trained(self.iteration + 1, self.step_idx)
            self._last_step_end = time.perf_counter()
        self.iteration += 1
        return row
