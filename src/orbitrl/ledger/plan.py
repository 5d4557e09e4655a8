"""The planner: does a run fit, on how few devices, with which layout, and what to turn if not.

:func:`make_plan` prices one configuration (memory by phase and role, bytes moved, step time
of the four schedule shapes) and :func:`plan` adds the search: tensor-parallel degree when not
given, whether an adapter's frozen base is replicated per tp group or sharded, the micro
batch when left to auto, the fewest devices that fit, and the first knob that makes a
non-fitting run fit.

Rollout KV is elastic unless the workload fixes ``rollout_seqs`` (the runtime sizes the
engine's pool from the memory training leaves, and sampling throttles or preempts when blocks
run out): a run fits when every other term plus a reserve of ``min_rollout_seqs`` max-length
sequences per device fits under ``max_utilisation``; the pool then takes what the rollout
phase leaves, up to what the step can use (``samples_per_step`` sequences at once), and the
peak is reported with the pool at that size.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from orbitrl.ledger.bandwidth import Links
from orbitrl.ledger.bill import PHASES, RoleOptions, phase_terms, role_totals
from orbitrl.ledger.execution import execution_plan
from orbitrl.ledger.memory import Strategy, Workload, kv_block_bytes, state_bytes
from orbitrl.ledger.models import ModelShape
from orbitrl.ledger.timing import auto_micro_batch, bandwidth_bill, step_timing

BASE_LAYOUTS = ("auto", "replicated", "sharded")

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
    """Layout and schedule knobs (``tp=None``: the planner picks the layout, see :func:`fit`).

    ``base_layout`` (adapter strategy): ``replicated`` holds the frozen base whole in every
    tp group (no gathers), ``sharded`` spreads it over all devices (per-layer gathers),
    ``auto`` replicates when that fits.
    """

    roles: RoleOptions = field(default_factory=RoleOptions)
    tp: int | None = None
    prefetch_depth: int = 2
    tail_fraction: float = 0.5
    staleness: int = 2
    sync: str = "auto"  # full | adapter | changed | auto
    changed_fraction: float | None = None  # None: the model's (ModelShape.changed_fraction)
    base_layout: str = "auto"

    def __post_init__(self):
        if self.base_layout not in BASE_LAYOUTS:
            raise ValueError(f"unknown base_layout {self.base_layout!r}; one of {', '.join(BASE_LAYOUTS)}")


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
    kv_pool: dict = field(default_factory=dict)
    static_per_device_bytes: int = 0
    replicated: bool = False
    micro_batch_auto: bool = False
    min_devices: int | None = None
    proposal: Proposal | None = None  # (set by plan() when it does not fit)

    def to_dict(self) -> dict:
        m = self.model
        return {
            "fits": self.fits,
            "per_device_bytes": self.per_device_bytes,
            "min_devices": self.min_devices,
            "device_memory_bytes": int(self.cluster.device_memory),
            "usable_bytes_per_device": int(self.cluster.usable),
            "free_bytes_per_device": int(self.cluster.device_memory - self.per_device_bytes),
            "static_per_device_bytes": self.static_per_device_bytes,
            "static_total_bytes": self.static_per_device_bytes * self.cluster.devices,
            "cluster_memory_bytes": int(self.cluster.device_memory * self.cluster.devices),
            "host_per_node_bytes": self.host_per_node_bytes,
            "host_memory_per_node": int(self.cluster.host_per_node),
            "devices": self.cluster.devices,
            "tp": self.tp,
            "dp": max(1, self.cluster.devices // self.tp),
            "layout": self.layout(),
            "micro_batch": {"sequences": self.workload.micro, "tokens": self.workload.micro
                            * self.workload.seq_len, "auto": self.micro_batch_auto},
            "kv_pool": self.kv_pool,
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
        }

    def layout(self) -> dict:
        """How the policy's weights sit on the devices, in words and flags."""
        dp = max(1, self.cluster.devices // self.tp)
        if self.options.roles.offload >= 2:
            weights, text = "host", "weights on the host, cold layers prefetched per layer"
        elif self.replicated:
            weights = "replicated"
            text = (f"frozen base replicated: a whole copy per tp group of {self.tp} devices "
                    f"({dp} cop{'y' if dp == 1 else 'ies'}), never gathered")
        elif dp == 1:
            weights, text = "tp-resident", f"weights tp-sharded over {self.tp} devices, resident"
        else:
            weights = "sharded"
            text = f"weights sharded over {self.cluster.devices} devices, gathered layer by layer"
        return {"weights": weights, "description": text}


def kv_pool(shape: ModelShape, work: Workload, devices: int, blocks: int, elastic: bool) -> dict:
    """The rollout KV pool of ``blocks`` whole blocks (summed over the cluster), described."""
    block = kv_block_bytes(shape, work.kv_dtype, work.block_size)
    per_seq = work.blocks_per_seq
    seqs = blocks // per_seq
    return {"mode": "elastic" if elastic else "fixed", "blocks": blocks,
            "block_tokens": work.block_size, "block_bytes": block, "blocks_per_seq": per_seq,
            "seq_len": work.seq_len, "bytes_per_device": int(math.ceil(blocks * block / devices)),
            "concurrent_seqs": seqs, "seqs_per_device": seqs / devices,
            "need_seqs": work.kv_need_seqs(), "reserve_seqs": work.kv_reserve_seqs(devices)}


def _peak(terms: dict) -> int:
    return max(sum(terms[p].values()) for p in PHASES)


def _static(terms: dict) -> int:
    """The peak of every term but the rollout KV pool."""
    return max(sum(b for k, b in terms[p].items() if not k.startswith("rollout_kv:"))
               for p in PHASES)


def make_plan(shape: ModelShape, strategy: Strategy, work: Workload, cluster: Cluster,
              options: Options, tp: int, with_timing: bool = True, replicated: bool = False,
              micro_batch_auto: bool = False) -> Plan:
    """Price one configuration at a fixed tensor-parallel degree and base layout (no search).

    Fits when the terms with the KV reserve fit (see the module doc); an elastic pool is then
    grown to what the rollout phase leaves, up to what the step needs.
    ``with_timing=False`` skips the bandwidth and schedule ledgers (the searches need memory only).
    """
    n = cluster.devices
    kw = dict(devices=n, prefetch_depth=options.prefetch_depth, tp=tp, roles=options.roles,
              with_host=True, replicate_base=replicated)
    terms = phase_terms(shape, strategy, work, **kw)  # KV at the reserve (or the fixed count)
    host_node = sum(terms["host"].values()) * cluster.node_devices
    fits = _peak(terms) <= cluster.usable and host_node <= cluster.host_per_node
    per_seq = work.blocks_per_seq
    blocks = work.kv_reserve_seqs(n) * per_seq
    if work.elastic_kv and fits:
        need = work.kv_need_seqs() * per_seq
        block = kv_block_bytes(shape, work.kv_dtype, work.block_size)

        def grow(sized: dict) -> int:
            """Blocks the rollout phase has room for, its other terms as in ``sized``."""
            rest = sum(b for k, b in sized["rollout"].items() if not k.startswith("rollout_kv:"))
            return min(need, max(blocks, max(0, int(cluster.usable) - rest) * n // block))
        # decode activations grow with the slots: size first with the most slots (safe), then
        # again with the slots that pool holds, trimmed until the phase fits
        blocks = grow(phase_terms(shape, strategy, work, kv_blocks=need, **kw))
        terms = phase_terms(shape, strategy, work, kv_blocks=blocks, **kw)
        more = grow(terms)
        for _ in range(3):
            if more <= blocks:
                break
            bigger = phase_terms(shape, strategy, work, kv_blocks=more, **kw)
            over = _peak(bigger) - cluster.usable
            if over <= 0:
                blocks, terms = more, bigger
                break
            more -= math.ceil(over * n / block)
    pool = kv_pool(shape, work, n, blocks, work.elastic_kv)
    per_device = _peak(terms)
    rollout = {"weights_bytes": terms["rollout"].get("actor:weights", 0)
               + terms["host"].get("actor:weights", 0),
               "kv_bytes": pool["bytes_per_device"],
               "concurrent_seqs": max(1, min(pool["concurrent_seqs"], work.kv_need_seqs()))}
    return Plan(model=shape, strategy=strategy, workload=work, cluster=cluster, options=options,
                tp=tp, fits=fits, per_device_bytes=per_device, phases=terms,
                host_per_node_bytes=int(host_node), roles=role_totals(terms),
                execution=execution_plan(shape, strategy, options.roles, n, tp, replicated),
                timing=step_timing(shape, strategy, work, cluster.links, options, n, tp, replicated,
                                   rollout) if with_timing else {"bandwidth": None},
                kv_pool=pool, static_per_device_bytes=_static(terms), replicated=replicated,
                micro_batch_auto=micro_batch_auto)


def tp_candidates(shape: ModelShape, cluster: Cluster) -> list[int]:
    """Tensor-parallel degrees inside one node that divide the devices and the kv heads."""
    out = [t for t in (1, 2, 4, 8, 16) if t <= cluster.node_devices and cluster.devices % t == 0
           and shape.num_heads % t == 0]
    return out or [1]


def layouts(shape, strategy, cluster, options) -> list[tuple[int, bool]]:
    """Candidate ``(tp, replicated)`` pairs: the given tp or every candidate, and for an
    adapter's frozen base both layouts unless one is forced (with ``dp == 1`` they coincide)."""
    tps = [options.tp] if options.tp else tp_candidates(shape, cluster)
    can_rep = strategy.kind == "adapter" and options.roles.offload < 2
    out = []
    for t in tps:
        if not can_rep:
            out.append((t, False))
        elif cluster.devices // t <= 1:
            out.append((t, options.base_layout != "sharded"))
        else:
            reps = {"auto": (True, False), "replicated": (True,), "sharded": (False,)}
            out += [(t, r) for r in reps[options.base_layout]]
    return out


def _fit_layout(shape, strategy, work, cluster, options, tp: int, rep: bool) -> Plan:
    """One layout; with ``micro_batch == 0`` the largest micro batch up to the auto size that
    fits (the auto size: fewest sequences whose compute hides the gathers), else 1."""
    if work.micro_batch:
        return make_plan(shape, strategy, work, cluster, options, tp, False, rep)
    hi = auto_micro_batch(shape, strategy, work, cluster.links, options, cluster.devices, tp, rep)

    def at(b):
        return make_plan(shape, strategy, replace(work, micro_batch=b), cluster, options, tp,
                         False, rep, micro_batch_auto=True)
    best = at(hi)
    if best.fits or hi == 1:
        return best
    lo_plan = at(1)
    if not lo_plan.fits:
        return lo_plan
    lo = 1  # at(lo) fits, at(hi) does not: the activations grow with the micro batch
    while hi - lo > 1:
        mid = (lo + hi) // 2
        p = at(mid)
        if p.fits:
            lo, lo_plan = mid, p
        else:
            hi = mid
    return lo_plan


def _exposed(p: Plan) -> float:
    """Exposed communication seconds per step of a priced layout (0 when nothing is gathered)."""
    return bandwidth_bill(p.model, p.strategy, p.workload, p.cluster.links, p.options,
                          p.cluster.devices, p.tp, p.replicated)["exposed_s"]


def fit(shape, strategy, work, cluster, options, with_timing: bool = False) -> Plan:
    """The layout that fits with the least exposed communication (ties: a replicated base,
    then the smallest tp); if none fits, the one with the lowest peak.

    Candidates: tp (given, or 1, 2, 4, 8 inside a node), for adapters a replicated or sharded
    frozen base, and, with ``micro_batch == 0``, the auto micro batch for that layout.
    """
    plans = [_fit_layout(shape, strategy, work, cluster, options, t, r)
             for t, r in layouts(shape, strategy, cluster, options)]
    fitting = [p for p in plans if p.fits]
    if len(fitting) > 1:
        best = min(fitting, key=lambda p: (round(_exposed(p), 3), not p.replicated, p.tp))
    elif fitting:
        best = fitting[0]
    else:
        best = min(plans, key=lambda p: p.per_device_bytes)
    if not with_timing:
        return best
    return make_plan(shape, strategy, best.workload, cluster, options, best.tp, True,
                     best.replicated, best.micro_batch_auto)


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


@dataclass(frozen=True)
class Knob:
    """One change to a plan's inputs: ``settings`` are (name, value) pairs, each name a
    ``Workload``, ``Strategy`` or ``Options`` setting (``devices``: the cluster's size), in
    the order a user would set them. How they are spelled (command-line flags) is the
    caller's business."""
    settings: tuple

    @classmethod
    def of(cls, **settings) -> "Knob":
        return cls(tuple(settings.items()))


@dataclass
class Proposal:
    """What the planner proposes for a plan that does not fit: ``knob`` the first single
    change that fits (``per_device_bytes`` then its peak), or more devices
    (``knob`` sets ``devices``), or nothing (``knob`` None, ``fits`` False)."""
    knob: Knob | None
    fits: bool
    per_device_bytes: int | None = None
    devices: int = 0  # the cluster's devices as given


def _knobs(strategy: Strategy, work: Workload, options: Options):
    """Candidate changes, cheapest first: (knob, strategy, workload, options)."""
    if not work.recompute:
        yield Knob.of(recompute="on"), strategy, replace(work, recompute=True), options
    if work.kv_dtype not in ("fp8", "int8"):
        yield Knob.of(kv_dtype="fp8"), strategy, replace(work, kv_dtype="fp8"), options
    if work.rollout_seqs:
        for div in (2, 4, 8):
            if work.rollout_seqs // div >= 1:
                yield (Knob.of(rollout_seqs=work.rollout_seqs // div), strategy,
                       replace(work, rollout_seqs=work.rollout_seqs // div), options)
    else:
        for m in sorted({max(1, work.min_rollout_seqs // d) for d in (2, 4, 8)}, reverse=True):
            if m < work.min_rollout_seqs:
                yield (Knob.of(min_rollout_seqs=m), strategy, replace(work, min_rollout_seqs=m),
                       options)
    if work.micro_batch > 1:
        yield Knob.of(micro_batch=1), strategy, replace(work, micro_batch=1), options
    if options.prefetch_depth > 1:
        yield Knob.of(prefetch_depth=1), strategy, work, replace(options, prefetch_depth=1)
    r = options.roles
    if strategy.kind in ("adamw", "adapter") and r.offload < 1:
        yield (Knob.of(offload="optimizer"), strategy, work,
               replace(options, roles=replace(r, offload=1)))
    if strategy.kind == "adamw":
        yield Knob.of(strategy="stateless"), replace(strategy, kind="stateless"), work, options
    for base in ("bf16", "int8", "int4"):
        if strategy.kind != "adapter" or base != strategy.base_dtype:
            yield (Knob.of(strategy="adapter", base_dtype=base),
                   replace(strategy, kind="adapter", base_dtype=base), work, options)
    yield Knob.of(offload="weights"), strategy, work, replace(options, roles=replace(r, offload=2))


def propose(shape, strategy, work, cluster, options) -> Proposal:
    """The first single knob that makes the run fit on these devices, else more devices."""
    for knob, s, w, o in _knobs(strategy, work, options):
        p = fit(shape, s, w, cluster, o)
        if p.fits:
            return Proposal(knob, True, p.per_device_bytes, cluster.devices)
    n = min_devices(shape, strategy, work, cluster, options)
    if n is not None:
        return Proposal(Knob.of(devices=n), True, None, cluster.devices)
    return Proposal(None, False, None, cluster.devices)


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
