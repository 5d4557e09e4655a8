"""The rollout engine: ``step()`` = schedule, run, postprocess.

Example::

    engine = Engine(orbitrl.load_model(path), orbitrl.load_tokenizer(path),
                    kv_budget_bytes=256 << 20)
    outs = engine.generate(["1+1="], SamplingParams(n=8, max_tokens=32, seed=0))
    outs[0].samples[3].token_ids, outs[0].samples[3].logprobs
"""

from __future__ import annotations

import bisect
import time
from dataclasses import replace

import torch
from tqdm import tqdm

from orbitrl.engine.block_pool import BlockPool
from orbitrl.engine.decode_runner import DecodeRunner, resolve_backend
from orbitrl.engine.decode_state import DecodeState
from orbitrl.engine.model_runner import ModelRunner
from orbitrl.engine.packed import PackedLinears
from orbitrl.engine.paged_attention import KVCache
from orbitrl.engine.sampler import row_key, sample
from orbitrl.engine.scheduler import Scheduler
from orbitrl.engine.sequence import (Completion, Request, RequestOutput, SamplingParams,
                                     Sequence, Status)
from orbitrl.errors import OrbitError
from orbitrl.ledger.kv import kv_blocks_for_budget, kv_bytes_per_block
from orbitrl.model.lora import _VIEW, lora_modules
from orbitrl.model.quant import FrozenLinear

FP8_NAMES = ("fp8", "float8_e4m3fn")


def kv_block_bytes(model, kv_dtype: str | None, block_size: int) -> int:
    """Bytes of one KV block of ``model`` in the model dtype (``kv_dtype`` None) or fp8
    (with its fp32 scales): the planner's formula (``ledger.kv.kv_bytes_per_block``)."""
    cfg, fp8 = model.config, kv_dtype in FP8_NAMES
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    heads, dim, value = cfg.kv_layout  # DeepSeek-V3: one latent row per token and layer
    return kv_bytes_per_block(cfg.num_layers, heads, dim, block_size, "fp8" if fp8 else dtype,
                              4 if fp8 else 0, latent_dim=0 if value else dim)


class _Launched:
    """A decode step launched (``DecodeRunner.launch``) whose values are not read yet:
    its runner handle, the sequences of its rows, their positions, whether stop strings
    or ``stop_fn`` are checked on the host, and its dead rows (sequences that finished at
    the step before it)."""

    __slots__ = ("handle", "seqs", "pos", "host", "dead")

    def __init__(self, handle, seqs: list[Sequence], pos, host: bool):
        self.handle, self.seqs, self.pos, self.host, self.dead = handle, seqs, pos, host, set()


def _ids(x) -> list[int]:
    if x is None:
        return []
    return [int(i) for i in (x if isinstance(x, (list, tuple)) else [x])]


class Engine:
    """Generates from a loaded :class:`orbitrl.model.Decoder` over a paged KV pool.

    Args:
        model: the decoder (called as it is at each step; never copied).
        tokenizer: HF tokenizer for text prompts, stop strings and completion text; optional
            when prompts are token ids.
        kv_budget_bytes: KV pool size in bytes; the block count comes from
            ``orbitrl.ledger.kv`` (the planner's formula). Default: half the free device
            memory on CUDA, else enough for ``max_num_seqs`` full contexts capped at 2 GiB.
        kv_dtype: None (model dtype) or "fp8" (e4m3 with a fp32 scale per token and head).
        block_size: tokens per KV block.
        max_num_seqs: sequences running at once (a request's n samples count n).
        max_num_batched_tokens: tokens per forward; longer prompts are prefilled in chunks.
        max_model_len: context length; default the model's ``config.context_length``
            (max_position_embeddings, times the factor of dynamic NTK scaling).
        preempt: "recompute" or "swap" when blocks run out; default swap on CUDA, recompute
            on CPU (where host and device memory are the same).
        seed: seeds the generator that draws a seed for each request without one.
        static_decode: run pure decode steps through the static-buffer decode runner
            (``decode_runner.py``: state on the device, CUDA graphs on CUDA); False sends
            every step through the general path (the reference the tests compare with).
            Default: on CUDA only; on CPUs the runner's bucket padding and masked KV writes
            made a decode step 10-20% slower than the general path (docs/engine.md). Never
            for mixtures of experts (their routing is recorded on the general path).
        cuda_graphs: capture the decode runner's steps as CUDA graphs (default: on CUDA).
        async_decode: with the static decode runner, launch decode step k+1 before reading
            step k's values, so that the host's per-token work (appending tokens, stop
            strings, ``stop_fn``, retiring finished rows, block bookkeeping) runs while the
            device computes; a finished row runs one extra step whose token is discarded.
            The samples are the same as without it (tested); logprobs round apart where
            the extra step changes a step's batch (a larger bucket's GEMM shapes on CUDA,
            a GRPO group that still counts the finished row for the Triton kernel's
            shared prompt read) or a sequence preempted for recomputation is re-admitted a
            step later (about 1e-7 in fp32). Off while a module of the model has forward
            hooks (they would see the extra steps). Default: on CUDA (where the step is
            queued and the host is free meanwhile); on a CPU the step runs on the host
            itself, so it only reorders the same work.
        packed_bytes: CPU: budget for oneDNN-packed copies of the fp32 projections
            (engine/packed.py: q/k/v and gate/up packed as one GEMM each; kept across
            batches while the weights do not change); 0 turns them off. With them, the
            engine's attention runs in fp32 (fp64 buys bit-equality with the trainer's
            logprobs only with the trainer's GEMMs) and the sampler keeps its [B, V]
            buffers between steps. An RL run's rollout engine passes the budget
            ``rollout.packed_weights`` gives (rl/rollout.py ``packed_budget``), runs what
            it leaves out on oneDNN over the plain weights (``packed.route_plain()``) and
            frees the copies after each rollout (``release_packed``).
        attention_backend: paged attention: "triton" (the kernels of attention_kernels.py,
            reading K/V blocks in place, a GRPO group's shared prompt once), "torch" (gather
            + SDPA: the reference; on a CPU fp64 with the trainer's GEMMs, fp32 with packed
            ones), or "auto" (Triton on CUDA when it is
            installed, else torch). Triton on a CPU runs in its interpreter
            (``TRITON_INTERPRET=1``), for tests; it computes in fp32, so there
            ``model.attention_fp64`` (rollout logprobs bit-equal to the trainer's) does not
            hold.
    """

    def __init__(self, model, tokenizer=None, *, kv_budget_bytes: int | None = None,
                 kv_dtype: str | None = None, block_size: int = 16, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 preempt: str | None = None, seed: int = 0, static_decode: bool | None = None,
                 cuda_graphs: bool | None = None, packed_bytes: int = 1 << 30,
                 attention_backend: str = "auto", async_decode: bool | None = None):
        cfg = model.config
        self.model, self.tokenizer, self.config = model, tokenizer, cfg
        dtype, device = next(model.parameters()).dtype, model.device
        fp8 = kv_dtype in FP8_NAMES
        if kv_dtype is not None and not fp8 and kv_dtype != str(dtype).removeprefix("torch."):
            raise OrbitError(f"kv_dtype {kv_dtype!r}: choose None (the model dtype) or 'fp8'")
        self.max_model_len = max_model_len or cfg.context_length
        self.block_bytes = kv_block_bytes(model, kv_dtype, block_size)
        if kv_budget_bytes is None:
            if device.type == "cuda":
                kv_budget_bytes = torch.cuda.mem_get_info(device)[0] // 2
            else:
                want = max_num_seqs * -(-self.max_model_len // block_size) * self.block_bytes
                kv_budget_bytes = min(want, 2 << 30)
        num_blocks = kv_blocks_for_budget(kv_budget_bytes, self.block_bytes)
        if num_blocks < 1:
            raise OrbitError(f"KV budget {kv_budget_bytes} bytes holds no block "
                             f"(one block is {self.block_bytes} bytes)")
        self.pool = BlockPool(num_blocks, block_size)
        self.max_blocks = num_blocks  # the pool may grow up to this (see resize_pool)
        heads, dim, value = cfg.kv_layout
        self.cache = KVCache(cfg.num_layers, heads, dim, num_blocks, block_size, dtype, device,
                             fp8=fp8, value=value)
        preempt = preempt or ("swap" if device.type == "cuda" else "recompute")
        if preempt not in ("swap", "recompute"):
            raise OrbitError(f"preempt {preempt!r}: choose 'swap' or 'recompute'")
        self.scheduler = Scheduler(self.pool, max_num_seqs, max_num_batched_tokens, preempt,
                                   swap_out=self._swap_out)
        self.runner = ModelRunner(model, self.cache)
        # paged attention: the Triton kernels on CUDA, gather + SDPA elsewhere (the reference,
        # and the only one for soft-capped scores)
        try:
            self.attention_backend = resolve_backend(device, attention_backend,
                                                     cfg.attn_softcap is not None,
                                                     cfg.mla is not None)
        except ValueError as e:
            raise OrbitError(str(e)) from None
        self.runner.backend = self.attention_backend
        # CPU: the frozen fp32 nn.Linear weights through oneDNN, packed once (packed.py)
        self.packed = PackedLinears(model, packed_bytes if device.type == "cpu" else 0)
        self.runner.packed = self.packed
        self._work = None  # the sampler's buffer (_sample_work)
        # mixtures run the general path: the expert grouping reads token counts on the host
        # (no graph capture) and the general path records the routing for replay
        moe = getattr(cfg, "moe", None) is not None
        self.static_decode = (device.type == "cuda" if static_decode is None
                              else static_decode) and not moe
        self.async_decode = (device.type == "cuda" if async_decode is None
                             else async_decode) and self.static_decode
        self._flight = None  # the decode step launched and not yet read (async_decode)
        self._early: list[Sequence] = []  # finished by a drained step, for the next step()
        self.decode = DecodeState(max_num_seqs, -(-self.max_model_len // block_size),
                                  block_size, self.max_model_len, device)
        self.decode_runner = DecodeRunner(model, self.cache, self.decode, graphs=cuda_graphs,
                                          backend=self.attention_backend)
        self.decode_runner.packed = self.packed
        self.eos_ids = frozenset(_ids(cfg.eos_token_id)
                                 + _ids(getattr(tokenizer, "eos_token_id", None)))
        self.rng = torch.Generator().manual_seed(seed)
        self._arrival = 0
        self._done: dict[int, list[Sequence]] = {}
        self.stop_fn = None
        self.memory_hook = None  # called before every step (the KV governor, governor.py)
        self.timeline: list[tuple[int, int, float]] = []
        self.stats = dict(steps=0, prompt_tokens=0, generated_tokens=0, seconds=0.0)

    # ---- requests -------------------------------------------------------------------
    def _validate(self, req: Request, p: SamplingParams) -> tuple[list[int], str | None]:
        if (err := p.check()) is not None:
            return [], err
        vocab = self.config.vocab_size
        if req.prompt_ids is not None:
            ids = list(req.prompt_ids)
            if any(not isinstance(i, int) or not 0 <= i < vocab for i in ids):
                return [], f"prompt_ids must be integers in [0, {vocab})"
        elif req.prompt is not None:
            if self.tokenizer is None:
                return [], "a text prompt needs a tokenizer (or pass prompt_ids)"
            ids = list(self.tokenizer(req.prompt)["input_ids"]) if req.prompt else []
        else:
            return [], "no prompt (give prompt or prompt_ids)"
        if not ids:
            return [], "empty prompt"
        if len(ids) >= self.max_model_len:
            return [], (f"prompt has {len(ids)} tokens; the context is {self.max_model_len} "
                        "(no room for a completion)")
        bad = [t for t in p.stop_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            return [], f"unknown stop token id {bad[0]!r} (vocabulary is [0, {vocab}))"
        need, most = self._blocks_for(len(ids), p.max_tokens), max(self.pool.num_blocks,
                                                                    self.max_blocks)
        if need > most:
            return [], (f"one sample needs {need} KV blocks; the pool has {most} (raise the "
                        "KV budget or lower max_tokens)")
        return ids, None

    def _blocks_for(self, prompt_len: int, max_tokens: int) -> int:
        return -(-min(prompt_len + max_tokens, self.max_model_len) // self.pool.block_size)

    def min_blocks(self) -> int:
        """The smallest pool that lets every queued sample finish (one at a time, through
        preemption): the largest single sample's blocks."""
        sch = self.scheduler
        return max([self._blocks_for(s.num_prompt, s.params.max_tokens)
                    for s in sch.waiting + sch.running + sch.swapped] or [1])

    def resize_pool(self, num_blocks: int) -> int:
        """Grow or shrink the KV pool (between steps). Shrinking preempts the sequences that
        hold blocks past the new end (recomputed or swapped back later, as when the pool runs
        out) and releases the memory; never below :meth:`min_blocks`. Returns the new size."""
        num_blocks = max(int(num_blocks), self.min_blocks())
        if num_blocks != self.pool.num_blocks:
            self._settle()  # (the step in flight reads and writes the old cache)
        if num_blocks < self.pool.num_blocks:
            sch = self.scheduler
            for seq in [s for s in sch.running if any(b >= num_blocks for b in s.block_table)]:
                sch.running.remove(seq)
                sch._preempt(seq)
            # trajectories waiting for their environment: to host memory
            for seq in [s for s in sch.parked if s.swap is None
                        and any(b >= num_blocks for b in s.block_table)]:
                sch.evict_parked(seq)
        if num_blocks != self.pool.num_blocks:
            self.pool.resize(num_blocks)
            self.cache.resize(num_blocks)
            self.decode_runner.invalidate()  # graphs point at the old cache tensors
        return num_blocks

    def add_request(self, index: int, req: Request, params: SamplingParams) -> RequestOutput:
        """Queue one request; returns its output record (``error`` set if rejected)."""
        ids, err = self._validate(req, params)
        out = RequestOutput(index, ids, error=err)
        if err is None:
            stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos
                                                      else self.eos_ids)
            seed = params.seed if params.seed is not None else int(
                torch.randint(1 << 62, (), generator=self.rng))
            self.scheduler.add(Sequence(index, 0, ids, params, stop, self._arrival, seed))
            self._arrival += 1
        return out

    def generate(self, requests: list, params: SamplingParams | list | None = None, *,
                 progress: bool = False, stop_fn=None,
                 deadline_s: float | None = None) -> list[RequestOutput]:
        """Generate for a batch of requests.

        Args:
            requests: each a :class:`Request`, a text prompt, or a list of token ids.
            params: one SamplingParams for all, one per request, or None (a Request's own
                ``params`` wins, else defaults).
            progress: show a tqdm bar over samples.
            stop_fn: optional ``(request_index, sample, completion_ids) -> bool`` checked
                after every token; True ends that sample (finish_reason "stop").
            deadline_s: watchdog; past this many seconds every unfinished sample is dropped
                and its KV released (counted in ``stats["aborted"]``); finished samples are
                returned as usual, so a request may come back with fewer than n samples.
        Returns:
            one RequestOutput per request, in input order; rejected requests carry ``error``
            and no samples, and do not affect the others.
        """
        reqs = [r if isinstance(r, Request) else
                Request(prompt=r) if isinstance(r, str) else Request(prompt_ids=list(r))
                for r in requests]
        plist = params if isinstance(params, list) else [params] * len(reqs)
        outs = self.begin([(r, r.params or p or SamplingParams())
                           for r, p in zip(reqs, plist)], stop_fn)
        total = sum(r.params.n if r.params else (p or SamplingParams()).n
                    for r, p, o in zip(reqs, plist, outs) if o.error is None)
        t0 = time.perf_counter()
        with tqdm(total=total, disable=not progress, unit="sample") as bar:
            while self.scheduler.has_work():
                if self.memory_hook is not None:
                    self.memory_hook(self)
                if deadline_s is not None and time.perf_counter() - t0 > deadline_s:
                    dropped = self.abort()
                    self.stats["aborted"] = self.stats.get("aborted", 0) + len(dropped)
                    self.stats["watchdog_events"] = self.stats.get("watchdog_events", 0) + 1
                    break
                bar.update(len(self.step()))
            self._settle()  # the step in flight (async_decode) ran finished rows only
            self._early = []  # (every sample is in _done)
        self.stats["seconds"] += time.perf_counter() - t0
        for i, seqs in self._done.items():
            outs[i].samples = [Completion(s.completion_ids, s.text, s.logprobs, s.raw_logprobs,
                                          s.finish_reason,
                                          s.routing and s.routing.tensor(len(s)))
                               for s in sorted(seqs, key=lambda s: s.sample)]
        return outs

    def begin_stream(self) -> None:
        """Start a stream of requests added one at a time (``add_request``, then ``step``
        until each finishes), as ``generate`` starts a batch: a rollout rank of separate
        pools keeps one stream for the whole run."""
        self._settle()  # (first: the step in flight may hash blocks)
        self.pool.reset_prefix_cache()
        self.stop_fn, self._done, self.timeline, self._early = None, {}, [], []
        self.decode_runner.begin(*_adapter_signature(self.model))
        self.packed.reset()

    def release_packed(self) -> None:
        """Free the packed weight copies and the sampler's kept buffer (remade by the next
        ``generate``): an RL run holds them for its rollout phase only."""
        self.packed.reset(keep=False)
        self._work = None

    def weights_changed(self, recompute: bool) -> int:
        """The weights were replaced between two steps. Cached prefixes are stale; with
        ``recompute`` every unfinished sample drops its KV and is re-prefilled (prompt and
        tokens so far) under the new weights, else it continues on the KV it has. Returns
        the samples cut."""
        self._settle()  # the step in flight ran on the old weights, as a sync one
        self.pool.reset_prefix_cache()
        self.packed.reset(keep=False)
        if not recompute:
            return 0
        sch = self.scheduler
        cut = sch.running + sch.swapped
        for seq in cut:
            self.pool.free_seq(seq)
            seq.swap = None
            sch.add(seq)
        sch.running, sch.swapped = [], []
        return len(cut)

    def begin(self, requests: list[tuple[Request, SamplingParams]], stop_fn=None
              ) -> list[RequestOutput]:
        """Start a batch: queue ``(request, params)`` pairs and reset the per-batch state.
        ``generate`` runs it to the end; a caller that drives :meth:`step` itself (the
        multi-turn rollout, which resumes sequences between steps) calls this first."""
        self._settle()
        if not self.scheduler.has_work() and not self.scheduler.parked:
            # the weights may have changed since the last call: cached prefixes are stale
            self.pool.reset_prefix_cache()
        outs = [self.add_request(i, r, p) for i, (r, p) in enumerate(requests)]
        self.stop_fn, self._done, self.timeline, self._early = stop_fn, {}, [], []
        self.decode_runner.begin(*_adapter_signature(self.model))
        self.packed.reset()
        if self.pool.num_blocks < (least := self.min_blocks()):  # a throttled pool must
            self.resize_pool(least)                               # fit each sample
        return outs

    # ---- trajectories: parked sequences ------------------------------------------------
    def resume(self, seq: Sequence, new_ids: list[int], max_tokens: int | None = None) -> None:
        """Continue a parked sequence (finished with ``keep_kv``): append ``new_ids`` (an
        environment's tokens) and decode its next turn. Its KV stays as it is, resident or
        on the host (swapped back in when scheduled), so the next prefill computes only
        the tokens not yet in the cache: ``new_ids`` and the previous turn's last token.
        The history becomes the prompt, the logprobs start over, the random stream moves
        to a new key; ``max_tokens`` caps the new turn (default the request's)."""
        self._settle()
        if seq.status != Status.PARKED:
            raise OrbitError(f"resume: sequence {seq.req_index}/{seq.sample} is not parked")
        vocab = self.config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in new_ids):
            raise OrbitError(f"resume: token ids must be integers in [0, {vocab})")
        if len(seq) + len(new_ids) >= self.max_model_len:
            raise OrbitError(f"resume: {len(seq) + len(new_ids)} tokens leave no room in the "
                             f"context of {self.max_model_len}")
        seq.token_ids += list(new_ids)
        seq.num_prompt = len(seq.token_ids)
        seq.logprobs, seq.raw_logprobs = [], []
        seq.finish_reason = seq.text = None
        seq.turn += 1
        seq.key = row_key(seq.seed + 1_000_003 * seq.turn, seq.sample)
        if max_tokens is not None:
            seq.params = replace(seq.params, max_tokens=int(max_tokens))
        sch = self.scheduler
        sch.parked.remove(seq)
        if seq.swap is not None:
            seq.status = Status.SWAPPED
            bisect.insort(sch.swapped, seq, key=lambda s: (s.arrival, s.sample))
        else:
            sch.add_running(seq)

    def swap_parked(self, seq: Sequence) -> int:
        """Copy a parked sequence's KV to host memory and free its blocks while its
        environment runs (``resume`` swaps it back in); returns the bytes copied."""
        if seq.swap is not None:
            return 0
        before = self.stats.get("kv_swapped_bytes", 0)
        self.scheduler.evict_parked(seq)
        return self.stats.get("kv_swapped_bytes", 0) - before

    def release(self, seq: Sequence) -> None:
        """Free a parked sequence's KV for good (its trajectory ended)."""
        self.scheduler.release(seq)

    # ---- the loop ----------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """One forward over a scheduled batch; returns the sequences that finished. Pure
        decode steps go through the static decode runner; the rest (prefill, chunked
        prefill, admission, swap-in, preemption) through the general path."""
        if self._decode_ready():
            done = self._decode_step()
            if done is not None:
                return self._with_early(done)
        self._settle()
        if not self.scheduler.has_work():  # the step in flight finished every sequence
            return self._with_early([])
        batch = self.scheduler.schedule()
        if not batch.items:
            raise RuntimeError("engine: scheduler made no progress (pool too small?)")
        for seq in batch.swap_in:
            self.cache.load(seq.block_table, seq.swap)
            self.stats["kv_swapped_in_bytes"] = (self.stats.get("kv_swapped_in_bytes", 0)
                                                 + _nbytes(seq.swap))
            seq.swap = None
        self.cache.copy_blocks(batch.copies)
        t0 = time.perf_counter()
        logits, seqs = self.runner.run(batch.items)
        out = self.postprocess(batch.items, logits, seqs)
        # (sequences in the batch, tokens computed, seconds): the long tail shows up as
        # steps with few sequences (see orbitrl.observe.flops)
        self.timeline.append((len(batch.items), sum(n for _, n in batch.items),
                              time.perf_counter() - t0))
        return self._with_early(out)

    def _with_early(self, finished: list[Sequence]) -> list[Sequence]:
        """``finished`` after the sequences a drained step finished (see _drain)."""
        if self._early:
            finished, self._early = self._early + finished, []
        return finished

    def postprocess(self, items, logits, seqs: list[Sequence]) -> list[Sequence]:
        for seq, n in items:
            seq.prefilled += max(0, min(n, seq.num_prompt - seq.num_computed))
            seq.num_computed += n
            self.pool.commit(seq)
        self.stats["steps"] += 1
        self.stats["prompt_tokens"] += sum(max(0, min(n, s.num_prompt - s.num_computed + n))
                                           for s, n in items)
        if not seqs:
            return []
        targets, rows = [], []
        for r, seq in enumerate(seqs):
            group = [seq] + [seq.fork(j) for j in range(1, seq.pending_fork)]
            for child in group[1:]:
                self.pool.fork(child)
                self.scheduler.add_running(child)
            seq.pending_fork = 0
            targets += group
            rows += [r] * len(group)
        if rows != list(range(len(seqs))):
            logits = logits[torch.tensor(rows, device=logits.device)]
        toks, lps, raws = sample(logits, [s.params for s in targets], [s.key for s in targets],
                                 [s.num_completion for s in targets],
                                 work=self._sample_work(2 * logits.numel()))
        finished = []
        for seq, t, lp, raw in zip(targets, toks.tolist(), lps.tolist(), raws.tolist()):
            seq.token_ids.append(t)
            seq.logprobs.append(lp)
            seq.raw_logprobs.append(raw)
            self.stats["generated_tokens"] += 1
            reason = self._finish_reason(seq, t)
            if reason is not None:
                seq.finish_reason = reason
                self._finalize_text(seq)
                self.scheduler.finish(seq)
                self._done.setdefault(seq.req_index, []).append(seq)
                finished.append(seq)
        return finished

    SAMPLE_WORK_BYTES = 128 << 20

    def _sample_work(self, numel: int) -> torch.Tensor | None:
        """The sampler's [B, V] intermediates, kept between steps (a fresh tensor pays its
        page faults at every step on a CPU): with the CPU fast path only (the engine's
        packed weights, ``packed_bytes`` > 0), up to SAMPLE_WORK_BYTES; grown as needed,
        held by the engine until ``release_packed``."""
        if not self.packed.mods or numel * 4 > self.SAMPLE_WORK_BYTES:
            return None
        if self._work is None or self._work.numel() < numel:
            self._work = torch.empty(numel, dtype=torch.float32)
        return self._work

    def _finish_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if tok in seq.stop_ids or self._host_stop(seq):
            return "stop"
        if seq.num_completion >= p.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    def _host_stop(self, seq: Sequence) -> bool:
        """The stop conditions only the host can check: stop strings and ``stop_fn``."""
        p = seq.params
        if p.stop and self.tokenizer is not None:
            width = max(len(s) for s in p.stop) + 4
            tail = self.tokenizer.decode(seq.completion_ids[-width:])
            if any(s in tail for s in p.stop):
                return True
        return self.stop_fn is not None and bool(self.stop_fn(seq.req_index, seq.sample,
                                                              seq.completion_ids))

    # ---- the decode fast path --------------------------------------------------------
    def _decode_ready(self) -> bool:
        """Whether this step is pure decode: every running sequence has all but its last
        token computed, none waits to fork, nothing is swapped out, and no waiting request
        could be admitted now (that step would prefill it)."""
        sch, st = self.scheduler, self.decode
        run = sch.running
        if (not self.static_decode or not run or sch.swapped or len(run) > st.capacity
                or len(run) > sch.max_tokens):
            return False
        if sch.waiting and len(run) + sch.waiting[0].width <= sch.max_num_seqs and \
                -(-len(sch.waiting[0]) // self.pool.block_size) <= self.pool.num_free:
            return False
        if st.valid and st.n == len(run):
            return True
        return all(s.num_computed == len(s) - 1 and not s.pending_fork for s in run)

    def _decode_step(self) -> list[Sequence] | None:
        """One step of the static decode runner; None (nothing done) when the pool is
        short of blocks (the general path then preempts). With ``async_decode`` the step
        is launched before the previous one's values are read: the host appends that
        step's tokens, checks its stop conditions and retires its finished rows while the
        device runs this one (a row that finished runs one extra step, discarded)."""
        st, t0 = self.decode, time.perf_counter()
        n = st.n
        if st.valid and n == len(self.scheduler.running):
            if self._flight is not None and (st.pos_h[:n] > st.last_h[:n]).all():
                self._drain()  # every row ends at the step in flight: launch no other
                return []
            copies = st.prepare(self.pool)
            if copies is None and self._flight is not None:
                # the blocks of the rows the step in flight finished are not free yet:
                # read it (as the synchronous engine would have), then try again
                self._drain()
                if not st.n:
                    return []
                copies = st.prepare(self.pool)
        else:
            assert self._flight is None, "a reset drains the step in flight"
            copies = st.register(list(self.scheduler.running), self.pool)
        if copies is None:
            return None
        self.cache.copy_blocks(copies)
        st.flush()
        n = st.n
        launched = _Launched(self.decode_runner.launch(), list(st.seqs), st.pos_h[:n].copy(),
                             self.stop_fn is not None or (self.tokenizer is not None
                                                          and st.stop_strings > 0))
        for seq in launched.seqs:
            seq.num_computed += 1  # the step writes the KV of each row's last token
        st.advance()
        self.stats["steps"] += 1
        # not while hooked: a hook would see the extra step of a finished row
        if self.async_decode and not self.decode_runner.hooked:
            prev, self._flight = self._flight, launched
            finished = self._finish_step(prev, launched) if prev is not None else []
            if not st.n:  # every row of the step in flight is dead: nothing to overlap
                self._drain()
        else:
            finished = self._finish_step(launched, None)
        # (rows, tokens kept: a dead row's token is discarded, seconds)
        self.timeline.append((n, n - len(launched.dead), time.perf_counter() - t0))
        return finished

    def _finish_step(self, done: "_Launched", nxt: "_Launched | None") -> list[Sequence]:
        """Read a launched decode step's values: append each live row's token, register
        the KV blocks it filled, retire the rows that finished. ``nxt``: the step launched
        after it (async), whose rows of those sequences become dead."""
        vals = self.decode_runner.fetch(done.handle)
        bs, host, live, ended = self.pool.block_size, done.host, 0, []
        for row, (seq, (t, lp, raw, why)) in enumerate(zip(done.seqs, vals)):
            if row in done.dead or seq.status is not Status.RUNNING:
                continue
            live += 1
            seq.token_ids.append(int(t))
            seq.logprobs.append(lp)
            seq.raw_logprobs.append(raw)
            computed = int(done.pos[row]) + 1
            if computed % bs == 0:  # a block just filled
                self.pool.commit(seq, computed)
            if why or host:
                reason = "stop" if why == 1 or (host and self._host_stop(seq)) else \
                    "length" if why == 2 else None
                if reason is not None:
                    ended.append((seq, reason, computed))
        self.stats["generated_tokens"] += live
        if not ended:
            return []
        for seq, reason, computed in ended:
            # a step launched since may have written one more token's KV, into a block
            # claimed for it: the sequence keeps what this step left (a parked turn holds
            # the blocks it would hold without the overlap; a block freed here is reused
            # only by work queued after that step)
            seq.num_computed = computed
            self.pool.trim(seq, -(-computed // bs))
            seq.finish_reason = reason
            self._finalize_text(seq)
            self.scheduler.finish(seq)
            self._done.setdefault(seq.req_index, []).append(seq)
        where = {id(s): r for r, s in enumerate(self.decode.seqs)}
        rows = [where[id(seq)] for seq, _, _ in ended]
        self.decode.remove(rows)
        if nxt is not None:
            nxt.dead.update(rows)  # nxt was launched on the layout before this removal
        return [seq for seq, _, _ in ended]

    def _drain(self) -> None:
        """Read the decode step in flight, if any (async_decode); the sequences it
        finished are returned by the next :meth:`step`."""
        if self._flight is not None:
            launched, self._flight = self._flight, None
            self.decode.flush()  # the removal queued since its launch, before another
            self._early += self._finish_step(launched, None)

    def _settle(self) -> None:
        """Read the decode step in flight and forget the decode rows (before anything that
        changes the running sequences outside a step: an abort, a pool resize, new
        weights, a resumed turn); the sequences it finished come back from the next
        :meth:`step`."""
        self._drain()
        self.decode.reset()

    def reset_decode(self) -> list[Sequence]:
        """For a caller that drives :meth:`step` itself: read the decode step in flight
        (``async_decode``) and forget the decode rows, before it changes what the engine
        runs (new weights, an abort). Returns the sequences that step finished (with any
        other finished sequence not yet returned by ``step``): the caller's now."""
        self._settle()
        return self._with_early([])

    def abort(self, which=None) -> list[Sequence]:
        """Drop the unfinished sequences ``which(seq)`` selects (all when None), parked
        ones included, and release their KV; the step in flight is read first, and a
        sequence it finishes is not dropped (the next :meth:`step` returns it)."""
        self._settle()
        return self.scheduler.abort(which or (lambda seq: True))

    def _finalize_text(self, seq: Sequence) -> None:
        if self.tokenizer is None:
            return
        text = self.tokenizer.decode(seq.completion_ids, skip_special_tokens=True)
        cuts = [text.find(s) for s in seq.params.stop if s in text]
        seq.text = text[:min(cuts)] if cuts else text

    def _swap_out(self, seq: Sequence) -> None:
        seq.swap = self.cache.save(seq.block_table, seq.num_computed)
        self.stats["kv_swapped_bytes"] = self.stats.get("kv_swapped_bytes", 0) + _nbytes(seq.swap)
        computed = seq.num_computed
        self.pool.free_seq(seq)
        seq.num_computed = computed

    def summary(self) -> dict:
        """Counters for the progress summary and the tests."""
        s = dict(self.stats)
        s.update(kv_blocks=self.pool.num_blocks, kv_blocks_peak=self.pool.peak_used,
                 kv_block_bytes=self.block_bytes, kv_bytes_peak=self.pool.peak_used * self.block_bytes,
                 blocks_allocated=self.pool.allocated, prefix_hits=self.pool.prefix_hits,
                 cow=self.pool.cow, preemptions=self.scheduler.num_preempted,
                 swaps=self.scheduler.num_swapped, packed_bytes=self.packed.bytes,
                 packed_seconds=self.packed.seconds,
                 parked_evictions=self.scheduler.num_parked_evicted)
        s["tokens_per_s"] = s["generated_tokens"] / s["seconds"] if s["seconds"] else 0.0
        return s


def _nbytes(saved: tuple) -> int:
    return sum(t.numel() * t.element_size() for t in saved)


def _adapter_signature(model) -> tuple:
    """What a captured decode graph bakes in besides the addresses the runner checks: each
    LoRA module's switch, the addresses of the frozen projections' kept dequantized
    copies (``quant.cache_dequantized``: a copy remade elsewhere would leave a graph
    reading freed memory), and the thread's adapter view (``lora.adapter_view``). Under a
    view the switches are not read (a view is always on), so they are left out: the
    training thread toggling them (``adapters_disabled`` for the reference pass,
    rollout.overlap) must not drop the rollout thread's graphs."""
    view = getattr(_VIEW, "tensors", None)
    kept = tuple(m._cached[1].data_ptr() for m in model.modules()
                 if isinstance(m, FrozenLinear) and m._cached is not None)
    if view is not None:
        return (None, kept), view
    return (tuple(m.enabled for m in lora_modules(model).values()), kept), view
