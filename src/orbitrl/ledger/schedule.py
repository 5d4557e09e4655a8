"""Schedule ledger: a simulator of RL step wall clock for four shapes of pools.

Rollout is decode, memory-bound: a device runs ``slots_per_device`` sequences at once, one
token each per ``decode_step_s``. A synchronous batch is admitted first come, first served
(continuous batching: a slot takes the next sequence when its sequence ends); the engine does
not know a completion's length when it admits it, so ``StepWork.lengths`` is the arrival
order, and :class:`LengthDist` puts the long answers last: the tail runs after the body, as it
does when the long answers are the ones left once the rest is done. The body is then
throughput (it shrinks with more devices) and the tail is latency (it does not). Scoring and
training are compute: device-seconds spread evenly over their pool.

Shapes (``D`` devices, ``Dr`` rollout, ``Dt = D - Dr`` training):

- ``colocated``: rollout on all D, then score+train on all D; no weight sync.
- ``separated``: rollout on Dr, sync, train on Dt; each pool waits for the other.
- ``one_step``: rollout of step n+1 overlaps training of step n (staleness 1): the step is
  the longer of the two pools' phases, plus the sync.
- ``async``: rollout never stops (slots refill as sequences finish), so it is bounded by
  throughput, and it pays what asynchrony costs, each from its mechanism:

  * partial rollouts: at each weight update the sequences in flight recompute their KV under
    the new weights (a prefill of prompt + tokens so far). By Little's law ``N x mean decode
    time / step`` sequences are in flight, a random one length-biased and half done;
    priced at the compute cost of a policy forward per token (``StepWork.forward_s``).
    ``partial="keep_kv"`` continues on the old KV and pays nothing here.
  * the proximal logprobs of decoupled PPO (behaviour, proximal, current): the behaviour
    logprobs come with sampling; the proximal pass is the recompute synchronous scoring
    already runs when ``StepWork.scoring_recomputes`` (orbitrl's trainer does), else one
    more policy forward on the training pool.
  * the staleness bound ``k``: a sample may span at most k policy versions. ``wait``: the
    trainer does not run more than k versions ahead of a sample in flight, so the step is at
    least the longest sample's decode time over k. ``drop``: samples that would exceed it are
    cut at k versions (their tokens wasted) and replaced, which also drops the long answers.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from itertools import accumulate

SHAPES = ("colocated", "separated", "one_step", "async")
ADMISSIONS = ("arrival", "longest_first")
OVERFLOWS = ("wait", "drop")
PARTIALS = ("reprefill", "keep_kv")
FORWARD_SHARE = 1 / 3  # a forward is 2 of the 6 flops per parameter per token of fwd+bwd


@dataclass(frozen=True)
class LengthDist:
    """Completion lengths of one step's batch (deterministic quantiles, no randomness).

    Args:
        num_seqs: sequences per step.
        body_len: the longest ordinary completion, tokens; ordinary lengths are spread
            evenly over [body_len/2, body_len].
        tail_fraction: share of a synchronous rollout's wall clock spent waiting on the tail
            alone when the batch decodes at once, in [0, 1): tail length =
            body_len / (1 - tail_fraction).
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

    @property
    def num_tail(self) -> int:
        return math.ceil(self.tail_share * self.num_seqs) if self.tail_fraction > 0 else 0

    def lengths(self) -> list[int]:
        """Lengths in arrival order: the ordinary ones interleaved, the long answers last."""
        return body_lengths(self.num_seqs - self.num_tail, self.body_len) + [self.tail_len] * self.num_tail


def body_lengths(n: int, body_len: int) -> list[int]:
    """``n`` ordinary lengths evenly over [body_len/2, body_len], interleaved (short and long
    mixed, as arrivals are): the quantile ranks taken in a fixed stride coprime to ``n``."""
    lo = body_len / 2
    q = [round(lo + (body_len - lo) * (i + 1) / n) for i in range(n)]
    stride = next(s for s in range(max(1, round(n * 0.618)), 0, -1) if math.gcd(s, n) == 1) if n else 1
    return [q[(i * stride) % n] for i in range(n)]


@dataclass(frozen=True)
class StepWork:
    """Per-step work: decode speed and slots, device-seconds of score, train and comm stalls.

    ``lengths`` are completion tokens in arrival order. ``prompt_len``: prompt tokens per
    sequence (part of what a re-prefill recomputes). ``forward_device_s``: device-seconds of
    one policy forward over the step's tokens, compute bound (None: ``FORWARD_SHARE`` of
    training). ``scoring_recomputes``: synchronous scoring already recomputes the sampling
    policy's logprobs, so async's proximal pass costs nothing more. ``prefill_device_s``:
    the prompts' forward in the rollout pool (0: folded into the decode steps).
    """

    lengths: tuple[int, ...]
    slots_per_device: int
    decode_step_s: float
    score_device_s: float
    train_device_s: float
    sync_s: float = 0.0
    stall_device_s: float = 0.0  # exposed communication: lengthens training, is not work
    prompt_len: int = 0
    forward_device_s: float | None = None
    scoring_recomputes: bool = True
    prefill_device_s: float = 0.0  # device-seconds of the prompts' prefill, per step

    @property
    def forward_s(self) -> float:
        """Device-seconds of one policy forward over the step's prompt and completion tokens."""
        return self.train_device_s * FORWARD_SHARE if self.forward_device_s is None else self.forward_device_s

    @classmethod
    def from_phases(cls, generation_s: float, tail_s: float, score_s: float, train_s: float,
                    devices: int, *, num_seqs: int = 8192, waves: int = 8, tail_share: float = 0.005,
                    body_len: int = 2048, prompt_len: int = 0, sync_s: float = 0.0) -> "StepWork":
        """The work whose colocated step on ``devices`` has these phase times (seconds).

        ``generation_s`` includes ``tail_s``: the time the long answers (``tail_share`` of
        ``num_seqs``, admitted last) run alone after the body. ``waves``: sequences per step
        over concurrent slots (``num_seqs / (waves x devices)`` slots per device), so the body
        is throughput; ``tail_share x waves`` is the share of slots busy while the tail runs
        alone. Decode time per token and the tail length are solved so that the
        first-come-first-served rollout gives exactly ``generation_s``; score and training
        become device-seconds; a forward is ``FORWARD_SHARE`` of training. The defaults (512
        prompts x 16 samples, 8 waves, 0.5% of them stragglers) are a workload shape the
        source material does not state; docs/planner.md shows how the results move with them.
        """
        if not 0 <= tail_s < generation_s or min(score_s, train_s) < 0 or devices < 1:
            raise ValueError("need 0 <= tail_s < generation_s, score_s, train_s >= 0, devices >= 1")
        slots = max(1, round(num_seqs / (waves * devices)))
        n_tail = max(1, math.ceil(tail_share * num_seqs)) if tail_s > 0 else 0
        if n_tail > slots * devices:
            raise ValueError("the tail must fit the slots at once (lower tail_share or waves)")
        body = body_lengths(num_seqs - n_tail, body_len)
        free = _slot_ends(tuple(body), slots * devices)
        dt = (generation_s - tail_s) / max(free)
        tail = [round(generation_s / dt - sorted(free)[n_tail - 1])] * n_tail if n_tail else []
        return cls(tuple(body + tail), slots, dt, score_s * devices, train_s * devices,
                   sync_s=sync_s, prompt_len=prompt_len)


@dataclass(frozen=True)
class StepTime:
    """One shape's simulated step: seconds per phase, device utilisation and staleness.

    Async's costs: ``reprefill_s`` (rollout-pool seconds re-prefilling partial rollouts),
    ``proximal_s`` (training-pool seconds of an extra proximal-logprob forward),
    ``wait_s`` (seconds the staleness bound adds to the step), ``dropped_share`` (share of
    sampled sequences cut at the bound and replaced).
    """

    shape: str
    step_s: float
    rollout_s: float
    train_s: float
    sync_s: float
    utilisation: float
    staleness: int
    rollout_devices: int
    train_devices: int
    reprefill_s: float = 0.0
    proximal_s: float = 0.0
    wait_s: float = 0.0
    dropped_share: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


@lru_cache(maxsize=1024)
def _slot_ends(lengths: tuple[int, ...], slots: int) -> tuple[int, ...]:
    """Each slot's finishing iteration, admitting ``lengths`` first come, first served."""
    if len(lengths) <= slots:
        return tuple(lengths) + (0,) * (slots - len(lengths))
    heap = [0] * slots
    for n in lengths:
        heapq.heapreplace(heap, heap[0] + n)
    return tuple(heap)


def rollout_makespan(lengths, slots: int, order: str = "longest_first") -> int:
    """Decode iterations to finish all ``lengths`` on ``slots`` slots, admitted in arrival
    order (``"arrival"``) or longest first (an engine that knew the lengths)."""
    if order not in ADMISSIONS:
        raise ValueError(f"unknown admission order {order!r}; one of {', '.join(ADMISSIONS)}")
    xs = tuple(sorted(lengths, reverse=True) if order == "longest_first" else lengths)
    return max(_slot_ends(xs, slots)) if xs else 0


class _Moments:
    """Prefix sums of the sorted lengths: the step's token counts for any cut-off."""

    def __init__(self, work: StepWork):
        self.xs = sorted(work.lengths)
        self.s1 = [0, *accumulate(self.xs)]
        self.s2 = [0, *accumulate(x * x for x in self.xs)]
        self.per_token_s = work.forward_s / (len(self.xs) * work.prompt_len + self.s1[-1])

    def upto(self, cut: float) -> tuple[int, float, float]:
        """(sequences at most ``cut`` long, their tokens, their squared tokens)."""
        i = bisect.bisect_right(self.xs, cut)
        return i, self.s1[i], self.s2[i]


def _busy(work: StepWork) -> float:
    """Device-seconds of useful work per step (decode counted per full device of slots)."""
    decode = sum(work.lengths) * work.decode_step_s / work.slots_per_device
    return decode + work.prefill_device_s + work.score_device_s + work.train_device_s


def _train_s(work: StepWork, devices: int, extra: float = 0.0) -> float:
    return (work.score_device_s + work.train_device_s + work.stall_device_s + extra) / devices


def _async_rollout(work: StepWork, m: _Moments, dr: int, step: float, staleness: int,
                   overflow: str, partial: str) -> tuple[float, float, float, float]:
    """(rollout-pool seconds, of which re-prefill, staleness wait, dropped share) at ``step``."""
    dt, n = work.decode_step_s, len(m.xs)
    horizon = staleness * step / dt  # tokens a sample may decode within the bound
    if overflow == "drop" and m.xs[-1] > horizon:
        kept, s1, s2 = m.upto(horizon)
        cut = n - kept
        scale = n / max(kept, 1)  # replacements until the step has n samples
        s1, s2 = (s1 + cut * horizon) * scale, (s2 + cut * horizon ** 2) * scale
    else:
        cut, s1, s2 = 0, m.s1[-1], m.s2[-1]
    thru = s1 * dt / (dr * work.slots_per_device) + work.prefill_device_s / dr
    reprefill = 0.0
    if partial == "reprefill":  # in flight: dt/step per decoded token; context P + l/2
        tokens = dt / step * (work.prompt_len * s1 + s2 / 2)
        reprefill = tokens * m.per_token_s / dr
    wait = 0.0
    if overflow == "wait":
        wait = max(0.0, m.xs[-1] * dt / staleness - (thru + reprefill))
    return thru + reprefill + wait, reprefill, wait, cut / n


def _async_time(work: StepWork, devices: int, dr: int, staleness: int, overflow: str,
                partial: str) -> StepTime:
    """The async step: the fixed point of step = max(rollout pool(step), training) + sync."""
    dt_, m = devices - dr, _Moments(work)
    proximal = 0.0 if work.scoring_recomputes else work.forward_s / dt_
    train = _train_s(work, dt_) + proximal
    step = max(train, sum(work.lengths) * work.decode_step_s / (dr * work.slots_per_device)) + work.sync_s
    for _ in range(100):
        roll, re, wait, dropped = _async_rollout(work, m, dr, step, staleness, overflow, partial)
        new = max(roll, train) + work.sync_s
        if abs(new - step) <= 1e-9 * new:
            break
        step = new
    wait = max(0.0, roll - max(roll - wait, train))  # what the bound adds to the step
    longest = min(m.xs[-1], staleness * step / work.decode_step_s)
    stale = min(staleness, max(1, math.ceil(longest * work.decode_step_s / step - 1e-9)))
    util = _busy(work) / (devices * step) if step > 0 else 0.0
    return StepTime("async", step, roll, train, work.sync_s, min(1.0, util), stale, dr, dt_,
                    reprefill_s=re, proximal_s=proximal, wait_s=wait, dropped_share=dropped)


def _shape_time(shape: str, work: StepWork, devices: int, rollout_devices: int, staleness: int,
                admission: str = "arrival", overflow: str = "wait",
                partial: str = "reprefill") -> StepTime:
    if shape == "async":
        return _async_time(work, devices, rollout_devices, staleness, overflow, partial)
    dr = devices if shape == "colocated" else rollout_devices
    dt_ = devices if shape == "colocated" else devices - rollout_devices
    roll = rollout_makespan(work.lengths, dr * work.slots_per_device, admission) * work.decode_step_s
    roll += work.prefill_device_s / dr
    train = _train_s(work, dt_)
    sync = 0.0 if shape == "colocated" else work.sync_s
    if shape == "one_step":
        step, stale = max(roll, train) + sync, 1
    else:
        step, stale = roll + sync + train, 0
    util = _busy(work) / (devices * step) if step > 0 else 0.0
    return StepTime(shape, step, roll, train, sync, min(1.0, util), stale, dr, dt_)


def _candidates(devices: int) -> list[int]:
    if devices <= 256:
        return list(range(1, devices))
    pts = {max(1, min(devices - 1, round(devices * i / 128))) for i in range(1, 128)}
    return sorted(pts)


def simulate(shape: str, work: StepWork, devices: int, rollout_devices: int | None = None,
             staleness: int = 4, *, admission: str = "arrival", overflow: str = "wait",
             partial: str = "reprefill") -> StepTime:
    """Step time of ``shape`` on ``devices``; separated shapes pick the best split if not given.

    ``admission``: how a synchronous rollout admits sequences (``arrival`` or
    ``longest_first``); ``overflow``: what async does with a sample that would exceed
    ``staleness`` versions (``wait`` or ``drop``); ``partial``: whether async's in-flight
    samples re-prefill under new weights (``reprefill``) or keep their KV (``keep_kv``).
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown schedule shape {shape!r}; one of {', '.join(SHAPES)}")
    for name, value, allowed in (("overflow", overflow, OVERFLOWS), ("partial", partial, PARTIALS),
                                 ("admission", admission, ADMISSIONS)):
        if value not in allowed:
            raise ValueError(f"unknown {name} {value!r}; one of {', '.join(allowed)}")
    if devices < 1 or (shape != "colocated" and devices < 2):
        raise ValueError(f"{shape} needs at least {1 if shape == 'colocated' else 2} devices")
    if staleness < 1:
        raise ValueError("staleness must be at least 1")
    opts = {"admission": admission, "overflow": overflow, "partial": partial}
    if shape == "colocated" or rollout_devices is not None:
        return _shape_time(shape, work, devices, rollout_devices or devices, staleness, **opts)
    return min((_shape_time(shape, work, devices, dr, staleness, **opts) for dr in _candidates(devices)),
               key=lambda s: s.step_s)


def compare(work: StepWork, devices: int, staleness: int = 4, **options) -> dict[str, StepTime]:
    """All four shapes (separated ones on a single device fall back to colocated);
    ``options`` go to :func:`simulate` (admission, overflow, partial)."""
    if devices < 2:
        return {"colocated": simulate("colocated", work, devices, **options)}
    return {s: simulate(s, work, devices, staleness=staleness, **options) for s in SHAPES}


def balance_ratio(times: dict[str, StepTime] | None = None, *, ranks: int | None = None,
                  tokens_per_step: float | None = None, gen_tokens_per_s: float | None = None,
                  train_rank_s: float | None = None) -> tuple[int, int] | None:
    """Rollout:training device split that balances the async pools (None if colocated only).

    From simulated ``times`` (:func:`compare`), or from measured rates: pass ``ranks``,
    ``tokens_per_step``, ``gen_tokens_per_s`` and ``train_rank_s`` (see :func:`measured_split`).
    """
    if ranks is not None:
        return measured_split(ranks, tokens_per_step, gen_tokens_per_s, train_rank_s)
    best = (times or {}).get("async")
    return (best.rollout_devices, best.train_devices) if best else None


def measured_split(ranks: int, tokens_per_step: float, gen_tokens_per_s: float,
                   train_rank_s: float) -> tuple[int, int]:
    """The rollout:training split of ``ranks`` that balances measured rates.

    ``gen_tokens_per_s``: tokens one rollout rank generates per second (all its sequences
    together); ``train_rank_s``: rank-seconds one step's training takes (measured step
    training seconds x the training ranks that ran it). With R rollout ranks a step generates
    in ``tokens_per_step / (R x gen_tokens_per_s)`` s and trains in ``train_rank_s / (ranks -
    R)`` s; the split minimises the slower of the two, ties to fewer rollout ranks.

    >>> measured_split(8, tokens_per_step=512 * 1024, gen_tokens_per_s=2000.0, train_rank_s=131.0)
    (5, 3)
    """
    if ranks < 2:
        raise ValueError("a split needs at least 2 ranks")
    if min(tokens_per_step or 0, gen_tokens_per_s or 0, train_rank_s or 0) <= 0:
        raise ValueError("tokens_per_step, gen_tokens_per_s and train_rank_s must be positive")
    gen_rank_s = tokens_per_step / gen_tokens_per_s
    return min(((r, ranks - r) for r in range(1, ranks)),
               key=lambda s: (max(gen_rank_s / s[0], train_rank_s / s[1]), s[0]))
