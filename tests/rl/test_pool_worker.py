"""A rollout rank's loop without the other ranks: its watchdog (``rollout.timeout_s``)
drops a late order's unfinished samples and sends the groups that finished whole, while
the other orders run on; and it never builds full mode's int8 reference."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from orbitrl.config import load_config
from orbitrl.rl.policy import build_policy
from orbitrl.rl.pool_worker import RolloutWorker
from orbitrl.rl.rollout import build_engine


class _Sent:
    def __init__(self):
        self.results = []

    def send_result(self, dst, obj):
        self.results.append(obj)

    def tick(self):
        pass


def _worker(mode: str, timeout_s: float, max_tokens: int = 40):
    cfg = load_config(overrides=["schedule.shape=async", f"train.mode={mode}",
                                 "model.base_dtype=fp32", "rollout.n=2",
                                 f"rollout.max_tokens={max_tokens}", "rollout.kv_budget_mb=4",
                                 f"rollout.timeout_s={timeout_s}", "rollout.temperature=1.5"])
    torch.manual_seed(0)
    policy = build_policy(cfg, torch.device("cpu"), reference=False)
    engine, _ = build_engine(cfg, policy.model, policy.tokenizer, None, torch.device("cpu"),
                             32, 1)
    roles = SimpleNamespace(rank=1, sync_group=None, channel=_Sent())
    w = RolloutWorker(cfg, roles, policy, engine,
                      lambda text: policy.tokenizer.encode(text))
    return w, policy


def test_watchdog_sends_whole_groups_and_keeps_other_orders():
    w, _ = _worker("adapter", 1e-9)
    w.engine.begin_stream()
    rows = [{"prompt": f"{a} + {a} =", "answer": str(2 * a)} for a in range(3)]
    w._add({"step": 0, "rows": rows, "first": 0, "seed_index": 0})
    w.timeout_s = 0  # the first order starts with the watchdog off ...
    w._step()
    w.timeout_s = 1e-9  # ... then is late: the next check drops what still runs
    w.orders[0].t0 -= 1.0
    w._add({"step": 1, "rows": rows[:1], "first": 0, "seed_index": 1})
    w.orders[1].t0 += 3600  # not late
    w._watchdog()
    (res,) = w.ch.results
    assert res["step"] == 0 and res["watchdog"] == 1
    groups = {}
    for s in res["samples"]:
        groups.setdefault(s.group, []).append(s)
    assert all(len(v) == 2 for v in groups.values())  # only whole groups go
    assert w.counters["watchdog_events"] == 1 and w.counters["watchdog_dropped"] > 0
    assert 0 not in w.orders and 1 in w.orders  # the other order runs on
    assert all(w.requests[s.req_index][0] == 1
               for s in w.engine.scheduler.running + w.engine.scheduler.waiting)
    while 1 in w.orders:
        w._step()
    assert [r["step"] for r in w.ch.results] == [0, 1] and w.ch.results[1]["watchdog"] == 0


def test_watchdog_reads_the_step_in_flight_first():
    """With the engine's async decode (the CUDA default, forced here on a CPU), a late
    order whose last samples the step in flight finishes is sent once, as finished (not
    as the watchdog's)."""
    for seed in range(10):
        w, _ = _worker("adapter", 0, max_tokens=6)
        eng = w.engine
        eng.static_decode = eng.async_decode = True
        eng.begin_stream()
        w._add({"step": 0, "rows": [{"prompt": "1+1=", "answer": "2"}], "first": 0,
                "seed_index": seed})
        while 0 in w.orders:
            w._step()
            st = eng.decode
            n = st.n
            if 0 in w.orders and eng._flight is not None and n and \
                    (st.pos_h[:n] > st.last_h[:n]).all():
                break  # every running sample ends at the step in flight
        else:
            continue
        w.timeout_s = 1e-9
        w.orders[0].t0 -= 1.0
        w._watchdog()
        assert [(r["step"], r["watchdog"]) for r in w.ch.results] == [(0, 0)]
        assert len(w.ch.results[0]["samples"]) == 2 and not w.orders
        assert eng.pool.num_free == eng.pool.num_blocks
        return
    raise AssertionError("no seed left the last samples in flight")


def test_rollout_rank_builds_no_reference():
    _, policy = _worker("full", 0)
    assert policy.reference is None
