"""Types shared along the step: prompts -> engine -> samples -> rewards -> trainer."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sample:
    """One completion of one prompt, as the engine produced it and the trainer consumes it.

    ``rollout_logprobs[j]`` is the log-probability the engine sampled ``completion_ids[j]``
    with (same temperature as the trainer's recomputation); ``policy_version`` is the
    optimizer step the sampling weights came from.
    """
    group: int                   # index of the prompt within the step
    prompt_ids: list[int]
    completion_ids: list[int]
    rollout_logprobs: list[float]
    finish_reason: str
    text: str
    fields: dict = field(default_factory=dict)  # the dataset row (answer, ...)
    policy_version: int = 0
    reward: float = 0.0
    routing: object = None  # mixtures: [S, prompt + completion, k] experts the engine used

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"
