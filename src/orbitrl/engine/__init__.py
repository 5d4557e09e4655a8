"""Rollout engine: paged KV pool shared across a GRPO group, continuous batching, preemption,
fp8 KV, per-token logprobs (see docs/engine.md)."""

from orbitrl.engine.engine import Engine
from orbitrl.engine.sequence import Completion, Request, RequestOutput, SamplingParams

__all__ = ["Engine", "SamplingParams", "Request", "RequestOutput", "Completion"]
