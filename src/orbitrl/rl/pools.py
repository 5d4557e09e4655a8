"""The leader's side of separate pools: orders out, samples in, weights back.

The leader (rank 0, a training rank) owns the data cursor. Before training step i it hands
out the prompts of every step up to ``i + ahead`` (an *order* per step, split over the
rollout ranks as colocated ranks split a batch, with the same sampling seeds), waits for
step i's samples, and after the update streams the new version to the rollout ranks.

``ahead`` is the data queue's bound: 0 separated (each pool waits for the other), 1
one_step, and for async ``rollout.queue_size`` capped by ``schedule.max_staleness`` under
``stale_policy: wait``, so no sample can be trained more than ``max_staleness`` versions
after its oldest token was sampled (it waits to start instead). Under ``drop`` the orders
run ``rollout.queue_size`` ahead and groups past the bound are dropped at training time,
counted in ``stale_dropped_groups``. Results that arrive early (another step's, another
rank's) wait in a dictionary bounded by ``ahead + 1`` steps: backpressure is that the
rollout ranks get no new prompts until training catches up.

A training pool of several ranks: the leader still alone talks to the rollout ranks; each
step's samples are split over the training ranks by prompt, as colocated ranks split a
batch (``Dist.share``), and each trains its share (the loss normalised over the global
batch, ``distributed/batch.py``). The other training ranks (:class:`PoolShare`) take their
share from the leader and join the gathers of each weight sync.
"""

from __future__ import annotations

import time

from orbitrl.distributed.channel import STOP, WEIGHTS, Channel
from orbitrl.distributed.roles import LEADER, Roles
from orbitrl.distributed.weight_sync import WeightSync, synced
from orbitrl.rl.types import Rollout


def steps_ahead(cfg) -> int:
    """How many steps beyond the one training the rollout ranks may be handed."""
    s = cfg.schedule
    if s.shape == "separated":
        return 0
    if s.shape == "one_step":
        return 1
    q = cfg.rollout.queue_size
    return min(q, s.max_staleness) if s.stale_policy == "wait" else q


class PoolRollouts:
    """Args:
        cfg: the run's Config; roles: this rank's Roles (the leader's).
        data: the run's DataCursor; model: the policy (its trainable tensors are synced).
    """

    def __init__(self, cfg, roles: Roles, data, model):
        self.cfg, self.roles, self.data = cfg, roles, data
        self.train = roles.train_dist  # the training pool (one rank: world 1)
        self.ch: Channel = roles.channel
        s = cfg.schedule
        self.ahead = steps_ahead(cfg)
        self.sync = WeightSync(synced(model), roles.sync_group, LEADER,
                               int(s.sync_bucket_mb * 2**20), s.sync_delta)
        self.issued: int | None = None  # the next step to hand out
        self.positions: dict[int, tuple] = {}  # step -> data position after its prompts
        self.results: dict[int, dict] = {}  # step -> {rollout rank: result}
        self.last: dict = {}  # the latest result's counters (rollout side)
        self.synced_version: int | None = None
        self.lens: list[int] = []  # the whole step's completion lengths (the predictor's)
        self.gen_tokens = 0  # and the tokens the rollout ranks generated for it

    # ---- weights ------------------------------------------------------------------------
    def push(self, version: int) -> dict:
        """Stream ``version`` to every rollout rank (a no-op if they have it)."""
        if version == self.synced_version:
            return {}

        def announce(kind: int, count: int):
            for r in self.roles.rollout_ranks:
                self.ch.send_header(r, WEIGHTS, version, kind, count)
        st = self.sync.send(version, announce)
        self.synced_version = version
        return st.metrics()

    # ---- samples ------------------------------------------------------------------------
    def _issue(self, upto: int):
        r, ranks = self.cfg.rollout, self.roles.rollout_ranks
        while self.issued <= min(upto, self.cfg.train.max_steps - 1):
            step = self.issued
            rows = self.data.draw(r.prompts_per_step)
            self.positions[step] = self.data.position()
            base, extra = divmod(len(rows), len(ranks))
            a = 0
            for i, rank in enumerate(ranks):
                b = a + base + (1 if i < extra else 0)
                self.ch.send_order(rank, {"step": step, "rows": rows[a:b], "first": a,
                                          "seed_index": step})
                a = b
            self.issued += 1

    def get(self, step: int, version: int) -> tuple[Rollout, float, dict]:
        """Step ``step``'s samples (every rollout rank's share, in prompt order; this
        training rank's share of them), the seconds training waited for them, and the
        row's pool columns."""
        ro, waited, row = self._gather(step, version)
        self.lens = [len(s.completion_ids) for s in ro.samples]
        self.gen_tokens = ro.gen_tokens
        if not self.train.enabled:
            return ro, waited, row
        return self.train.scatter_objects(self._split(ro, waited, row))

    def _split(self, ro: Rollout, waited: float, row: dict) -> list[tuple]:
        """Each training rank's (share, waited, row): its prompts' samples; the pool
        columns and the watchdog count on the leader's row only (the metrics row takes
        them from there), the generated tokens by completion length with the remainder on
        the leader's (so their sum, ``tokens_per_s``, is the rollout's)."""
        P, T = self.cfg.rollout.prompts_per_step, self.train.world
        out = []
        for r in range(T):
            a, b = self.train.share_of(P, r)
            mine = [s for s in ro.samples if a <= s.group < b]
            out.append(Rollout(mine, sum(len(s.completion_ids) for s in mine), 0, [], {},
                               ro.data_after, seconds=dict(ro.seconds)))
        lead = out[0]
        lead.gen_tokens = ro.gen_tokens - sum(x.gen_tokens for x in out[1:])
        lead.watchdog = ro.watchdog
        return [(x, waited, row if r == 0 else {}) for r, x in enumerate(out)]

    def _gather(self, step: int, version: int) -> tuple[Rollout, float, dict]:
        """Every rollout rank's samples of step ``step``, in prompt order."""
        if self.issued is None:
            self.issued = step
        self._issue(step + self.ahead)
        t0 = time.perf_counter()
        while len(self.results.get(step, {})) < len(self.roles.rollout_ranks):
            src, res = self.ch.recv_result()
            if res is None:
                raise RuntimeError(f"rollout rank {src} left before step {step}: connection "
                                   "closed")
            self.results.setdefault(res["step"], {})[src] = res
        waited = time.perf_counter() - t0
        parts = sorted(self.results.pop(step).values(), key=lambda p: p["first"])
        samples = [s for p in parts for s in p["samples"]]
        self.last = parts[-1]
        row = {"stale_dropped_groups": 0}
        if self.cfg.schedule.stale_policy == "drop":
            samples, row["stale_dropped_groups"] = self._drop_stale(samples, version)
        ro = Rollout(samples=samples, gen_tokens=sum(p["gen_tokens"] for p in parts),
                     watchdog=sum(p["watchdog"] for p in parts), timeline=[], governor={},
                     data_after=self.positions.pop(step),
                     seconds={"rollout": max(p["seconds"] for p in parts)})
        row.update(self._columns(parts, samples, version))
        return ro, waited, row

    def _drop_stale(self, samples, version: int) -> tuple[list, int]:
        k = self.cfg.schedule.max_staleness
        stale = {s.group for s in samples if version - s.policy_version > k}
        return [s for s in samples if s.group not in stale], len(stale)

    def _columns(self, parts, samples, version: int) -> dict:
        toks = [version - v for s in samples for v in (s.token_versions or [])]
        steps = sum(p["engine_steps_total"] for p in parts)
        secs = sum(p["engine_seconds"] for p in parts)
        toks_total = sum(p["gen_tokens_total"] for p in parts)
        return {"staleness_token_mean": sum(toks) / len(toks) if toks else 0.0,
                "rollout_cut_samples": sum(p["cut_samples"] for p in parts),
                "rollout_sync_s": max(p["sync_s"] for p in parts),
                "rollout_watchdog_dropped": sum(p["watchdog_dropped"] for p in parts),
                # the rollout ranks' engines over the run so far (one rank's rate)
                "rollout_engine_step_s": secs / steps if steps else 0.0,
                "rollout_width": toks_total / steps if steps else 0.0,
                "rollout_tokens_per_s": toks_total / secs if secs else 0.0,
                "queue_ahead": self.ahead,
                "queue_waiting_steps": len(self.results)}

    def stop(self):
        """Tell every rollout rank to stop, and take in what they still send (the orders
        handed out and not trained, when a run stops early) up to each one's goodbye."""
        for r in self.roles.rollout_ranks:
            self.ch.send_header(r, STOP)
        left = set(self.roles.rollout_ranks)
        while left:
            src, res = self.ch.recv_result()
            if res is None:
                left.discard(src)


class PoolShare:
    """A training rank other than the leader: its share of each step's samples from the
    leader (``PoolRollouts.get``), and its part of each weight sync's gathers."""

    def __init__(self, roles: Roles, model):
        self.train = roles.train_dist
        self.sync = WeightSync(synced(model), None, LEADER, 1)  # (gathers only: no group)
        self.synced_version: int | None = None

    def push(self, version: int) -> dict:
        if version != self.synced_version:  # as the leader decides
            self.sync.join()
            self.synced_version = version
        return {}

    def get(self, step: int, version: int) -> tuple[Rollout, float, dict]:
        return self.train.scatter_objects(None)

    def stop(self):
        pass
