"""Greedy and sampled evaluation of a task through the shared evaluation path
(``rl/evaluate.py`` :class:`Evaluator`: prompt encoding, the engine, progress).

The greedy pass gives pass@1 (greedy): one completion per problem at temperature 0. The
sampled pass draws n completions per problem (one request with n samples: they share the
prompt's KV blocks) and gives the unbiased pass@k for each k <= n (observe/passk.py).
Problems run in chunks of about two batches of samples, both passes' requests of a chunk in
one engine batch (a problem's greedy request shares its prompt's blocks with its samples);
after each chunk the summary so far is handed to ``on_chunk`` (``--out`` is rewritten), so a
stopped run leaves the problems it finished.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable

from tqdm import tqdm

from orbitrl.engine import Engine, SamplingParams
from orbitrl.engine.engine import kv_block_bytes
from orbitrl.engine.hf_generate import HFEngine
from orbitrl.errors import OrbitError
from orbitrl.evals.tasks import Task
from orbitrl.model.hf_fallback import HFDecoder
from orbitrl.model.tokenizer import encode_prompt, opens_thinking
from orbitrl.observe.passk import mean_pass_at_k, pass_at_k
from orbitrl.rewards.runner import reply_after_thinking
from orbitrl.rl.evaluate import Evaluator


@dataclass
class EvalOptions:
    """n: samples per problem for pass@k (0: greedy only); k: the k values reported
    (each <= n); temperature, top_p: of the sampled pass; max_tokens: completion cap
    (0: the task's default, at most half the model's context); seed: base seed (problem i
    uses seed * 1_000_003 + i); batch: sequences decoded at once; chat_template: wrap
    prompts in the model's template; greedy: run the greedy pass; packed_mb: the engine's
    budget for oneDNN-packed weight copies on a CPU in MiB (None: ``Engine``'s default)."""

    n: int = 0
    k: tuple[int, ...] = (1, 10)
    temperature: float = 0.8
    top_p: float = 0.95
    max_tokens: int = 0
    seed: int = 0
    batch: int = 64
    chat_template: bool = False
    greedy: bool = True
    packed_mb: int | None = None


def sized_engine(model, tok, batch: int, packed_mb: int | None = None
                 ) -> Callable[[int], object]:
    """(longest sequence in tokens) -> an engine whose KV pool holds ``batch`` of them (a
    model without native code: transformers' generate, ``batch`` rows per call)."""
    if isinstance(model, HFDecoder):
        return lambda longest: HFEngine(model, tok, max_num_seqs=batch)
    per_token = kv_block_bytes(model, None, 1)  # the engine's own formula (MLA's latent rows)
    kw = {} if packed_mb is None else {"packed_bytes": packed_mb << 20}
    return lambda longest: Engine(model, tok, kv_budget_bytes=batch * longest * per_token,
                                  max_num_seqs=batch, **kw)


def evaluate(task: Task, model, tok, opts: EvalOptions,
             on_chunk: Callable[[dict], None] | None = None) -> dict:
    """Run the task; returns the summary and per-problem rows (see docs/eval.md).
    ``on_chunk(result)``: called after each chunk with the problems finished so far."""
    bad = [k for k in opts.k if k < 1 or (opts.n and k > opts.n)]
    if opts.n and bad:
        raise OrbitError(f"--k {bad[0]}: pass@k needs k <= n (n = {opts.n})")
    context = model.config.context_length
    max_tokens = opts.max_tokens or min(task.max_tokens, context // 2)
    encode = partial(encode_prompt, tok, chat_template=opts.chat_template)
    ev = Evaluator(sized_engine(model, tok, opts.batch, opts.packed_mb), encode, None,
                   max_tokens, context=context)
    # a reasoning model's thoughts are not its answer: the task judges the reply after
    # them, and its stop strings (which a thought may contain, e.g. a code fence) are left
    # out; the thought ends at </think>, the reply at EOS or the cap
    reasoning = opts.chat_template and "<think>" in str(getattr(tok, "chat_template", ""))
    if reasoning:
        task = replace(task, stop=(), score=_judging_replies(task.score,
                                                             opens_thinking(tok, encode)))
    prompts = ev.encode_prompts([r["prompt"] for r in task.rows])
    t0 = time.perf_counter()
    result: dict = {"task": task.name, "problems": len(task.rows), "problems_done": 0,
                    "max_tokens": max_tokens, "unjudgeable": dict(task.errors),
                    "truncated_prompts": ev.truncated}
    rows = [{"id": r["id"], "error": task.errors.get(r["id"])} for r in task.rows]
    size = max(1, math.ceil(2 * opts.batch / (opts.n + opts.greedy)))
    for a in range(0, len(rows), size):
        b = min(len(rows), a + size)
        _chunk(task, ev, prompts, opts, max_tokens, a, b, rows)
        _summarise(result, rows[:b], opts)
        result["seconds"] = round(time.perf_counter() - t0, 1)
        result["engine"] = {k: ev.engine.summary()[k]
                            for k in ("generated_tokens", "tokens_per_s")}
        if on_chunk is not None:
            on_chunk(result)
    return result


def _judging_replies(score, opened: bool):
    """``score`` over the replies after the thinking of each completion (an unclosed
    thought: an empty reply)."""
    def judge(index, completions, progress):
        return score(index, [reply_after_thinking(c, opened) for c in completions], progress)
    return judge


def _params(opts: EvalOptions, max_tokens: int, stop, i: int) -> list[tuple]:
    """Problem ``i``'s requests as (kind, params): greedy (n = 1, temperature 0), then the
    n samples."""
    out = [("greedy", SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens, stop=stop))
           ] if opts.greedy else []
    if opts.n:
        out.append(("samples", SamplingParams(
            n=opts.n, temperature=opts.temperature, top_p=opts.top_p, max_tokens=max_tokens,
            stop=stop, seed=opts.seed * 1_000_003 + i)))
    return out


def _chunk(task: Task, ev, prompts, opts: EvalOptions, max_tokens: int, a: int, b: int,
           rows: list) -> None:
    """Problems a..b-1: generate both passes in one batch, judge, fill their rows."""
    reqs = [(i, kind, p) for i in range(a, b)
            for kind, p in _params(opts, max_tokens, task.stop, i)]
    what = " + ".join((["greedy"] if opts.greedy else []) + (
        [f"n={opts.n} at temperature {opts.temperature:g}, top_p {opts.top_p:g}"]
        if opts.n else []))
    texts = ev.complete([prompts[i] for i, _, _ in reqs], [p for _, _, p in reqs],
                        progress=True, label=f"problems {a + 1}-{b} of {len(rows)} ({what})")
    index = [i for (i, _, _), ts in zip(reqs, texts) for _ in ts]
    flat = [t for ts in texts for t in ts]
    with tqdm(total=len(flat), desc="judge", unit="completion", file=sys.stderr) as bar:
        verdicts = iter(task.score(index, flat, bar.update))
    for (i, kind, _), ts in zip(reqs, texts):
        vs = [next(verdicts) for _ in ts]
        if kind == "greedy":
            v = vs[0]
            rows[i]["greedy"] = {"passed": v.passed, "status": v.status, "reason": v.reason,
                                 "completion": ts[0]}
            continue
        c = sum(v.passed for v in vs)
        rows[i]["samples"] = {"n": len(vs), "correct": c,
                              **{f"pass@{k}": pass_at_k(len(vs), c, k) for k in opts.k},
                              "statuses": [v.status for v in vs], "completions": ts}


def _summarise(result: dict, done: list, opts: EvalOptions) -> None:
    """The summary over the problems finished so far; ``rows`` are those problems."""
    result["problems_done"] = len(done)
    if opts.greedy:
        passed = sum(r["greedy"]["passed"] for r in done)
        result["greedy"] = {"pass@1": passed / len(done), "passed": passed}
    if opts.n:
        counts = [(r["samples"]["n"], r["samples"]["correct"]) for r in done]
        result["sampled"] = {"n": opts.n, "temperature": opts.temperature,
                             "top_p": opts.top_p, "seed": opts.seed,
                             **{f"pass@{k}": mean_pass_at_k(counts, k) for k in opts.k}}
    result["rows"] = done
