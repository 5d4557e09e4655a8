"""A rollout rank of separate pools: whole weights, one engine stream, orders in, samples out.

The leader (``pools.py``) sends *orders* (one step's share of prompts, with their sampling
seeds) and *weights* (a version, through ``distributed/weight_sync.py``); this rank adds
each order's prompts to its engine and sends each order's samples back as soon as the last
of them finishes, with every token's policy version and rollout logprob.

When headers are read decides the shape: ``separated`` and ``one_step`` read them only with
no order in flight (an order is sampled by one version), ``async`` between any two engine
steps, so a new version lands while long samples are still running; those continue on
their KV under the new weights or are cut and re-prefilled under them
(``schedule.partial``). Either way a token carries the version that sampled it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from orbitrl.distributed.channel import FINISH, ORDER, STOP, WEIGHTS, Channel
from orbitrl.distributed.roles import LEADER
from orbitrl.distributed.weight_sync import WeightSync, synced
from orbitrl.engine import Request, SamplingParams
from orbitrl.model.tokenizer import prompt_encoder
from orbitrl.rl.policy import build_policy, pick_device
from orbitrl.rl.rollout import build_engine
from orbitrl.rl.trainer import seed_everything
from orbitrl.rl.types import Sample


@dataclass
class _Order:
    step: int
    rows: list
    first: int
    prompts: list
    left: int  # samples still running
    samples: dict = field(default_factory=dict)  # (group, sample) -> Sample
    t0: float = field(default_factory=time.perf_counter)
    steps0: int = 0
    tokens0: int = 0


class RolloutWorker:
    """The loop of one rollout rank.

    Args:
        cfg: the run's Config.
        roles: this rank's ``distributed.roles.Roles``.
        policy: the policy built as the trainer builds it (whole weights on this rank).
        engine: its engine; ``encode``: prompt text -> token ids, as training encodes it.
    """

    def __init__(self, cfg, roles, policy, engine, encode):
        self.cfg, self.roles, self.engine, self.encode = cfg, roles, engine, encode
        self.model = policy.model
        s = cfg.schedule
        self.sync = WeightSync(synced(self.model), roles.sync_group, LEADER,
                               int(s.sync_bucket_mb * 2**20), s.sync_delta)
        self.ch: Channel = roles.channel
        self.version = -1
        self.orders: dict[int, _Order] = {}
        self.requests: dict[int, tuple[int, int]] = {}  # engine request -> (step, group)
        self.versions: dict[tuple, list[int]] = {}  # (request, sample) -> token versions
        self.next_req = 0
        self.between_steps = s.shape == "async"
        self.cut = s.partial == "cut"
        self.timeout_s = cfg.rollout.timeout_s  # the watchdog, per order (0: none)
        self.counters = {"cut_samples": 0, "syncs": 0, "sync_s": 0.0, "watchdog_events": 0,
                         "watchdog_dropped": 0}

    def run(self):
        """Until the leader says stop; then wait (beaten) for the end of the run."""
        self.engine.begin_stream()
        self.model.eval()
        while True:
            busy = bool(self.orders)
            if not busy:
                msg = self.ch.wait()
            elif self.between_steps:
                msg = self.ch.poll()
            else:
                self.ch.tick()
                msg = None
            if msg is not None:
                if self._handle(*msg):
                    break
                continue
            self._watchdog()
            self._step()
        self.ch.goodbye(LEADER)
        while self.ch.wait()[0][0] != FINISH:
            pass

    def _handle(self, hdr: tuple, order) -> bool:
        """One header from the leader (and its order); True on stop."""
        kind, a, b, c = hdr
        if kind == STOP:
            return True
        if kind == WEIGHTS:
            # the step in flight (async decode) ran on the weights it was launched with:
            # its tokens get the version before this one
            self._account(self.engine.reset_decode())
            st = self.sync.receive(a, b, c)
            self.version = a
            self.counters["syncs"] += 1
            self.counters["sync_s"] += st.seconds
            self.counters["cut_samples"] += self.engine.weights_changed(self.cut)
        elif kind == ORDER:
            self._add(order)
        else:
            raise RuntimeError(f"rollout rank {self.roles.rank}: unexpected header {hdr}")
        return False

    def _watchdog(self):
        """An order running past ``rollout.timeout_s`` drops its unfinished samples (their
        KV released) and goes to the leader with the groups that finished whole, as the
        colocated watchdog does; the other orders run on."""
        if not self.timeout_s:
            return
        now = time.perf_counter()
        late = [o for o in self.orders.values() if now - o.t0 > self.timeout_s]
        if not late:
            return
        # the step in flight first (async decode): the samples it finishes count, and an
        # order it completes goes to the leader as usual (not as a watchdog's)
        self._account(self.engine.reset_decode())
        for o in [o for o in late if o.step in self.orders]:
            reqs = {k for k, v in self.requests.items() if v[0] == o.step}
            dropped = self.engine.abort(lambda seq: seq.req_index in reqs)
            for seq in dropped:
                self.versions.pop((seq.req_index, seq.sample), None)
            n = self.cfg.rollout.n
            whole = {g for g in range(len(o.prompts))
                     if sum(1 for (gg, _) in o.samples if gg == g) == n}
            o.samples = {k: v for k, v in o.samples.items() if k[0] in whole}
            self.counters["watchdog_events"] += 1
            self.counters["watchdog_dropped"] += len(dropped)
            self._send(o, watchdog=1)

    def _add(self, order: dict):
        """Queue an order's prompts (n samples each, seeds as the colocated run draws them)."""
        r = self.cfg.rollout
        rows = order["rows"]
        prompts = [self.encode(x[self.cfg.data.prompt_field]) for x in rows]
        o = _Order(order["step"], rows, order["first"], prompts, len(rows) * r.n,
                   steps0=self.engine.stats["steps"],
                   tokens0=self.engine.stats["generated_tokens"])
        self.orders[o.step] = o
        seed = self.cfg.train.seed * 7919 + order["seed_index"]
        base = SamplingParams(n=r.n, max_tokens=r.max_tokens, temperature=r.temperature,
                              top_p=r.top_p, top_k=r.top_k)
        for g, p in enumerate(prompts):
            params = SamplingParams(**{**base.__dict__, "seed": seed * 100003 + o.first + g})
            out = self.engine.add_request(self.next_req, Request(prompt_ids=p), params)
            if out.error is not None:
                raise RuntimeError(f"rollout request {o.first + g}: {out.error}")
            self.requests[self.next_req] = (o.step, g)
            self.next_req += 1

    def _step(self):
        """One engine step; token versions; finished orders go to the leader."""
        eng = self.engine
        if eng.memory_hook is not None:
            eng.memory_hook(eng)
        t0 = time.perf_counter()
        done = eng.step()
        eng.stats["seconds"] += time.perf_counter() - t0
        self._account(done)

    def _account(self, done):
        """Label the tokens sampled since the last call with the current weight version;
        finished samples go to their orders."""
        for seq in self.engine.scheduler.running + done:
            vs = self.versions.setdefault((seq.req_index, seq.sample), [])
            vs.extend([self.version] * (seq.num_completion - len(vs)))
        for seq in done:
            self._finish(seq)

    def _finish(self, seq):
        step, g = self.requests[seq.req_index]
        o = self.orders[step]
        vs = self.versions.pop((seq.req_index, seq.sample))
        o.samples[(g, seq.sample)] = Sample(
            o.first + g, o.prompts[g], seq.completion_ids, list(seq.logprobs),
            seq.finish_reason, seq.text or "", o.rows[g], min(vs, default=self.version),
            token_versions=vs)
        o.left -= 1
        if o.left == 0:
            self._send(o)

    def _send(self, o: _Order, watchdog: int = 0):
        eng = self.engine
        samples = [o.samples[k] for k in sorted(o.samples)]
        for k in [k for k, v in self.requests.items() if v[0] == o.step]:
            del self.requests[k]
            eng._done.pop(k, None)  # (the engine keeps finished samples per request)
        del self.orders[o.step]
        eng.timeline.clear()
        self.ch.send_result(LEADER, {
            "step": o.step, "rank": self.roles.rank, "first": o.first, "samples": samples,
            "watchdog": watchdog,
            "gen_tokens": eng.stats["generated_tokens"] - o.tokens0,
            "engine_steps": eng.stats["steps"] - o.steps0,
            "seconds": time.perf_counter() - o.t0,
            "engine_seconds": eng.stats["seconds"], "engine_steps_total": eng.stats["steps"],
            "gen_tokens_total": eng.stats["generated_tokens"],
            "version": self.version, **self.counters})


def run_rollout_rank(cfg, roles, train_rows: list[dict]):
    """Build this rank's policy and engine and serve the leader until it says stop."""
    seed_everything(cfg.train.seed, cfg.train.deterministic)
    device = pick_device(cfg.model.device)
    policy = build_policy(cfg, device, reference=False)  # (it never scores)
    tok = policy.tokenizer

    encode = prompt_encoder(tok, cfg.data)
    prompt_len = max(len(encode(x[cfg.data.prompt_field])) for x in train_rows[:256])
    engine, _ = build_engine(cfg, policy.model, tok, None, device, prompt_len, 1)
    RolloutWorker(cfg, roles, policy, engine, encode).run()
