"""The RL step's own metrics: lengths, throughput, phase times and memory, and its MFU
waterfall (flops.py), from what the step's phases report."""

from __future__ import annotations

import time

from orbitrl.observe.flops import measure_peak_flops, waterfall
from orbitrl.observe.metrics import device_peak_bytes


def sample_metrics(samples, gen_tokens: int, seconds: dict) -> dict:
    """Completion lengths, the truncated share and generation throughput."""
    lens = [len(s.completion_ids) for s in samples] or [0]
    return {
        "completion_len_mean": sum(lens) / len(lens),
        "completion_len_max": max(lens),  # the long tail a synchronous rollout waits on
        "truncated_frac": sum(s.truncated for s in samples) / max(1, len(samples)),
        "tokens_per_s": gen_tokens / max(seconds.get("rollout", 0.0), 1e-9),
    }


def phase_metrics(device, kv_blocks: int, seconds: dict, timer, probe,
                  positions: int = 0) -> dict:
    """Peak device memory, the KV pool's size, each phase's seconds and memory (measured
    and predicted, ``observe/memory.py``; ``positions``: the step's micro-batches live at
    once, for the prediction at its shape)."""
    return {
        "kv_blocks": kv_blocks,
        "peak_memory_bytes": device_peak_bytes(device),
        **{f"time_{k}_s": v for k, v in seconds.items()},
        **{f"mem_{k}_bytes": v for k, v in timer.memory.items()},
        **{f"ops_{k}": v for k, v in (getattr(timer, "ops", None) or {}).items()},
        **(probe.step_metrics(timer, positions) if hasattr(timer, "measured") else {}),
    }


class StepFlops:
    """The step's model-FLOPs utilisation and its waterfall (observe/flops.py).

    Args:
        config: the policy's ModelConfig (compute parameters: embeddings excluded).
        frozen_base: adapters over a frozen base (4 x params per trained token, not 6).
        train_passes: forward + backward passes per kept token (epochs, twice for a
            two-pass fused update).
    """

    def __init__(self, config, frozen_base: bool, train_passes: int):
        c = config
        self.params = c.num_params - (0 if c.tie_word_embeddings else
                                      c.vocab_size * c.hidden_size)
        self.frozen_base, self.train_passes = frozen_base, train_passes
        self.peak: float | None = None  # measured at the first step

    def __call__(self, tokens: int, scoring_passes: int, trained: bool, timeline,
                 seconds: dict, produced: dict, step_s: float, waited: float | None) -> dict:
        """``tokens``: the kept samples' tokens; ``trained``: an update ran; ``seconds``:
        every phase's seconds; ``produced``: the rollout's and rewards' (the producer's,
        when overlapped); ``waited``: seconds training waited for an overlapped rollout.
        Overlapped, the rollout costs the step only the seconds training waited for it:
        those are split between decode and long tail as the engine's timeline splits its
        own seconds."""
        if self.peak is None:
            self.peak = measure_peak_flops()
        seconds = dict(seconds)
        if waited is not None:
            exposed = waited / max(produced.get("rollout", 0.0) + produced.get("reward", 0.0),
                                   1e-9)
            exposed = min(1.0, exposed)
            timeline = [(n, t, sec * exposed) for n, t, sec in timeline]
            seconds["rollout"] = produced.get("rollout", 0.0) * exposed
            seconds["reward"] = produced.get("reward", 0.0) * exposed
        train = tokens * self.train_passes if trained else 0
        return waterfall(self.params, self.peak, sum(t for _, t, _ in timeline), timeline,
                         tokens if trained else 0, scoring_passes, train, self.frozen_base,
                         seconds, step_s)


class StepRow:
    """The step's metrics row, assembled from what its phases returned (rl/trainer.py).

    Args:
        device, engine, mem: where memory is measured, the engine (its KV pool's size) and
            the run's MemoryProbe.
        flops: the run's StepFlops; predictor: the planner's StepPredictor (None: no step
            time prediction for this source).
    """

    def __init__(self, device, engine, mem, flops: StepFlops, predictor=None):
        self.device, self.engine, self.mem = device, engine, mem
        self.flops, self.predictor = flops, predictor
        self.trajectories: list = []  # multi-turn: the last step's (run.py logs them)

    def __call__(self, iteration: int, version: int, ro, sc, upd, timer, t_step: float,
                 waited: float | None, source, back: dict) -> dict:
        """``ro``/``sc``/``upd``: the rollout, the scored step and the update; ``t_step``:
        when the step began; ``source``: the rollout source (its columns and rollout
        rates); ``back``: the memory handed back before training."""
        row = {"step": iteration, "watchdog": ro.watchdog, **ro.governor}
        if waited is not None:
            row["time_wait_rollout_s"] = waited
        row.update(back)
        row.update(source.row())
        row.update(sc.metrics)
        if sc.batch is not None:
            row.update(sc.batch.metrics)
        row.update(upd.metrics)
        seconds = {**ro.seconds, **timer.seconds}
        row["policy_version"] = version
        row.update(sample_metrics(ro.samples, ro.gen_tokens, ro.seconds))
        row.update(ro.env)  # multi-turn: turns, tool calls, waits, swapped KV, prefill
        row.update(phase_metrics(self.device, self.engine.pool.num_blocks, seconds, timer,
                                 self.mem, row.get("mem_train_positions", 0)))
        if sc.anything:
            step_s = time.perf_counter() - t_step
            row["time_step_s"] = step_s
            b = sc.batch
            row.update(self.flops(b.tokens if b else 0, b.scoring_passes if b else 0,
                                  b is not None, ro.timeline, seconds, ro.seconds, step_s,
                                  waited))
            row.update(self.predicted(ro, seconds, row, waited, source))
        return row

    def predicted(self, ro, seconds: dict, row: dict, waited, source) -> dict:
        """The planner's step time from the measured rates (observe/schedule.py)."""
        if self.predictor is None:
            return {}
        g = {k: seconds.get(k, 0.0) for k in ("rollout", "reward", "score", "train")}
        sync = row.get("time_sync_s", 0.0)
        lens, gen, step_s, width, gen_rate, front = source.rates(ro, seconds, row, waited)
        other = row["time_step_s"] - front - g["reward"] - g["score"] - g["train"] - sync
        return self.predictor(
            lens, rollout_s=g["rollout"], engine_step_s=step_s, width=width,
            score_s=g["score"] + g["reward"], train_s=g["train"], sync_s=sync, other_s=other,
            gen_tokens=gen, gen_tok_s=gen_rate)
