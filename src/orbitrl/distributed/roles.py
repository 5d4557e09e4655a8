"""Roles over ranks (``schedule.shape`` other than colocated): the last
``schedule.rollout_ranks`` ranks run the engine, the others train.

Rank 0 is always a training rank and the *leader*: it owns the data cursor and the
checkpoints, hands prompts out to the rollout ranks, receives their samples and streams the
weights back to them (``channel.py``, ``weight_sync.py``). The training ranks form their own
process group, so the trainer's collectives (FSDP2, reductions) never wait on a rollout
rank; the weights travel over a second group of the leader and the rollout ranks. A
training pool of several ranks shards the policy over its own group (FSDP2 on a device mesh
of the training ranks only) and reduces gradients, metrics and checkpoints there; the leader
alone talks to the rollout ranks and splits each step's samples over the training ranks
(``rl/pools.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch

from orbitrl.distributed.channel import FINISH, Channel
from orbitrl.distributed.env import Dist
from orbitrl.errors import OrbitError

LEADER = 0


@dataclass
class Roles:
    """This process's role and the groups it needs.

    ``train_dist``: the training pool as a :class:`Dist` over its own group (one process:
    ``world == 1``; a rollout rank's is unused);
    ``sync_group``: the leader and the rollout ranks (weight broadcasts, the run's backend);
    ``ctrl_group``: every rank over gloo (orders and samples, ``channel.py``);
    ``channel``: this rank's end of it, beating from the start (``channel.py``)."""
    shape: str
    rank: int
    world: int
    rollout_ranks: list[int]
    train_ranks: list[int]
    timeout_s: float
    train_dist: Dist = field(default_factory=Dist)
    sync_group: object = None
    ctrl_group: object = None
    channel: object = None

    @property
    def is_rollout(self) -> bool:
        return self.rank in self.rollout_ranks

    @property
    def is_leader(self) -> bool:
        return self.rank == LEADER

    def start(self):
        """Open this rank's channel: the leader beats to the rollout ranks, a rollout rank
        listens to the leader and beats back (so either may sit idle for longer than
        ``dist.timeout_s`` while the other builds, evaluates or checkpoints)."""
        self.channel = Channel(self.ctrl_group, self.timeout_s)
        if self.is_leader:
            self.channel.beat_to(self.rollout_ranks)
        elif self.is_rollout:
            self.channel.listen(LEADER)
            self.channel.beat_back(LEADER)

    def finish(self):
        """Leader, at the very end of the run: the rollout ranks may leave (they waited,
        beaten, through the held-out evaluation and the final checkpoint)."""
        if self.is_leader and self.channel is not None:
            self.channel.close()
            for r in self.rollout_ranks:
                self.channel.send_header(r, FINISH)


def check_schedule(cfg, world: int):
    """Shapes refused before anything loads (one-line errors naming the key)."""
    s = cfg.schedule
    if s.shape == "colocated":
        return
    if world < 2:
        raise OrbitError(f"config key 'schedule.shape': {s.shape} needs at least 2 ranks "
                         "(launch with torchrun --nproc_per_node N)")
    if s.rollout_ranks >= world:
        raise OrbitError(f"config key 'schedule.rollout_ranks': {s.rollout_ranks} leaves no "
                         f"training rank among {world}")
    if cfg.rollout.overlap:
        raise OrbitError("config key 'rollout.overlap': the in-process overlap is for "
                         "schedule.shape colocated (one_step is its form across ranks)")
    if cfg.train.tiers:
        raise OrbitError("config key 'train.tiers': one process only")


def assign_roles(cfg, dist: Dist) -> Roles | None:
    """This rank's role (None: colocated, every rank does everything). Every rank calls it
    (creating a process group is a collective)."""
    check_schedule(cfg, dist.world)
    if cfg.schedule.shape == "colocated":
        return None
    R = cfg.schedule.rollout_ranks
    train = list(range(dist.world - R))
    rollout = list(range(dist.world - R, dist.world))
    wait = timedelta(seconds=dist.timeout_s)  # (a group's own; the default's is not inherited)
    sync = torch.distributed.new_group([LEADER] + rollout, timeout=wait)
    ctrl = torch.distributed.new_group(list(range(dist.world)), backend="gloo", timeout=wait)
    train_dist = Dist(timeout_s=dist.timeout_s)  # one training rank: no group
    if len(train) > 1:
        group = torch.distributed.new_group(train, timeout=wait)  # the run's backend
        if dist.rank in train:
            train_dist = Dist(dist.rank, len(train), dist.local_rank, dist.backend,
                              dist.timeout_s, group)
    roles = Roles(cfg.schedule.shape, dist.rank, dist.world, rollout, train,
                  dist.timeout_s, train_dist, sync, ctrl)
    roles.start()
    return roles
