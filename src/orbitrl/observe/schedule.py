"""The schedule ledger against the runtime: the planner's step time from measured rates.

Each step the run feeds the simulator (``ledger/schedule.py``) what it measured so far (the
engine's seconds per decode step, the scoring and training seconds, the weight sync) with
this step's completion lengths, and logs its prediction for the run's shape beside the
measured step time (``time_step_predicted_s`` / ``time_step_s``). The rates are the means of
the *previous* steps (the first step uses its own), so the number is a prediction, not a
restatement. At the end the same measured rates propose the rollout:training rank split
(the simulator's balancing, ``balance_ratio``).
"""

from __future__ import annotations

from orbitrl.ledger.schedule import StepWork, balance_ratio, compare, simulate


class StepPredictor:
    """Args:
        shape: the run's ``schedule.shape``.
        devices: ranks in the run; ``rollout_devices``: those that generate (colocated: all).
        staleness: the versions a rollout may run ahead (the simulator's async bound).
        slots: sequences one engine runs at once.
    """

    def __init__(self, shape: str, devices: int, rollout_devices: int, staleness: int,
                 slots: int):
        self.shape, self.devices, self.rollout_devices = shape, devices, rollout_devices
        self.staleness, self.slots = max(1, staleness), slots
        self.train_devices = devices if shape == "colocated" else devices - rollout_devices
        self.sums = {"decode": 0.0, "score": 0.0, "train": 0.0, "sync": 0.0}
        self.n = 0
        self.lengths: tuple[int, ...] = ()

    def _rates(self, now: dict) -> dict:
        return {k: self.sums[k] / self.n for k in self.sums} if self.n else now

    def work(self, lengths, rates: dict) -> StepWork:
        """The simulator's step from rates (seconds on this run's pools)."""
        dt = self.train_devices
        return StepWork(tuple(int(x) for x in lengths) or (1,), self.slots,
                        max(rates["decode"], 1e-9), rates["score"] * dt, rates["train"] * dt,
                        rates["sync"])

    def __call__(self, lengths, decode_step_s: float, score_s: float, train_s: float,
                 sync_s: float) -> dict:
        """The predicted step time for this step's lengths; then this step's rates join
        the means."""
        now = {"decode": decode_step_s, "score": score_s, "train": train_s, "sync": sync_s}
        pred = simulate(self.shape, self.work(lengths, self._rates(now)), self.devices,
                        None if self.shape == "colocated" else self.rollout_devices,
                        staleness=self.staleness)
        for k, v in now.items():
            self.sums[k] += v
        self.n += 1
        self.lengths = tuple(int(x) for x in lengths)
        return {"time_step_predicted_s": pred.step_s,
                "time_rollout_predicted_s": pred.rollout_s}

    def balance(self, devices: int) -> dict | None:
        """The split of ``devices`` ranks the measured rates propose (None before a step,
        or on one device)."""
        if not self.n or devices < 2:
            return None
        work = self.work(self.lengths, self._rates({}))
        times = compare(work, devices, staleness=self.staleness)
        split = balance_ratio(times)
        if split is None:
            return None
        return {"devices": devices, "rollout": split[0], "train": split[1],
                "async_step_s": times["async"].step_s,
                "colocated_step_s": times["colocated"].step_s}


def balance_line(b: dict | None, shape: str, rollout: int, world: int) -> str:
    """The end-of-run proposal, one line."""
    if b is None:
        return "balance: not enough measurements to propose a rollout:training split"
    return (f"balance: measured rates propose rollout:training = {b['rollout']}:{b['train']} "
            f"of {b['devices']} ranks (simulated async step {b['async_step_s']:.3f} s, "
            f"colocated {b['colocated_step_s']:.3f} s); this run: {shape} "
            f"{rollout}:{world - rollout}")
