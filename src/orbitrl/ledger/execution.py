"""Execution plan per role: which stages it serves, its parallel layout, precision and tier.

This is what the runtime instantiates: the actor generates (resident one-copy layout,
tp x pp over the pool) and trains (ZeRO-3 shards, tp inside a node, dp across); frozen roles
only run inference, from the device or pulled layer by layer from the host. When the planner
replicates a frozen adapter base (it fits once per tp group), every tp group holds the whole
base, nothing is gathered, and generation runs dp independent tp instances.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from orbitrl.ledger.bill import RoleOptions
from orbitrl.ledger.memory import Strategy
from orbitrl.ledger.models import ModelShape


@dataclass(frozen=True)
class RolePlan:
    """Placement of one role. ``parallel`` maps a stage to its ``{"tp", "pp", "dp"}``."""

    role: str
    stages: tuple[str, ...]
    parallel: dict
    precision: str
    tier: str
    requires_grad: bool
    params: int

    def as_dict(self) -> dict:
        d = asdict(self)
        d["stages"] = list(self.stages)
        return d


def _layouts(stages, n: int, tp: int, replicated: bool = False) -> dict:
    dp = max(1, n // tp)
    out = {}
    for s in stages:
        one_copy = s == "generation" and not replicated
        out[s] = {"tp": tp, "pp": dp, "dp": 1} if one_copy else {"tp": tp, "pp": 1, "dp": dp}
    return out


def execution_plan(shape: ModelShape, strategy: Strategy, roles: RoleOptions, devices: int,
                   tp: int, replicated: bool = False) -> list[dict]:
    """One :class:`RolePlan` per role (actor, critic, reference, reward), as dicts.

    ``replicated``: the adapter strategy's frozen base is held whole by every tp group
    (``1/tp`` per device) and never gathered (the planner's choice when it fits).
    """
    dp = max(1, devices // tp)
    rep = replicated and strategy.kind == "adapter" and roles.offload < 2
    if roles.offload >= 2:
        tier_w = "host (cold layers, prefetched)"
    elif rep:
        tier_w = (f"device (frozen base replicated: whole per tp group of {tp}, {dp} "
                  f"cop{'y' if dp == 1 else 'ies'}; no gathers; adapters sharded)")
    elif dp == 1:
        tier_w = f"device (tp-sharded over {tp}, resident; no gathers)"
    else:
        tier_w = f"device (sharded over {devices}, per-layer gathers)"
    if strategy.kind == "adapter":
        precision = f"{strategy.base_dtype} frozen base + bf16 adapters (rank {strategy.adapter_rank})"
    elif strategy.kind == "adamw":
        precision = f"{strategy.weight_dtype} weights + fp32 master and AdamW moments"
    else:
        precision = f"{strategy.weight_dtype} weights, stateless update fused into backward"
    plans = [RolePlan("actor", ("generation", "inference", "training"),
                      _layouts(("generation", "inference", "training"), devices, tp, rep), precision,
                      tier_w, True, shape.total_params)]
    if roles.critic:
        plans.append(RolePlan("critic", ("inference", "training"),
                              _layouts(("inference", "training"), devices, tp), precision, tier_w,
                              True, shape.total_params))
    if strategy.kind == "adapter":
        plans.append(RolePlan("reference", ("inference",), _layouts(("inference",), devices, tp),
                              f"{strategy.base_dtype} (the actor's base, adapters off)",
                              "shared with actor", False, 0))
    elif roles.reference != "none":
        tier = "host (pulled layer by layer)" if roles.reference == "host" else "device (sharded)"
        plans.append(RolePlan("reference", ("inference",), _layouts(("inference",), devices, tp),
                              roles.ref_dtype, tier, False, shape.total_params))
    if roles.reward_params:
        tier = "host (pulled layer by layer)" if roles.reward_tier == "host" else "device (sharded)"
        plans.append(RolePlan("reward", ("inference",), _layouts(("inference",), devices, tp),
                              roles.reward_dtype, tier, False, roles.reward_params))
    else:
        plans.append(RolePlan("reward", ("inference",), {}, "rule-based verifiers (CPU)", "host",
                              False, 0))
    return [p.as_dict() for p in plans]
