"""Schedule ledger: a simulator of RL step wall clock for four shapes of pools.

Rollout is decode, memory-bound: a device runs ``slots_per_device`` sequences at once, one
token each per ``decode_step_s``. A batch's rollout time is its makespan over the pool's slots
(continuous batching, longest first), so it is never shorter than the longest completion:
more devices do not shorten the tail. Scoring and training are compute: device-seconds spread
evenly over their pool.

Shapes (``D`` devices, ``Dr`` rollout, ``Dt = D - Dr`` training):

- ``colocated``: rollout on all D, then score+train on all D; no weight sync.
- ``separated``: rollout on Dr, sync, train on Dt; each pool waits for the other.
- ``one_step``: rollout of step n+1 overlaps training of step n (staleness 1).
- ``async``: rollout never stops (slots refill as sequences finish); a sequence may span up to
  ``staleness`` policy versions, so the step is bounded by throughput, by the tail over the
  staleness bound, and by training.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import asdict, dataclass

SHAPES = ("colocated", "separated", "one_step", "async")


@dataclass(frozen=True)
class LengthDist:
    """Completion lengths of one step's batch (deterministic quantiles, no randomness).

    Args:
        num_seqs: sequences per step.
        body_len: the longest ordinary completion, tokens; ordinary lengths are spread
            evenly over [body_len/2, body_len].
        tail_fraction: share of a synchronous rollout's wall clock spent waiting on the tail
            alone, in [0, 1): tail length = body_len / (1 - tail_fraction).
        tail_share: share of sequences that are in the tail.
        cap: completion-length cap (tail lengths are clipped to it), 0 for none.
    """

    num_seqs: int
    body_len: int
    tail_fraction: float = 0.0
    tail_share: float = 0.02
    cap: int = 0

    def __post_init__(self):
        if self.num_seqs <= 0 or self.body_len <= 0:
            raise ValueError("num_seqs and body_len must be positive")
        if not 0.0 <= self.tail_fraction < 1.0:
            raise ValueError("tail_fraction must be in [0, 1)")

    @property
    def tail_len(self) -> int:
        t = math.ceil(self.body_len / (1.0 - self.tail_fraction) - 1e-9)
        return min(t, self.cap) if self.cap else t

    def lengths(self) -> list[int]:
        n_tail = math.ceil(self.tail_share * self.num_seqs) if self.tail_fraction > 0 else 0
        n_body = self.num_seqs - n_tail
        lo = self.body_len / 2
        body = [round(lo + (self.body_len - lo) * (i + 1) / n_body) for i in range(n_body)]
        return body + [self.tail_len] * n_tail


@dataclass(frozen=True)
class StepWork:
    """Per-step work: decode speed and slots, device-seconds of score, train and comm stalls."""

    lengths: tuple[int, ...]
    slots_per_device: int
    decode_step_s: float
    score_device_s: float
    train_device_s: float
    sync_s: float = 0.0
    stall_device_s: float = 0.0  # exposed communication: lengthens training, is not work


@dataclass(frozen=True)
class StepTime:
    """One shape's simulated step: seconds per phase, device utilisation and staleness."""

    shape: str
    step_s: float
    rollout_s: float
    train_s: float
    sync_s: float
    utilisation: float
    staleness: int
    rollout_devices: int
    train_devices: int

    def as_dict(self) -> dict:
        return asdict(self)


def rollout_makespan(lengths, slots: int) -> int:
    """Decode iterations to finish all ``lengths`` on ``slots`` slots (longest first)."""
    lengths = sorted(lengths, reverse=True)
    if len(lengths) <= slots:
        return lengths[0] if lengths else 0
    heap = [0] * slots
    for n in lengths:
        heapq.heapreplace(heap, heap[0] + n)
    return max(heap)


def _busy(work: StepWork) -> float:
    """Device-seconds of useful work per step (decode counted per full device of slots)."""
    decode = sum(work.lengths) * work.decode_step_s / work.slots_per_device
    return decode + work.score_device_s + work.train_device_s


def _shape_time(shape: str, work: StepWork, devices: int, rollout_devices: int,
                staleness: int) -> StepTime:
    dt = work.decode_step_s
    if shape == "colocated":
        dr = dt_ = devices
        roll = rollout_makespan(work.lengths, devices * work.slots_per_device) * dt
        train = (work.score_device_s + work.train_device_s + work.stall_device_s) / devices
        step, sync, stale = roll + train, 0.0, 0
    else:
        dr, dt_ = rollout_devices, devices - rollout_devices
        train = (work.score_device_s + work.train_device_s + work.stall_device_s) / dt_
        sync = work.sync_s
        if shape == "async":
            thru = sum(work.lengths) / (dr * work.slots_per_device) * dt
            roll = max(thru, max(work.lengths) * dt / staleness)
        else:
            roll = rollout_makespan(work.lengths, dr * work.slots_per_device) * dt
        if shape == "separated":
            step, stale = roll + sync + train, 0
        elif shape == "one_step":
            step, stale = max(roll, train) + sync, 1
        else:
            step = max(roll, train) + sync
            stale = min(staleness, max(1, math.ceil(max(work.lengths) * dt / step)))
    util = _busy(work) / (devices * step) if step > 0 else 0.0
    return StepTime(shape, step, roll, train, sync, min(1.0, util), stale, dr, dt_)


def _candidates(devices: int) -> list[int]:
    if devices <= 256:
        return list(range(1, devices))
    pts = {max(1, min(devices - 1, round(devices * i / 128))) for i in range(1, 128)}
    return sorted(pts)


def simulate(shape: str, work: StepWork, devices: int, rollout_devices: int | None = None,
             staleness: int = 4) -> StepTime:
    """Step time of ``shape`` on ``devices``; separated shapes pick the best split if not given."""
    if shape not in SHAPES:
        raise ValueError(f"unknown schedule shape {shape!r}; one of {', '.join(SHAPES)}")
    if devices < 1 or (shape != "colocated" and devices < 2):
        raise ValueError(f"{shape} needs at least {1 if shape == 'colocated' else 2} devices")
    if shape == "colocated" or rollout_devices is not None:
        return _shape_time(shape, work, devices, rollout_devices or devices, staleness)
    return min((_shape_time(shape, work, devices, dr, staleness) for dr in _candidates(devices)),
               key=lambda s: s.step_s)


def compare(work: StepWork, devices: int, staleness: int = 4) -> dict[str, StepTime]:
    """All four shapes (separated ones on a single device fall back to colocated)."""
    if devices < 2:
        return {"colocated": simulate("colocated", work, devices)}
    return {s: simulate(s, work, devices, staleness=staleness) for s in SHAPES}


def balance_ratio(times: dict[str, StepTime]) -> tuple[int, int] | None:
    """Rollout:training device split that balances the async pools (None if colocated only)."""
    best = times.get("async")
    return (best.rollout_devices, best.train_devices) if best else None
