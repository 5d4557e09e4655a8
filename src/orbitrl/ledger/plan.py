"""The planner: does a run fit, on how few devices, with which layout, and what to turn if not.

:func:`make_plan` prices one configuration (memory by phase and role, bytes moved, step time
of the four schedule shapes) and :func:`plan` adds the search: tensor-parallel degree when not
given, the fewest devices that fit, and the first knob that makes a non-fitting run fit.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from orbitrl.ledger.bandwidth import Links
from orbitrl.ledger.bill import PHASES, RoleOptions, phase_terms, role_totals
from orbitrl.ledger.execution import execution_plan
from orbitrl.ledger.memory import Strategy, Workload, state_bytes
from orbitrl.ledger.models import ModelShape
from orbitrl.ledger.timing import step_timing

GB = 1e9


@dataclass(frozen=True)
class Cluster:
    """Devices and their memory, in bytes.

    Args:
        devices: accelerators in the pool.
        device_memory: bytes per device; max_utilisation: the share the plan may use
            (the rest is allocator slack and fragmentation; keep under 90%).
        host_memory: bytes of host RAM per node (0: twice the node's device memory).
        devices_per_node: devices sharing one host (and the tensor-parallel domain).
    """

    devices: int
    device_memory: float
    host_memory: float = 0.0
    devices_per_node: int = 8
    max_utilisation: float = 0.9
    links: Links = field(default_factory=Links)

    @property
    def node_devices(self) -> int:
        return min(self.devices, self.devices_per_node)

    @property
    def host_per_node(self) -> float:
        return self.host_memory or 2 * self.device_memory * self.node_devices

    @property
    def usable(self) -> float:
        return self.device_memory * self.max_utilisation


@dataclass(frozen=True)
class Options:
    """Layout and schedule knobs (``tp=None``: the planner picks the smallest that fits)."""

    roles: RoleOptions = field(default_factory=RoleOptions)
    tp: int | None = None
    prefetch_depth: int = 2
    tail_fraction: float = 0.5
    staleness: int = 2
    sync: str = "auto"  # full | adapter | changed | auto
    changed_fraction: float = 0.1


@dataclass
class Plan:
    """One priced configuration; ``to_dict`` is the ``--json`` document."""

    model: ModelShape
    strategy: Strategy
    workload: Workload
    cluster: Cluster
    options: Options
    tp: int
    fits: bool
    per_device_bytes: int
    phases: dict
    host_per_node_bytes: int
    roles: dict
    execution: list
    timing: dict
    min_devices: int | None = None
    proposal: dict | None = None

    def to_dict(self) -> dict:
        m = self.model
        return {
            "fits": self.fits,
            "per_device_bytes": self.per_device_bytes,
            "min_devices": self.min_devices,
            "device_memory_bytes": int(self.cluster.device_memory),
            "usable_bytes_per_device": int(self.cluster.usable),
            "free_bytes_per_device": int(self.cluster.device_memory - self.per_device_bytes),
            "host_per_node_bytes": self.host_per_node_bytes,
            "host_memory_per_node": int(self.cluster.host_per_node),
            "devices": self.cluster.devices,
            "tp": self.tp,
            "model": {"name": m.name, "params": m.total_params, "active_params": m.active_params,
                      "layers": m.num_layers, "hidden": m.hidden, "experts": m.num_experts,
                      "layer_params": m.layer_params,
                      "adapter_params": m.adapter_params(self.strategy.adapter_rank)},
            "strategy": asdict(self.strategy),
            "workload": asdict(self.workload),
            "state_bytes": state_bytes(m, self.strategy).as_dict(),
            "roles": self.roles,
            "phases": {p: {"total": sum(t.values()), "terms": t} for p, t in self.phases.items()},
            "execution": self.execution,
            "bandwidth": self.timing["bandwidth"],
            "schedule": {k: v for k, v in self.timing.items() if k != "bandwidth"},
            "proposal": self.proposal,
        }


def make_plan(shape: ModelShape, strategy: Strategy, work: Workload, cluster: Cluster,
              options: Options, tp: int, with_timing: bool = True) -> Plan:
    """Price one configuration at a fixed tensor-parallel degree (no search).

    ``with_timing=False`` skips the bandwidth and schedule ledgers (the searches need memory only).
    """
    n = cluster.devices
    terms = phase_terms(shape, strategy, work, devices=n, prefetch_depth=options.prefetch_depth,
                        tp=tp, roles=options.roles, with_host=True)
    per_device = max(sum(terms[p].values()) for p in PHASES)
    host_node = sum(terms["host"].values()) * cluster.node_devices
    fits = per_device <= cluster.usable and host_node <= cluster.host_per_node
    return Plan(model=shape, strategy=strategy, workload=work, cluster=cluster, options=options,
                tp=tp, fits=fits, per_device_bytes=per_device, phases=terms,
                host_per_node_bytes=int(host_node), roles=role_totals(terms),
                execution=execution_plan(shape, strategy, options.roles, n, tp),
                timing=step_timing(shape, strategy, work, cluster.links, options, n, tp)
                if with_timing else {"bandwidth": None})


def tp_candidates(shape: ModelShape, cluster: Cluster) -> list[int]:
    """Tensor-parallel degrees inside one node that divide the devices and the kv heads."""
    out = [t for t in (1, 2, 4, 8, 16) if t <= cluster.node_devices and cluster.devices % t == 0
           and shape.num_heads % t == 0]
    return out or [1]


def fit(shape, strategy, work, cluster, options, with_timing: bool = False) -> Plan:
    """The given tp, or the smallest that fits (else the one with the lowest peak)."""
    tps = [options.tp] if options.tp else tp_candidates(shape, cluster)
    plans = [make_plan(shape, strategy, work, cluster, options, t, False) for t in tps]
    fitting = [p for p in plans if p.fits]
    best = fitting[0] if fitting else min(plans, key=lambda p: p.per_device_bytes)
    return make_plan(shape, strategy, work, cluster, options, best.tp) if with_timing else best


def min_devices(shape, strategy, work, cluster, options, limit: int = 10_000_000) -> int | None:
    """Fewest devices of this memory that fit (per-device bytes fall as devices grow)."""
    def ok(n: int) -> bool:
        return fit(shape, strategy, work, replace(cluster, devices=n), options).fits
    hi = 1
    while not ok(hi):
        hi *= 2
        if hi > limit:
            return None
    lo = hi // 2
    while hi - lo > 1:  # ok(hi) holds, ok(lo) does not (or lo == 0)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def _knobs(strategy: Strategy, work: Workload, options: Options):
    """Candidate changes, cheapest first: (flag to turn, strategy, workload, options)."""
    if not work.recompute:
        yield "--recompute on", strategy, replace(work, recompute=True), options
    if work.kv_dtype not in ("fp8", "int8"):
        yield "--kv-dtype fp8", strategy, replace(work, kv_dtype="fp8"), options
    for div in (2, 4, 8):
        if work.rollout_seqs // div >= 1:
            yield (f"--rollout-seqs {work.rollout_seqs // div}", strategy,
                   replace(work, rollout_seqs=work.rollout_seqs // div), options)
    if work.micro_batch > 1:
        yield "--micro-batch 1", strategy, replace(work, micro_batch=1), options
    if options.prefetch_depth > 1:
        yield "--prefetch-depth 1", strategy, work, replace(options, prefetch_depth=1)
    r = options.roles
    if strategy.kind in ("adamw", "adapter") and r.offload < 1:
        yield "--offload optimizer", strategy, work, replace(options, roles=replace(r, offload=1))
    if strategy.kind == "adamw":
        yield "--strategy stateless", replace(strategy, kind="stateless"), work, options
    for base in ("bf16", "int8", "int4"):
        if strategy.kind != "adapter" or base != strategy.base_dtype:
            yield (f"--strategy adapter --base-dtype {base}",
                   replace(strategy, kind="adapter", base_dtype=base), work, options)
    yield "--offload weights", strategy, work, replace(options, roles=replace(r, offload=2))


def propose(shape, strategy, work, cluster, options) -> dict:
    """The first single knob that makes the run fit on these devices, else more devices."""
    for flag, s, w, o in _knobs(strategy, work, options):
        p = fit(shape, s, w, cluster, o)
        if p.fits:
            return {"knob": flag, "per_device_bytes": p.per_device_bytes, "fits": True,
                    "message": f"turn {flag}: peak {p.per_device_bytes / GB:.1f} GB per device"}
    n = min_devices(shape, strategy, work, cluster, options)
    if n is not None:
        return {"knob": f"--devices {n}", "per_device_bytes": None, "fits": True,
                "message": f"no single knob fits {cluster.devices} devices; {n} devices fit as given"}
    return {"knob": None, "per_device_bytes": None, "fits": False,
            "message": "nothing fits: the per-device terms that do not shrink with more devices "
                       "(gathered layers, activations, logits) exceed the device; lower "
                       "--micro-batch/--seq lengths, raise --tp or use bigger devices"}


def plan(shape: ModelShape, strategy: Strategy, work: Workload, cluster: Cluster,
         options: Options | None = None) -> Plan:
    """The full answer: a priced plan, its minimum device count and, if it does not fit, a fix."""
    options = options or Options()
    p = fit(shape, strategy, work, cluster, options, with_timing=True)
    p.min_devices = min_devices(shape, strategy, work, cluster, options)
    if not p.fits:
        p.proposal = propose(shape, strategy, work, cluster, options)
    return p


def model_state_devices(total_bytes: float, device_memory: float) -> int:
    """Devices needed to hold ``total_bytes`` of model state alone (16 TB / 80 GB = 200)."""
    return math.ceil(total_bytes / device_memory - 1e-9)
