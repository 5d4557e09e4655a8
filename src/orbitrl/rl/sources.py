"""Rollout sources: where a step's judged batch comes from, behind one interface.

A source gives the trainer each step's ``Rollout`` (generated, judged) and hears about each
new policy version; the trainer names none of them. :func:`rollout_source` picks one at
setup from the config:

- :class:`Colocated` (the default): the step generates its own batch on the training
  process's engine (``refill.py``: dynamic sampling's extra rounds included), then trains.
- :class:`OneStepOverlap` (``rollout.overlap``): a producer thread generates step k+1's
  batch beside step k's training (``overlap.py``), one step off-policy.
- :class:`SeparatePools` (``schedule.shape`` other than colocated, under torchrun with
  rollout ranks): the rollout ranks generate, the training leader judges what arrives and
  sends each new version back (``pools.py``); the training pool's other ranks take their
  share from the leader.

Interface (``RolloutSource``): ``next_batch(step) -> (Rollout, waited, t_step)``;
``published(version) -> dict`` after an applied update; ``trained(iteration, version)`` once
the step's row is written; ``position()`` (where an abandoned step rewinds the data to, or
None when the source cannot rewind); ``rates(...)`` the rollout's side of the step-time
prediction; ``close()``.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass

from orbitrl.errors import OrbitError
from orbitrl.observe.schedule import StepPredictor
from orbitrl.rl.types import Rollout, StepAbandoned


@dataclass
class StepClock:
    """What a source needs of the step in flight: its counters, its timer, when it began and
    the stop poll."""
    step_idx: int
    iteration: int
    timer: object
    t_step: float
    stop: object


def check_modes(cfg, coll):
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
    d = cfg.data
    chat = "data.system_prompt" if d.system_prompt else \
        "data.enable_thinking" if d.enable_thinking != "auto" else None
    if chat and cfg.env.name:
        raise OrbitError(f"config key '{chat}': not applied to multi-turn environments yet "
                         f"(env.name {cfg.env.name!r} renders its own turns)")
    if chat and not d.chat_template:
        raise OrbitError(f"config key '{chat}': needs data.chat_template: true (raw prompts "
                         "have no turns)")


class RolloutSource(abc.ABC):
    """The colocated defaults every source shares (see the module doc)."""

    # a stop request may abandon the step in flight (its prompts come again): only where
    # the step draws its own batch on one process
    abandonable = False
    resume_snapshots: dict | None = None  # the overlap's adapter snapshots, from a checkpoint

    def __init__(self, data):
        self.data = data

    def pending_snapshots(self) -> dict:
        """Adapter snapshots the rollouts ahead of training still sample from (checkpoints
        keep them)."""
        return {}

    @abc.abstractmethod
    def next_batch(self, clock: StepClock) -> tuple[Rollout, float | None, float]:
        """The step's judged batch, the seconds training waited for it (None: it did not
        wait) and when the step began."""

    def position(self):
        return None

    def published(self, version: int) -> dict:
        return {}

    def trained(self, iteration: int, version: int):
        pass

    def row(self) -> dict:
        """The source's own columns of the step's metrics row."""
        return {}

    def predictor(self, cfg, slots: int, world: int, prompt_len: int):
        return None

    def rates(self, ro: Rollout, seconds: dict, row: dict, waited):
        """(completion lengths, generated tokens, engine step seconds, batch width,
        tokens/s, seconds the rollout kept training waiting) for the step-time prediction."""
        tl = ro.timeline
        step_s = sum(t for _, t, _ in tl) / max(1, len(tl))
        width = sum(n for n, _, _ in tl) / max(1, len(tl))
        r = seconds.get("rollout", 0.0)
        return ([len(s.completion_ids) for s in ro.samples], ro.gen_tokens, step_s, width,
                ro.gen_tokens / r if r > 0 else 0.0, r)

    def close(self):
        pass


class Colocated(RolloutSource):
    """The step generates its batch on this process's engine, then trains on it."""

    def __init__(self, data, refill, distributed: bool):
        super().__init__(data)
        self.refill = refill
        self.abandonable = not distributed  # (ranks stop together, at step boundaries)

    def next_batch(self, clock: StepClock):
        return self.refill(clock.step_idx, clock.step_idx, clock.stop, StepAbandoned,
                           clock.timer, eval_mode=True), None, clock.t_step

    def position(self):
        return self.data.position()

    def predictor(self, cfg, slots: int, world: int, prompt_len: int):
        # each rank generates and trains its share: one device each
        return StepPredictor("colocated", 1, 1, 1, slots, world, world, prompt_len=prompt_len)


class OneStepOverlap(RolloutSource):
    """``rollout.overlap``: the producer thread's batch, made beside the previous step's
    training (started at the first step; the step begins when the previous one ended)."""

    def __init__(self, data, refill, model, device, max_steps: int, queue_size: int):
        super().__init__(data)
        self.refill, self.model, self.device = refill, model, device
        self.max_steps, self.queue_size = max_steps, queue_size
        self.overlap = None
        self.last_end: float | None = None

    def pending_snapshots(self) -> dict:
        return self.overlap.pending_snapshots() if self.overlap is not None else {}

    def next_batch(self, clock: StepClock):
        if self.overlap is None:
            from orbitrl.rl.overlap import Overlap, producer  # (its thread: overlap only)

            self.overlap = Overlap(producer(self.refill, self.device), self.model,
                                   self.max_steps, self.queue_size,
                                   clock.iteration, clock.step_idx, self.resume_snapshots)
        ro, waited = self.overlap.get(clock.iteration)
        self.data.trained(ro.data_after)
        return ro, waited, self.last_end or clock.t_step

    def trained(self, iteration: int, version: int):
        if self.overlap is not None:
            self.overlap.trained(iteration, version)
        self.last_end = time.perf_counter()

    def close(self):
        if self.overlap is not None:
            self.overlap.stop()


class SeparatePools(RolloutSource):
    """Separate pools: the rollout ranks' samples, judged here by the training leader (the
    training pool's other ranks take the leader's share); each new version goes back."""

    def __init__(self, data, cfg, roles, model, judge):
        super().__init__(data)
        from orbitrl.rl.pools import PoolRollouts, PoolShare  # (torchrun pools only)

        self.cfg, self.roles, self.judge = cfg, roles, judge
        self.pool = (PoolRollouts(cfg, roles, data, model) if roles.is_leader
                     else PoolShare(roles, model))
        self._row: dict = {}

    def next_batch(self, clock: StepClock):
        """The step's samples from the rollout ranks (the first call sends them the
        weights), judged here."""
        self._row = self.pool.push(clock.step_idx)
        ro, waited, row = self.pool.get(clock.iteration, clock.step_idx)
        self._row.update(row)
        self.data.trained(ro.data_after)
        generated = ro.seconds
        ro = self.judge(ro, clock.timer)
        ro.seconds = {**generated, **ro.seconds}
        return ro, waited, clock.t_step

    def published(self, version: int) -> dict:
        return self.pool.push(version)

    def row(self) -> dict:
        return self._row

    def predictor(self, cfg, slots: int, world: int, prompt_len: int):
        if not self.roles.is_leader:  # the leader predicts the whole step
            return None
        from orbitrl.rl.pools import steps_ahead  # (torchrun pools only)

        s, r = cfg.schedule, self.roles
        return StepPredictor(s.shape, r.world, len(r.rollout_ranks), steps_ahead(cfg),
                             slots, r.world, len(r.train_ranks),
                             "reprefill" if s.partial == "cut" else "keep_kv",
                             s.stale_policy, prompt_len)

    def rates(self, ro: Rollout, seconds: dict, row: dict, waited):
        # (the whole step's, not this training rank's share)
        return (self.pool.lens, self.pool.gen_tokens, row["rollout_engine_step_s"],
                row["rollout_width"], row["rollout_tokens_per_s"], waited or 0.0)

    def close(self):
        if self.pool is not None:
            self.pool.stop()
            self.pool = None


def rollout_source(cfg, roles, data, refill, model, device, judge, coll) -> RolloutSource:
    """The run's source, chosen once: separate pools when ``roles`` is given, the one-step
    overlap with ``rollout.overlap``, else colocated."""
    if roles is not None:
        return SeparatePools(data, cfg, roles, model, judge)
    if cfg.rollout.overlap:
        return OneStepOverlap(data, refill, model, device, cfg.train.max_steps,
                              cfg.rollout.queue_size)
    return Colocated(data, refill, coll.enabled)
