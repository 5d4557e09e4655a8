"""Rollout for the transformers-backed policy (``model/hf_fallback.py``): its ``generate``
with transformers' KV cache, behind the part of :class:`Engine` the RL step and evaluation
use (``generate``, ``stats``, ``timeline``, ``rng``, ``memory_hook``, ``release_packed``,
``abort``, ``summary``).

Requests run in batches of at most ``max_num_seqs`` rows (each prompt repeated ``n``
times; prompts of one length together, unpadded: a model's absolute positions may ignore
an attention mask, and then a left-padded row would read other positions than the trainer
gives it), sampled at the request's temperature / top-k / top-p (temperature 0:
greedy), stopping at the eos ids, stop ids, stop strings and ``max_tokens``. A token's
logprob is the log-softmax of the scores it was drawn from (the logits over the
temperature, filtered; 0.0 for greedy), the one the trainer recomputes at
``rollout.temperature``; ``raw_logprobs`` are the unfiltered logits' at temperature 1. A
batch samples from torch's generator seeded with its first request's seed (under
``fork_rng``): a run repeats itself, but a sample's tokens depend on its batch, unlike the
native engine's per-sample streams. No paged pool: ``pool.num_blocks`` is 0 and the ledger
prices no KV.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from orbitrl.engine.engine import Engine
from orbitrl.engine.sequence import Completion, Request, RequestOutput, SamplingParams
from orbitrl.errors import OrbitError
from orbitrl.model.hf_fallback import HFDecoder

STREAM_ONLY = ("begin", "begin_stream", "add_request", "step", "resume", "release",
               "swap_parked", "reset_decode", "resize_pool", "weights_changed")


def _ids(x) -> list[int]:
    return [] if x is None else [int(i) for i in (x if isinstance(x, (list, tuple)) else [x])]


class HFEngine:
    """Generates from an :class:`HFDecoder` through transformers' ``generate``.

    Args:
        model: the HFDecoder (called as it is: the trainer's adapters included).
        tokenizer: for text prompts, stop strings and completion text.
        max_num_seqs: rows per ``generate`` call.
        seed: draws the seed of a request that has none.
        max_model_len: context length (default ``config.context_length``).
    """

    def __init__(self, model, tokenizer=None, *, max_num_seqs: int = 256, seed: int = 0,
                 max_model_len: int | None = None):
        from transformers import GenerationConfig  # start-up: the fallback's only

        cfg = model.config
        self.model, self.tokenizer, self.config = model, tokenizer, cfg
        self.max_model_len = max_model_len or cfg.context_length
        self.eos_ids = frozenset(_ids(cfg.eos_token_id)
                                 + _ids(getattr(tokenizer, "eos_token_id", None)))
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = pad if pad is not None else min(self.eos_ids, default=0)
        # the run's sampling settings only (a checkpoint's generation_config.json may set
        # top_k, temperature or penalties that would change what the trainer recomputes)
        model.hf.generation_config = GenerationConfig(pad_token_id=self.pad_id,
                                                      bos_token_id=cfg.bos_token_id)
        self.scheduler = SimpleNamespace(max_num_seqs=max_num_seqs)
        self.pool = SimpleNamespace(num_blocks=0, peak_used=0, block_size=0)
        self.packed = SimpleNamespace(planned_bytes=0, workspace_bytes=0, bytes=0, seconds=0.0)
        self.cache = None
        self.kv_plan, self.max_blocks = None, 0
        self.rng = torch.Generator().manual_seed(seed)
        self.memory_hook = None  # called before every decode step (rollout.py's stop poll)
        self.timeline: list[tuple[int, int, float]] = []
        self.stats = dict(steps=0, prompt_tokens=0, generated_tokens=0, seconds=0.0)

    def __getattr__(self, name):
        if name in STREAM_ONLY:
            raise OrbitError(f"engine.{name}: the transformers-backed policy generates whole "
                             "batches only (multi-turn environments, rollout.overlap and "
                             "separate rollout pools need a native model: docs/models.md)")
        raise AttributeError(name)

    def release_packed(self) -> None:
        pass

    def abort(self, which=None) -> list:
        return []  # (nothing runs between generate calls)

    def summary(self) -> dict:
        s = dict(self.stats, kv_blocks=0, kv_blocks_peak=0, kv_block_bytes=0, kv_bytes_peak=0,
                 blocks_allocated=0, prefix_hits=0, cow=0, preemptions=0, swaps=0,
                 packed_bytes=0, packed_seconds=0.0, parked_evictions=0)
        s["tokens_per_s"] = s["generated_tokens"] / s["seconds"] if s["seconds"] else 0.0
        return s

    def _validate(self, req: Request, p: SamplingParams) -> tuple[list[int], str | None]:
        if (err := p.check()) is not None:
            return [], err
        if req.prompt_ids is not None:
            ids = list(req.prompt_ids)
            if any(not isinstance(i, int) or not 0 <= i < self.config.vocab_size for i in ids):
                return [], f"prompt_ids must be integers in [0, {self.config.vocab_size})"
        elif req.prompt is not None and self.tokenizer is not None:
            ids = list(self.tokenizer(req.prompt)["input_ids"]) if req.prompt else []
        else:
            return [], "no prompt (give prompt_ids, or a prompt with a tokenizer)"
        if not ids:
            return [], "empty prompt"
        if len(ids) >= self.max_model_len:
            return [], (f"prompt has {len(ids)} tokens; the context is {self.max_model_len} "
                        "(no room for a completion)")
        return ids, None

    def generate(self, requests: list, params: SamplingParams | list | None = None, *,
                 progress: bool = False, stop_fn=None,
                 deadline_s: float | None = None) -> list[RequestOutput]:
        """As :meth:`Engine.generate`: one RequestOutput per request, in order; past
        ``deadline_s`` the unfinished samples are dropped."""
        reqs = [r if isinstance(r, Request) else
                Request(prompt=r) if isinstance(r, str) else Request(prompt_ids=list(r))
                for r in requests]
        plist = params if isinstance(params, list) else [params] * len(reqs)
        todo, outs = [], []
        for i, (r, p) in enumerate(zip(reqs, plist)):
            p = r.params or p or SamplingParams()
            ids, err = self._validate(r, p)
            outs.append(RequestOutput(i, ids, error=err))
            if err is None:
                seed = p.seed if p.seed is not None else int(
                    torch.randint(1 << 62, (), generator=self.rng))
                todo += [(i, j, ids, p, seed) for j in range(p.n)]
        t0 = time.perf_counter()
        done: dict[int, list] = {}
        # rows of one prompt length that sample and stop alike run together, max_num_seqs
        # at a time (no padding: a model's own positions may ignore the attention mask)
        key = lambda t: (len(t[2]), t[3].temperature, t[3].top_k, t[3].top_p,  # noqa: E731
                         tuple(sorted(t[3].stop_token_ids)), t[3].ignore_eos)
        groups: dict[tuple, list] = {}
        for t in todo:
            groups.setdefault(key(t), []).append(t)
        deadline = None if deadline_s is None else t0 + deadline_s
        for rows in groups.values():
            for a in range(0, len(rows), self.scheduler.max_num_seqs):
                chunk = rows[a:a + self.scheduler.max_num_seqs]
                for t, c in zip(chunk, self._run(chunk, stop_fn, deadline)):
                    if c is not None:
                        done.setdefault(t[0], []).append((t[1], c))
        self.stats["seconds"] += time.perf_counter() - t0
        for i, cs in done.items():
            outs[i].samples = [c for _, c in sorted(cs, key=lambda x: x[0])]
        return outs

    def _run(self, rows: list, stop_fn, deadline) -> list[Completion | None]:
        """One ``generate`` call over ``rows`` ((request, sample, prompt, params, seed));
        a row unfinished at the deadline comes back as None."""
        p0 = rows[0][3]
        dev = self.model.device
        ids = torch.tensor([r[2] for r in rows])  # [B, P] (one prompt length)
        width = ids.shape[1]
        new = min(max(r[3].max_tokens for r in rows), self.max_model_len - width)
        stop_ids = set(p0.stop_token_ids) | (set() if p0.ignore_eos else set(self.eos_ids))
        clock = _Clock(self, deadline)
        sample = p0.temperature > 0
        kw = dict(do_sample=True, temperature=p0.temperature, top_k=p0.top_k or None,
                  top_p=p0.top_p if p0.top_p < 1 else None) if sample else dict(do_sample=False)
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            torch.manual_seed(rows[0][4])
            with torch.no_grad():
                res = self.model.hf.generate(
                    input_ids=ids.to(dev), attention_mask=torch.ones_like(ids).to(dev),
                    max_new_tokens=new,
                    eos_token_id=sorted(stop_ids) or None, pad_token_id=self.pad_id,
                    output_scores=True, output_logits=True, return_dict_in_generate=True,
                    stopping_criteria=[clock], **kw)
        toks = res.sequences[:, width:].cpu()
        scores = torch.stack(res.scores, 1).float() if res.scores else None  # [B, T, V]
        raw = torch.stack(res.logits, 1).float()
        lp = (scores.log_softmax(-1).gather(-1, toks[..., None].to(scores.device))[..., 0].cpu()
              if sample else torch.zeros(toks.shape))
        raw_lp = raw.log_softmax(-1).gather(-1, toks[..., None].to(raw.device))[..., 0].cpu()
        self.stats["steps"] += toks.shape[1]
        self.stats["prompt_tokens"] += sum(len(r[2]) for r in rows)
        out = []
        for k, r in enumerate(rows):
            c = self._completion(r, toks[k].tolist(), lp[k].tolist(), raw_lp[k].tolist(),
                                 stop_ids, stop_fn)
            out.append(c)  # (None: cut by the watchdog)
            self.stats["generated_tokens"] += len(c.token_ids) if c is not None else 0
        self.stats["aborted"] = self.stats.get("aborted", 0) + out.count(None)
        return out

    def _completion(self, row, toks, lps, raws, stops, stop_fn) -> Completion | None:
        """The row's completion cut where it finished: its first stop id (or one of its
        stop strings, or ``stop_fn``), else ``max_tokens``; None if it did not finish."""
        req, j, prompt, p, _ = row
        room = self.max_model_len - len(prompt)
        for n in range(1, min(len(toks), p.max_tokens) + 1):
            if toks[n - 1] in stops or self._host_stop(p, toks[:n], req, j, stop_fn):
                return self._done(toks[:n], lps[:n], raws[:n], "stop", p)
            if n >= p.max_tokens or n >= room:
                return self._done(toks[:n], lps[:n], raws[:n], "length", p)
        return None

    def _host_stop(self, p, toks, req, j, stop_fn) -> bool:
        if p.stop and self.tokenizer is not None:
            tail = self.tokenizer.decode(toks[-(max(len(s) for s in p.stop) + 4):])
            if any(s in tail for s in p.stop):
                return True
        return stop_fn is not None and bool(stop_fn(req, j, toks))

    def _done(self, toks, lps, raws, reason: str, p) -> Completion:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(toks, skip_special_tokens=True)
            cuts = [text.find(s) for s in p.stop if s in text]
            text = text[:min(cuts)] if cuts else text
        return Completion(list(toks), text, list(lps), list(raws), reason)


class _Clock:
    """A stopping criterion that stops nothing early but the watchdog: before each decode
    step it calls the engine's ``memory_hook`` (the rollout's stop poll) and records the
    step in ``timeline``; past the deadline it ends every row."""

    def __init__(self, engine: HFEngine, deadline: float | None):
        self.engine, self.deadline, self.expired = engine, deadline, False
        self.t = time.perf_counter()

    def __call__(self, input_ids: torch.Tensor, scores, **_) -> torch.Tensor:
        e, now = self.engine, time.perf_counter()
        e.timeline.append((input_ids.shape[0], input_ids.shape[0], now - self.t))
        self.t = now
        if e.memory_hook is not None:
            e.memory_hook(e)
        if self.deadline is not None and now > self.deadline and not self.expired:
            self.expired = True
            e.stats["watchdog_events"] = e.stats.get("watchdog_events", 0) + 1
        return torch.full((input_ids.shape[0],), self.expired, dtype=torch.bool,
                          device=input_ids.device)


def engine_for(model, tokenizer=None, *, seed: int = 0, **paged):
    """The engine for ``model``: the paged :class:`orbitrl.engine.Engine` (``paged``: its
    keyword arguments) for a native decoder, :class:`HFEngine` for a model without native
    code (``model/hf_fallback.py``: no pool, no packed weights, so ``paged`` does not apply)."""
    if isinstance(model, HFDecoder):
        return HFEngine(model, tokenizer, seed=seed)
    return Engine(model, tokenizer, seed=seed, **paged)
