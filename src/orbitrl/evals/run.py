"""Greedy and sampled evaluation of a task through the rollout engine.

The greedy pass gives pass@1 (greedy): one completion per problem at temperature 0. The
sampled pass draws n completions per problem (one request with n samples: they share the
prompt's KV blocks) and gives the unbiased pass@k for each k <= n (observe/passk.py). Both
show a progress bar over samples (rate and ETA), then one over judged programs.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from orbitrl.errors import OrbitError
from orbitrl.evals.tasks import Task
from orbitrl.observe.passk import mean_pass_at_k, pass_at_k


@dataclass
class EvalOptions:
    """n: samples per problem for pass@k (0: greedy only); k: the k values reported
    (each <= n); temperature, top_p: of the sampled pass; max_tokens: completion cap
    (0: the task's default, at most half the model's context); seed: base seed (request i uses seed * 1_000_003 + i);
    batch: sequences decoded at once; chat_template: wrap prompts in the model's template;
    greedy: run the greedy pass."""

    n: int = 0
    k: tuple[int, ...] = (1, 10)
    temperature: float = 0.8
    top_p: float = 0.95
    max_tokens: int = 0
    seed: int = 0
    batch: int = 64
    chat_template: bool = False
    greedy: bool = True


def _engine(model, tok, prompts: list[list[int]], opts: EvalOptions, max_tokens: int):
    """An engine whose KV pool holds ``batch`` of the longest sequences this run makes."""
    from orbitrl.engine import Engine
    from orbitrl.ledger.kv import kv_bytes_per_token

    cfg = model.config
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    longest = max(len(p) for p in prompts) + max_tokens + 16
    per_token = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype)
    return Engine(model, tok, kv_budget_bytes=opts.batch * longest * per_token,
                  max_num_seqs=opts.batch)


def _fit_context(prompts: list[list[int]], context: int,
                 max_tokens: int) -> tuple[list[list[int]], int]:
    """Prompts cut from the left to leave ``max_tokens`` of the context (a small model's
    context cannot hold a long question); returns them and how many were cut."""
    room = context - max_tokens
    if room < 1:
        raise OrbitError(f"--max-tokens {max_tokens}: the model's context is {context} "
                         f"tokens, leaving no room for a prompt")
    cut = sum(len(p) > room for p in prompts)
    if cut:
        print(f"{cut} of {len(prompts)} prompts cut from the left to {room} tokens (context "
              f"{context}, {max_tokens} for the completion)", file=sys.stderr)
    return [p[-room:] for p in prompts], cut


def _generate(engine, prompts, params_for, label: str) -> list[list[str]]:
    """Texts per prompt (n each); a rejected request is an error line, not an empty pass."""
    from orbitrl.engine import Request

    total = sum(params_for(i).n for i in range(len(prompts)))
    print(f"{label}: {len(prompts)} prompts, {total} samples", file=sys.stderr, flush=True)
    outs = engine.generate([Request(prompt_ids=p) for p in prompts],
                           [params_for(i) for i in range(len(prompts))], progress=True)
    texts = []
    for o in outs:
        if o.error is not None:
            raise OrbitError(f"prompt {o.index}: rejected by the engine: {o.error}")
        texts.append([s.text or "" for s in o.samples])
    return texts


def _judge(task: Task, index: list[int], texts: list[str], label: str) -> list:
    from tqdm import tqdm

    with tqdm(total=len(texts), desc=f"judge {label}", unit="completion",
              file=sys.stderr) as bar:
        return task.score(index, texts, bar.update)


def evaluate(task: Task, model, tok, opts: EvalOptions) -> dict:
    """Run the task; returns the summary and per-problem rows (see docs/eval.md)."""
    from orbitrl.engine import SamplingParams
    from orbitrl.model.tokenizer import encode_prompt

    bad = [k for k in opts.k if k < 1 or (opts.n and k > opts.n)]
    if opts.n and bad:
        raise OrbitError(f"--k {bad[0]}: pass@k needs k <= n (n = {opts.n})")
    context = model.config.max_position_embeddings
    max_tokens = opts.max_tokens or min(task.max_tokens, context // 2)
    prompts = [encode_prompt(tok, r["prompt"], opts.chat_template) for r in task.rows]
    prompts, cut = _fit_context(prompts, context, max_tokens)
    engine = _engine(model, tok, prompts, opts, max_tokens)
    t0 = time.perf_counter()
    result: dict = {"task": task.name, "problems": len(task.rows), "max_tokens": max_tokens,
                    "unjudgeable": dict(task.errors), "truncated_prompts": cut}
    rows = [{"id": r["id"], "error": task.errors.get(r["id"])} for r in task.rows]
    if opts.greedy:
        greedy = SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens, stop=task.stop)
        texts = [t[0] for t in _generate(engine, prompts, lambda i: greedy, "greedy")]
        verdicts = _judge(task, list(range(len(texts))), texts, "greedy")
        for row, text, v in zip(rows, texts, verdicts):
            row["greedy"] = {"passed": v.passed, "status": v.status, "reason": v.reason,
                             "completion": text}
        result["greedy"] = {"pass@1": sum(v.passed for v in verdicts) / len(verdicts),
                            "passed": sum(v.passed for v in verdicts)}
    if opts.n:
        _sampled(task, engine, prompts, opts, max_tokens, rows, result)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    result["engine"] = {k: engine.summary()[k] for k in ("generated_tokens", "tokens_per_s")}
    result["rows"] = rows
    return result


def _sampled(task: Task, engine, prompts, opts: EvalOptions, max_tokens: int, rows: list,
             result: dict) -> None:
    """The n-sample pass: fills each row's ``samples`` and the summary's pass@k."""
    from orbitrl.engine import SamplingParams

    def params(i):
        return SamplingParams(n=opts.n, temperature=opts.temperature, top_p=opts.top_p,
                              max_tokens=max_tokens, stop=task.stop,
                              seed=opts.seed * 1_000_003 + i)

    texts = _generate(engine, prompts, params, f"sampled (n={opts.n}, "
                      f"temperature {opts.temperature:g}, top_p {opts.top_p:g})")
    index = [i for i, ts in enumerate(texts) for _ in ts]
    verdicts = iter(_judge(task, index, [t for ts in texts for t in ts], "samples"))
    counts = []
    for row, ts in zip(rows, texts):
        vs = [next(verdicts) for _ in ts]
        c = sum(v.passed for v in vs)
        counts.append((len(vs), c))
        row["samples"] = {"n": len(vs), "correct": c,
                          **{f"pass@{k}": pass_at_k(len(vs), c, k) for k in opts.k},
                          "statuses": [v.status for v in vs], "completions": ts}
    result["sampled"] = {"n": opts.n, "temperature": opts.temperature, "top_p": opts.top_p,
                         "seed": opts.seed,
                         **{f"pass@{k}": mean_pass_at_k(counts, k) for k in opts.k}}
