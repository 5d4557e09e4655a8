"""Requests, sampling parameters, and the engine's per-sequence state.

A :class:`Request` with ``n`` samples is prefilled once, as one :class:`Sequence`; when its
prompt is in the KV cache the sequence forks into ``n`` (sample 0 is the original), which
share every prompt block through reference counts (see ``block_pool.py``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from orbitrl.engine.sampler import row_key


@dataclass
class SamplingParams:
    """How to sample one request.

    Args:
        n: samples per prompt (a GRPO group); they share the prompt's KV blocks.
        max_tokens: completion cap in tokens (finish_reason "length").
        temperature: 0 means greedy.
        top_k: keep the k most likely tokens; 0 disables.
        top_p: nucleus mass in (0, 1]; 1 disables.
        seed: per-request seed; sample j draws its uniforms from a counter-based stream
            keyed by (seed, j), so its tokens do not depend on the rest of the batch
            (without a seed the engine draws one per request from its own generator).
        stop: stop strings; the completion text is cut before the first one found.
        stop_token_ids: extra stop ids (the model's eos ids are added unless ignore_eos).
        ignore_eos: do not stop at the model's eos ids.
        keep_kv: a finished sequence keeps its KV blocks (it is parked, not freed) until
            :meth:`Engine.resume` appends tokens and decodes on, or :meth:`Engine.release`
            frees it: a multi-turn trajectory continues the same sequence between turns.
    """
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] | list[str] = ()
    stop_token_ids: tuple[int, ...] | list[int] = ()
    ignore_eos: bool = False
    keep_kv: bool = False

    def check(self) -> str | None:
        """The first problem with these parameters, or None."""
        if not isinstance(self.n, int) or self.n <= 0:
            return f"n must be a positive integer (got {self.n!r})"
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            return f"max_tokens must be a positive integer (got {self.max_tokens!r})"
        if self.temperature < 0:
            return f"temperature must be >= 0 (got {self.temperature})"
        if self.top_k < 0:
            return f"top_k must be >= 0 (got {self.top_k})"
        if not 0 < self.top_p <= 1:
            return f"top_p must be in (0, 1] (got {self.top_p})"
        return None


@dataclass
class Request:
    """One prompt: text (tokenised as is, no template) or token ids."""
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    params: SamplingParams | None = None


@dataclass
class Completion:
    """One sample. ``logprobs``: under the distribution it was drawn from (temperature,
    top-k, top-p applied; 0.0 for greedy); ``raw_logprobs``: temperature 1, unfiltered."""
    token_ids: list[int]
    text: str | None
    logprobs: list[float]
    raw_logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    routing: object = None  # mixtures: [S, prompt + completion, k] expert ids (moe.RoutingLog)


@dataclass
class RequestOutput:
    """All samples of one request, in sample order; ``error`` set (and no samples) when the
    request was rejected."""
    index: int
    prompt_ids: list[int]
    samples: list[Completion] = field(default_factory=list)
    error: str | None = None


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED = 3
    PARKED = 4  # finished a turn, KV kept (resident, or on the host when ``swap`` is set)


class Sequence:
    """Token ids (prompt + completion) and where their KV lives.

    ``num_computed``: leading tokens whose KV is in the cache. Each step schedules some of
    the remaining ``len(token_ids) - num_computed`` tokens (all of them for decode, a chunk
    for a long prefill); when none remain, the last logits give the next token.

    A resumed sequence (a trajectory's next turn) treats its whole history as the prompt
    (``num_prompt``) and its new turn as the completion; ``turn`` counts resumptions and
    ``prefilled`` the prompt tokens this sequence ran through the model (measured per step).
    """

    def __init__(self, req_index: int, sample: int, prompt_ids: list[int],
                 params: SamplingParams, stop_ids: frozenset, arrival: int, seed: int = 0):
        self.req_index, self.sample = req_index, sample
        self.token_ids = list(prompt_ids)
        self.num_prompt = len(prompt_ids)
        self.params = params
        self.stop_ids = stop_ids
        self.arrival = arrival  # scheduling priority: lower runs first, preempted last
        self.num_computed = 0
        self.num_hashed = 0  # leading blocks whose prefix hash is registered
        self.block_table: list[int] = []
        self.status = Status.WAITING
        self.pending_fork = params.n if sample == 0 else 0  # samples still to fork at prefill end
        self.logprobs: list[float] = []
        self.raw_logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.text: str | None = None
        self.swap: tuple | None = None  # host copy of KV while swapped out
        self.seed = seed  # the request's seed (or the one the engine drew for it)
        self.key = row_key(seed, sample)  # random stream key (sampler.uniforms)
        self.routing = None  # mixtures: experts chosen per computed token (moe.RoutingLog)
        self.turn = 0
        self.prefilled = 0

    def fork(self, sample: int) -> "Sequence":
        """A sibling with the same tokens and (shared) blocks; the caller bumps refcounts."""
        s = Sequence.__new__(Sequence)
        s.__dict__.update(self.__dict__)
        s.sample, s.pending_fork = sample, 0
        s.token_ids, s.block_table = list(self.token_ids), list(self.block_table)
        s.logprobs, s.raw_logprobs = list(self.logprobs), list(self.raw_logprobs)
        s.key = row_key(self.seed, sample)
        s.routing = self.routing.copy() if self.routing is not None else None
        return s

    def __len__(self):
        return len(self.token_ids)

    @property
    def num_completion(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def completion_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def width(self) -> int:
        """Running slots this sequence will occupy (its pending samples before the fork)."""
        return max(1, self.pending_fork)
