"""Score a batch with one or more reward sources, under a per-call time limit.

A reward that raises, returns a non-number (a string, None, a tensor) or a non-finite
number, or runs past the limit scores 0.0 for that sample and is recorded as an error with
its reason, counted per source; training continues. Per-source metrics make a failing
verifier visible instead of passing for a wrong answer.

Timeouts: calls run on at most `max_workers` daemon worker threads that persist across
batches (`orbitrl/workpool.py`; a thread per call cost more than the call: 64 exact-match
calls took ~30 ms of thread start-ups per step); an idle worker exits after `IDLE_S` there.
Python cannot kill a thread, so a call that exceeds the limit is abandoned: its worker is
retired (it exits when the function returns; the result is discarded) and a fresh worker
takes its place, or the process exits first (daemon threads do not block exit). Each
abandoned call is counted in `leaked_threads`; a reward that hangs forever leaks one thread per call, so fix or drop such
a source. At most `max_workers` calls run at once (abandoned ones aside); a call's limit
starts when it starts, not when it was queued.

Batch sources: a reward with a ``score_batch(prompts, completions, fields)`` method (the
``code`` reward; a reward model, ``rl/reward_model.py``, which pads the batch into a few
forwards) is called once per batch, in the caller's thread, after the per-sample sources;
the thread limit above does not apply to it (the ``code`` reward enforces its own deadline:
it kills its programs). Its per-sample errors count like any other, and its metrics (counts by
outcome) are reported as ``reward_<src>_<key>``.
"""

from __future__ import annotations

import math
import numbers
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from orbitrl.rewards.registry import get_reward
from orbitrl.workpool import Worker, WorkerPool


@dataclass
class RewardSource:
    """One reward term: `weight * fn(prompt, completion, **fields, **kwargs)`.

    fn: a registered name, a "pkg.module:func" path or a callable; name: the metrics label
    (default: fn when it is a string, else the function's __name__); kwargs: fixed keyword
    arguments (e.g. {"format_pattern": "think_answer"}) that override same-named fields.
    """

    fn: str | Callable[..., float]
    weight: float = 1.0
    name: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.name is None:
            self.name = self.fn if isinstance(self.fn, str) else getattr(self.fn, "__name__", "reward")


@dataclass
class RewardError:
    """One failed call: sample index, source name, kind (exception, non_numeric, non_finite,
    timeout) and a one-line reason."""

    index: int
    source: str
    kind: str
    reason: str


@dataclass
class RewardResult:
    """rewards: [B] weighted sums; per_source: name -> [B] raw scores (0.0 where failed);
    errors: every failed call; details: what batch sources report per sample (the code
    reward: each test's status and reason); metrics: reward_mean, reward_<src>_mean (failed calls counted
    as 0, i.e. what training sees), reward_<src>_errors (exceptions and bad returns),
    reward_<src>_timeouts, reward_errors_total, reward_timeouts_total."""

    rewards: list[float]
    per_source: dict[str, list[float]]
    errors: list[RewardError]
    metrics: dict[str, float]
    details: dict[str, list[Any]] = field(default_factory=dict)  # batch sources: per sample


def _check_value(value: Any) -> tuple[float | None, str, str]:
    """(score, kind, reason): score None when the value is not a usable reward."""
    if not isinstance(value, numbers.Real):
        return None, "non_numeric", f"returned {type(value).__name__} {str(value)[:60]!r}, not a number"
    score = float(value)
    if not math.isfinite(score):
        return None, "non_finite", f"returned {score}"
    return score, "", ""


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def reply_after_thinking(completion: str, opened: bool = False) -> str:
    """The reply a reasoning model gives after its thoughts: the text after the last
    ``</think>``; a completion that opens ``<think>`` and never closes it has no reply (an
    empty string: a thought cut off by the length cap answers nothing), nor has one that
    never closes the ``<think>`` its prompt ``opened`` (a template that ends its generation
    prompt with ``<think>``, as DeepSeek-R1's distilled models' do); any other completion
    as it is."""
    cut = completion.rfind(THINK_CLOSE)
    if cut >= 0:
        return completion[cut + len(THINK_CLOSE):]
    if opened or completion.lstrip().startswith(THINK_OPEN):
        return ""
    return completion


def reads_thinking(fn) -> bool:
    """Whether a reward judges the whole completion, thoughts included (the format rewards,
    whose patterns may require a ``<think>`` block), rather than the reply."""
    return bool(getattr(fn, "reads_thinking", False))


class RewardRunner:
    """Calls reward sources on batches of samples, isolating failures and hangs.

    Args:
        sources: RewardSource list (a bare name, path or callable is one source of weight 1).
        timeout_s: per-call limit in seconds; None runs calls inline with no limit.
        max_workers: concurrent calls at most.
        strip_thinking: every source except those that read the thinking (``reads_thinking``)
            scores :func:`reply_after_thinking` of each completion (``reward.strip_thinking``).
        opened: the prompts end inside an open ``<think>`` (the chat template opens it):
            a completion that never closes it has no reply.
    """

    def __init__(self, sources: list[RewardSource | str | Callable[..., float]],
                 timeout_s: float | None = 10.0, max_workers: int = 4,
                 strip_thinking: bool = True, opened: bool = False):
        self.strip_thinking, self.opened = strip_thinking, opened
        self.sources = [s if isinstance(s, RewardSource) else RewardSource(s) for s in sources]
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"reward source names must be unique, got {names}")
        self._fns = [get_reward(s.fn) for s in self.sources]  # unknown names fail here
        self._reads = [reads_thinking(fn) for fn in self._fns]  # whole completion, per source
        self.timeout_s = timeout_s
        self.max_workers = max(1, int(max_workers))
        self.leaked_threads = 0
        # tasks: (_Job, call index)
        self._pool = WorkerPool(self._work, self.max_workers, "reward-worker")

    def reply(self, completion: str) -> str:
        """What the rewards that do not read the thinking score of ``completion``."""
        return reply_after_thinking(completion, self.opened) if self.strip_thinking \
            else completion

    def __call__(self, prompts: list[str], completions: list[str],
                 fields: list[dict[str, Any]] | None = None) -> RewardResult:
        """Score samples i = 0..B-1 with every source.

        Args:
            prompts, completions: B strings each.
            fields: B dicts of dataset fields (answer, ...) and extras (completion_ids...).

        Returns:
            RewardResult.
        """
        n = len(prompts)
        if len(completions) != n or (fields is not None and len(fields) != n):
            raise ValueError("prompts, completions and fields must have the same length")
        fields = fields if fields is not None else [{} for _ in range(n)]
        replies = [self.reply(c) for c in completions]
        seen = [completions if reads else replies for reads in self._reads]  # per source
        batch = [k for k, fn in enumerate(self._fns) if hasattr(fn, "score_batch")]
        calls = [(i, k) for k in range(len(self.sources)) if k not in batch for i in range(n)]
        outcomes = self._run(calls, prompts, [seen[k][i] for i, k in calls], fields)

        per_source = {s.name: [0.0] * n for s in self.sources}
        errors: list[RewardError] = []
        for (i, k), (kind, payload) in zip(calls, outcomes):
            src = self.sources[k]
            if kind == "ok":
                score, kind, payload = _check_value(payload)
                if score is not None:
                    per_source[src.name][i] = score
                    continue
            errors.append(RewardError(i, src.name, kind, payload))
        extra: dict[str, float] = {}
        details: dict[str, list[Any]] = {}
        for k in batch:
            self._run_batch(k, prompts, seen[k], fields, per_source, errors, extra, details)

        rewards = [sum(s.weight * per_source[s.name][i] for s in self.sources) for i in range(n)]
        metrics: dict[str, float] = {"reward_mean": sum(rewards) / n if n else 0.0}
        for s in self.sources:
            errs = [e for e in errors if e.source == s.name]
            metrics[f"reward_{s.name}_mean"] = sum(per_source[s.name]) / n if n else 0.0
            metrics[f"reward_{s.name}_errors"] = float(sum(e.kind != "timeout" for e in errs))
            metrics[f"reward_{s.name}_timeouts"] = float(sum(e.kind == "timeout" for e in errs))
        metrics["reward_errors_total"] = float(sum(e.kind != "timeout" for e in errors))
        metrics["reward_timeouts_total"] = float(sum(e.kind == "timeout" for e in errors))
        metrics.update(extra)
        return RewardResult(rewards, per_source, errors, metrics, details)

    def _run_batch(self, k, prompts, completions, fields, per_source, errors, extra,
                   details) -> None:
        """One call of batch source k over all samples; fills its scores, errors, metrics."""
        src = self.sources[k]
        rows = [{**row, **src.kwargs} for row in fields]
        try:
            out = self._fns[k].score_batch(prompts, completions, rows)
        except Exception as e:  # noqa: BLE001 - the whole batch failed: every sample errs
            reason = f"{type(e).__name__}: {' '.join(str(e).split())}"[:200]
            errors.extend(RewardError(i, src.name, "exception", reason)
                          for i in range(len(prompts)))
            return
        for i, score in enumerate(out.scores):
            if score is None:
                continue
            value, kind, reason = _check_value(score)
            if value is None:
                errors.append(RewardError(i, src.name, kind, reason))
            else:
                per_source[src.name][i] = value
        errors.extend(RewardError(i, src.name, kind, reason) for i, kind, reason in out.errors)
        extra.update({f"reward_{src.name}_{key}": float(v) for key, v in out.metrics.items()})
        details[src.name] = list(out.details)

    def _call(self, k: int, prompt: str, completion: str, row: dict[str, Any]) -> tuple[str, Any]:
        try:
            kwargs = {**row, **self.sources[k].kwargs}
            return "ok", self._fns[k](prompt, completion, **kwargs)
        except Exception as e:  # noqa: BLE001 - any failure of user code is a scored error
            return "exception", f"{type(e).__name__}: {' '.join(str(e).split())}"[:200]

    def _run(self, calls, prompts, texts, fields) -> list[tuple[str, Any]]:
        """Outcomes of ``calls`` ((sample, source) pairs), call j scoring ``texts[j]``."""
        if self.timeout_s is None:
            return [self._call(k, prompts[i], t, fields[i]) for (i, k), t in zip(calls, texts)]
        job = _Job(calls, prompts, texts, fields)
        results: list[tuple[str, Any] | None] = [None] * len(calls)
        for j in range(len(calls)):
            self._pool.tasks.put((job, j))
        pending = set(range(len(calls)))
        while pending:
            self._pool.staff(len(pending))
            now = time.monotonic()
            deadlines = [job.started[j][0] + self.timeout_s for j in pending
                         if j in job.started]
            wait = max(0.0, min(deadlines, default=now + self.timeout_s) - now)
            try:
                j, outcome = job.done.get(timeout=wait)
                if j in pending:
                    pending.discard(j)
                    results[j] = outcome
                continue
            except queue.Empty:
                pass
            now = time.monotonic()
            for j in [j for j in pending if j in job.started
                      and job.started[j][0] + self.timeout_s <= now]:
                pending.discard(j)
                self._pool.retire(job.started[j][1])
                self.leaked_threads += 1
                results[j] = ("timeout", f"exceeded the {self.timeout_s:g} s limit")
        return results  # type: ignore[return-value]

    def _work(self, task, w: Worker) -> None:
        job, j = task
        i, k = job.calls[j]
        job.started[j] = (time.monotonic(), w)
        job.done.put((j, self._call(k, job.prompts[i], job.texts[j], job.fields[i])))


class _Job:
    """One batch's calls; workers record when each starts and hand back outcomes."""

    def __init__(self, calls, prompts, texts, fields):
        # texts: each call's completion text (call j scores texts[j])
        self.calls, self.prompts, self.texts, self.fields = calls, prompts, texts, fields
        self.started: dict[int, tuple[float, Worker]] = {}
        self.done: queue.SimpleQueue = queue.SimpleQueue()
