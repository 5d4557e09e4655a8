"""The RL step's own metrics: lengths, throughput, phase times and memory, and its MFU
waterfall (flops.py), from what the step's phases report."""

from __future__ import annotations

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


def phase_metrics(device, kv_blocks: int, seconds: dict, timer, probe) -> dict:
    """Peak device memory, the KV pool's size, each phase's seconds and memory (measured
    and predicted, ``observe/memory.py``)."""
    return {
        "kv_blocks": kv_blocks,
        "peak_memory_bytes": device_peak_bytes(device),
        **{f"time_{k}_s": v for k, v in seconds.items()},
        **{f"mem_{k}_bytes": v for k, v in timer.memory.items()},
        **(probe.step_metrics(timer) if hasattr(timer, "measured") else {}),
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
