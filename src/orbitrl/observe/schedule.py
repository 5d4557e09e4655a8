"""The schedule ledger against the runtime: the planner's step time from measured rates.

Each step the run feeds the simulator (``ledger/schedule.py``) the rates it measured so far
with this step's completion lengths, and logs its prediction for the run's shape beside the
measured step time (``time_step_predicted_s`` / ``time_step_s``). The rates are the medians
over the *previous* steps (the first step uses its own), so the number is a prediction, not a
restatement. What each rate is, and why:

- ``iter_s``: seconds per decode iteration of the simulator's rollout. A synchronous rollout
  (colocated, separated, one_step) is calibrated on the measured rollout phase: its seconds
  over the simulator's makespan of its lengths (first come, first served on the engine's
  slots), so prefill, admission and the per-step sampling bookkeeping that the engine's
  decode steps do not show are in the rate. Async's rollout never runs alone; its rate is the
  engine's measured seconds per step and its ``slots`` the sequences an engine step actually
  carried (the queue keeps the engine only that full).
- ``score``, ``train``, ``sync``: the measured phases (scoring includes the verifiers).
- ``other``: what the step measured beyond its phases (packing, the update's bookkeeping,
  anchors, the metrics row), a serial cost on the training side.

At the end the measured rates propose the rollout:training split
(``ledger.schedule.measured_split``: tokens per step, one rollout rank's tokens per second,
training rank-seconds per step).
"""

from __future__ import annotations

import statistics

from orbitrl.ledger.schedule import StepWork, compare, measured_split, rollout_makespan, simulate

RATES = ("iter_s", "slots", "score", "train", "sync", "other", "tokens", "gen_tok_s")


class StepPredictor:
    """Args:
        shape: the run's ``schedule.shape``.
        devices: ranks in the simulated pool; ``rollout_devices``: those that generate
            (colocated: all). Colocated ranks are simulated one at a time (each generates
            and trains its own share), so ``devices`` is 1 there.
        staleness: the versions a rollout may run ahead (the simulator's async bound).
        slots: sequences one engine runs at once.
        ranks: the run's ranks (the balancing proposal's); ``train_ranks``: those training.
        partial: async's in-flight samples at a weight update: ``keep_kv``
            (``schedule.partial: continue``) or ``reprefill`` (``cut``).
        overflow: the staleness bound's policy (``schedule.stale_policy``: wait or drop).
        prompt_len: prompt tokens per sample (what a re-prefill recomputes besides the
            completion so far).
    """

    def __init__(self, shape: str, devices: int, rollout_devices: int, staleness: int,
                 slots: int, ranks: int = 1, train_ranks: int = 1, partial: str = "keep_kv",
                 overflow: str = "wait", prompt_len: int = 0):
        self.shape, self.devices, self.rollout_devices = shape, devices, rollout_devices
        self.staleness, self.slots = max(1, staleness), slots
        self.options = {"partial": partial, "overflow": overflow}
        self.prompt_len = prompt_len
        self.ranks, self.train_ranks = ranks, train_ranks
        self.train_devices = devices if shape == "colocated" else devices - rollout_devices
        self.seen: dict[str, list[float]] = {k: [] for k in RATES}
        self.n = 0
        self.lengths: tuple[int, ...] = ()

    def _rates(self, now: dict) -> dict:
        """The median of each rate over the previous steps (robust to the first steps'
        warm-up and to a step another process slowed), or this step's own at the first."""
        if not self.n:
            return now
        return {k: statistics.median(v) for k, v in self.seen.items()}

    def work(self, lengths, rates: dict) -> StepWork:
        """The simulator's step from rates (seconds on this run's pools)."""
        dt = self.train_devices
        slots = max(1, round(rates["slots"])) if self.shape == "async" else self.slots
        return StepWork(tuple(int(x) for x in lengths) or (1,), slots,
                        max(rates["iter_s"], 1e-9), rates["score"] * dt, rates["train"] * dt,
                        rates["sync"], stall_device_s=rates["other"] * dt,
                        prompt_len=self.prompt_len)

    def measure(self, lengths, rollout_s: float, engine_step_s: float, width: float,
                score_s: float, train_s: float, sync_s: float, other_s: float,
                gen_tokens: int, gen_tok_s: float) -> dict:
        """This step's rates (see the module docstring). ``width``: sequences per engine
        step; ``gen_tok_s``: tokens one rollout rank generates per second."""
        lengths = tuple(int(x) for x in lengths) or (1,)
        if self.shape == "async":
            iter_s, slots = engine_step_s, max(width, 1.0)
        else:
            span = rollout_makespan(lengths, self.rollout_devices * self.slots, "arrival")
            iter_s, slots = rollout_s / max(span, 1), float(self.slots)
        return {"iter_s": iter_s, "slots": slots, "score": score_s, "train": train_s,
                "sync": sync_s, "other": max(0.0, other_s), "tokens": float(gen_tokens),
                "gen_tok_s": gen_tok_s}

    def __call__(self, lengths, **measured) -> dict:
        """The predicted step time for this step's lengths; then this step's rates (the
        keyword arguments of :meth:`measure`) join the means."""
        now = self.measure(lengths, **measured)
        pred = simulate(self.shape, self.work(lengths, self._rates(now)), self.devices,
                        None if self.shape == "colocated" else self.rollout_devices,
                        staleness=self.staleness, **self.options)
        for k, v in now.items():
            self.seen[k].append(v)
        self.n += 1
        self.lengths = tuple(int(x) for x in lengths)
        return {"time_step_predicted_s": pred.step_s,
                "time_rollout_predicted_s": pred.rollout_s}

    def balance(self, devices: int) -> dict | None:
        """The split of ``devices`` ranks the measured rates propose (None before a step,
        on one device, or without a measured generation rate)."""
        if not self.n or devices < 2:
            return None
        r = self._rates({})
        tokens = r["tokens"] * (self.ranks if self.shape == "colocated" else 1)
        if min(tokens, r["gen_tok_s"], r["train"]) <= 0:
            return None
        train_rank_s = r["train"] * self.train_ranks
        split = measured_split(devices, tokens, r["gen_tok_s"], train_rank_s)
        work = self.work(self.lengths, r)
        times = compare(work, devices, staleness=self.staleness, **self.options)
        return {"devices": devices, "rollout": split[0], "train": split[1],
                "async_step_s": simulate("async", work, devices, split[0],
                                         staleness=self.staleness, **self.options).step_s,
                "colocated_step_s": times["colocated"].step_s}


def balance_line(b: dict | None, shape: str, rollout: int, world: int) -> str:
    """The end-of-run proposal, one line."""
    if b is None:
        return "balance: not enough measurements to propose a rollout:training split"
    return (f"balance: measured rates propose rollout:training = {b['rollout']}:{b['train']} "
            f"of {b['devices']} ranks (simulated async step {b['async_step_s']:.3f} s, "
            f"colocated {b['colocated_step_s']:.3f} s); this run: {shape} "
            f"{rollout}:{world - rollout}")
