"""Dynamic sampling's refill (DAPO): a step's flat groups are replaced by fresh prompts' groups.

A group whose rewards are all equal has zero advantage under GRPO / RLOO and only dilutes the
batch, so scoring drops it (``algo.dynamic_sampling``, score.py). Dropping alone shrinks the
batch; here, after the step's rollout is judged, each further round draws as many fresh
prompts as the batch lacks informative groups (counted over every rank), generates and judges
them exactly as the first round was, and appends them, until the batch holds
``rollout.prompts_per_step`` informative groups or ``algo.dynamic_sampling_rounds`` extra
rounds have run; the step then trains on what it kept. Drawing the shortfall, not a whole
batch, means no informative group is ever thrown away and the trained batch is never larger
than without dynamic sampling (the memory the planner priced).

Prompts come from the data cursor as the first round's do, and a round's prompts continue the
step's group indices and sampling seeds (``first``), so a step is the same at any world size,
after a stop request (the cursor goes back to the step's start) and after a resume. The
rounds share the step's watchdog limit (``rollout.timeout_s`` over the rollout phase: a spent
one starts no round), and the stop poll runs before every engine step of every round.

``Refill`` is given the rollouts, the judge and the informative count, never the trainer, so
the overlapped producer thread (overlap.py) runs it as the training thread does.
"""

from __future__ import annotations

import numbers
from dataclasses import replace

import torch

from orbitrl.rl.types import Rollout

# metric name endings averaged over samples when two rounds' metrics are merged (others are
# counts and add up, except maxima and the waiting-KV peaks)
MEAN_ENDINGS = ("_mean", "_frac", "_rate", "_ratio", "_per_turn")


class Refill:
    """The step's judged rollout, with dynamic sampling's refill rounds.

    Args:
        algo, rollout: the run's ``algo`` and ``rollout`` sections (``dynamic_sampling``,
            ``dynamic_sampling_rounds``; ``prompts_per_step``, ``timeout_s``).
        rollouts: the run's ``rl.rollout.Rollouts``.
        judge: ``Scorer.judge`` (a round's rewards, as the first round's).
        informative: ``Scorer.informative`` (a judged rollout -> this rank's groups whose
            rewards differ).
        coll: the Collective (the informative groups and the watchdog counted over ranks).
    """

    def __init__(self, algo, rollout, rollouts, judge, informative, coll):
        self.algo, self.rollout_cfg, self.rollouts, self.judge = algo, rollout, rollouts, judge
        self.informative, self.coll = informative, coll

    def __call__(self, seed_index: int, version: int, stop, stop_error: type, timer,
                 eval_mode: bool) -> Rollout:
        """As ``Rollouts.__call__`` (same arguments), judged; with dynamic sampling, every
        round's samples and ``refill``: extra rounds run, prompts drawn, informative groups
        (each over every rank)."""

        def draw(prompts=None, first=0, timeout_s=None) -> Rollout:
            return self.judge(self.rollouts(seed_index, version, stop, stop_error, timer,
                                            eval_mode, prompts, first, timeout_s), timer)

        ro = draw()
        algo, P = self.algo, self.rollout_cfg.prompts_per_step
        if not algo.dynamic_sampling:
            return ro
        drawn, rounds = P, 0
        while True:
            have, left = self._standing(ro, timer)
            if have >= P or rounds >= algo.dynamic_sampling_rounds or left == 0.0:
                break
            ro = merge(ro, draw(P - have, drawn, left))
            drawn, rounds = drawn + P - have, rounds + 1
        ro.refill = {"dynamic_sampling_rounds": rounds, "prompts_sampled": drawn,
                     "informative_groups": have}
        return ro

    def _standing(self, ro: Rollout, timer) -> tuple[int, float | None]:
        """(informative groups over every rank, the watchdog seconds this rank has left:
        None without a limit, 0.0 when any rank's is spent)."""
        limit = self.rollout_cfg.timeout_s
        left = limit - timer.seconds.get("rollout", 0.0) if limit else None
        t = torch.tensor([float(self.informative(ro)), float(left is not None and left <= 0)],
                         dtype=torch.float64)
        t = self.coll.all_sum(t)
        return int(t[0]), (0.0 if t[1] > 0 else left)


def merge(a: Rollout, b: Rollout) -> Rollout:
    """Two judged rounds of one step as one rollout: b's groups after a's, counts added,
    the later round's cursor position, governor state and (cumulative) phase seconds."""
    na, nb = len(a.samples), len(b.samples)
    keep_log = max(len(a.trajectories), len(b.trajectories))  # the step's first records
    return Rollout(samples=a.samples + b.samples, gen_tokens=a.gen_tokens + b.gen_tokens,
                   watchdog=a.watchdog + b.watchdog, timeline=a.timeline + b.timeline,
                   governor=b.governor, data_after=b.data_after,
                   rewards=merge_rewards(a.rewards, na, b.rewards, nb), seconds=b.seconds,
                   env=merge_metrics(a.env, na, b.env, nb),
                   trajectories=(a.trajectories + b.trajectories)[:keep_log])


def merge_rewards(a, na: int, b, nb: int):
    """Two rounds' ``RewardResult``s (na and nb samples) as one: b's indices after a's
    (None: a round with no samples on one process was not judged)."""
    if a is None or b is None:
        return a if b is None else b
    names = list(dict.fromkeys([*a.per_source, *b.per_source]))
    per_source = {k: list(a.per_source.get(k, [0.0] * na))
                  + list(b.per_source.get(k, [0.0] * nb)) for k in names}
    details = {k: list(a.details.get(k, [None] * na)) + list(b.details.get(k, [None] * nb))
               for k in dict.fromkeys([*a.details, *b.details])}
    errors = list(a.errors) + [replace(e, index=e.index + na) for e in b.errors]
    return replace(a, rewards=list(a.rewards) + list(b.rewards), per_source=per_source,
                   errors=errors, metrics=merge_metrics(a.metrics, na, b.metrics, nb),
                   details=details)


def merge_metrics(a: dict, na: int, b: dict, nb: int) -> dict:
    """Two rounds' metric columns over na and nb samples: means (``MEAN_ENDINGS``) weighted
    by samples, maxima and waiting-KV peaks (``*_max``, ``kv_wait_*``) the larger, counts
    and seconds added; a column only one round has is kept as it is."""
    out = {}
    for k in dict.fromkeys([*a, *b]):
        x, y = a.get(k), b.get(k)
        if not (isinstance(x, numbers.Real) and isinstance(y, numbers.Real)):
            out[k] = x if y is None else y
        elif k.endswith(MEAN_ENDINGS):
            out[k] = (x * na + y * nb) / (na + nb) if na + nb else x
        elif k.endswith("_max") or k.startswith("kv_wait_"):
            out[k] = max(x, y)
        else:
            out[k] = x + y
    return out
