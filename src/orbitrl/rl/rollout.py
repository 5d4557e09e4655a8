"""Rollout: a step's prompts through the engine into ``Sample``s (the first arrow of the step).

``Rollouts`` owns what sampling needs (the engine and its KV governor, the prompt encoding,
the data cursor, this rank's share) and is called with everything that differs between the
training thread and the overlapped producer thread (overlap.py): the sampling seed's index,
the stop poll and the exception it raises, the timer, whether to put the model in eval mode.
It calls nothing back in the trainer, so it runs the same on either thread.
"""

from __future__ import annotations

from typing import Callable

import torch

from orbitrl.engine import Engine, Request, SamplingParams
from orbitrl.engine.engine import kv_block_bytes
from orbitrl.engine.governor import available_memory
from orbitrl.engine.hf_generate import HFEngine
from orbitrl.engine.packed import packing_units, staging_bytes, unit_bytes
from orbitrl.errors import OrbitError
from orbitrl.ledger.runtime import (engine_kv_dtype, kv_pool_for_run,
                                    runtime_prediction)
from orbitrl.model.hf_fallback import HFDecoder
from orbitrl.model.lora import LoRALinear
from orbitrl.observe.memory import tensor_bytes
from orbitrl.rl.parallel import cores, intra_op_threads
from orbitrl.rl.types import Rollout, Sample


def generate(engine, prompts: list[list[int]], rows: list[dict], params: SamplingParams,
             version: int, seed: int, deadline_s: float | None = None,
             first: int = 0) -> list[Sample]:
    """n samples per prompt from the engine, groups adjacent, in prompt order. Past the
    watchdog deadline the engine drops unfinished samples; a group left with fewer than n
    samples is dropped whole (group statistics need all n). ``first``: the global index of
    ``prompts[0]`` in the step's batch (a rank's share starts there), so a prompt's sampling
    seed is the same whichever rank draws it."""
    reqs = [Request(prompt_ids=p, params=SamplingParams(**{**params.__dict__,
                                                            "seed": seed * 100003 + first + i}))
            for i, p in enumerate(prompts)]
    outs = engine.generate(reqs, deadline_s=deadline_s)
    samples = []
    for g, (out, p, row) in enumerate(zip(outs, prompts, rows)):
        if out.error is not None:
            raise OrbitError(f"rollout request {g}: {out.error}")
        if len(out.samples) < params.n:
            continue
        for c in out.samples:
            samples.append(Sample(first + g, p, c.token_ids, c.logprobs, c.finish_reason,
                                  c.text or "", row, version, routing=c.routing))
    return samples


class Rollouts:
    """Step rollouts for one run.

    Args:
        rollout: the run's ``rollout`` section.
        dist: the ``dist`` section (``rollout_weights``, ``reshard_after_forward``).
        seed: ``train.seed`` (each step's sampling seed derives from it).
        prompt_field: ``data.prompt_field``, the row field each prompt is read from.
        engine, governor: the engine and its KV governor (None: a fixed pool).
        model: the policy (eval mode for sampling on the training thread).
        encode: prompt text -> token ids, as training encodes it.
        data: the run's DataCursor.
        coll: the Collective (this rank's share of the prompts, sharded generation).
        turns: for a multi-turn environment (``env.name`` set), a factory of the trajectory
            runner (``rl.trajectory.trajectories_fn``), built at the first rollout; None for
            single-turn rollouts.
    """

    def __init__(self, rollout, dist, seed: int, prompt_field: str, engine, governor, model,
                 encode: Callable, data, coll, turns: Callable | None = None):
        self.r, self.dist, self.seed, self.field = rollout, dist, seed, prompt_field
        self.engine, self.governor, self.model = engine, governor, model
        self.encode, self.data, self.coll = encode, data, coll
        self._make_turns, self._turns = turns, None
        self.threads = rollout_threads(rollout, engine, coll.enabled)

    def sampling(self, deterministic_greedy: bool = False) -> SamplingParams:
        r = self.r
        if deterministic_greedy:
            return SamplingParams(n=1, max_tokens=r.max_tokens, temperature=0.0)
        return SamplingParams(n=r.n, max_tokens=r.max_tokens, temperature=r.temperature,
                              top_p=r.top_p, top_k=r.top_k)

    def weights(self):
        """The weights generation runs on: sharded in lockstep or gathered (one process:
        the model as it is)."""
        d = self.dist
        return self.coll.rollout_weights(self.model, d.rollout_weights,
                                         d.reshard_after_forward)

    def __call__(self, seed_index: int, version: int, stop: Callable[[], bool],
                 stop_error: type, timer, eval_mode: bool, prompts: int | None = None,
                 first: int = 0, timeout_s: float | None = None) -> Rollout:
        """This rank's samples of the next step's prompts, drawn with policy ``version``.

        Args:
            seed_index: the step's index in the sampling seed (the policy version on the
                training thread, the step number in the producer thread).
            stop: polled before each engine step; True aborts the rollout with ``stop_error``.
            timer: a PhaseTimer; the rollout's seconds go under ``rollout``.
            eval_mode: put the model in eval mode first (the producer thread samples an
                adapter view and never flips modes).
            prompts: how many prompts to draw over every rank (None:
                ``rollout.prompts_per_step``).
            first: how many of the step's prompts were drawn before these (dynamic
                sampling's further rounds, refill.py): their group indices and sampling
                seeds continue from there.
            timeout_s: the watchdog's limit for this round (None: ``rollout.timeout_s``;
                0: none).
        """
        r = self.r
        P = r.prompts_per_step if prompts is None else prompts
        a, b = self.coll.share(P)
        rows = self.data.draw(P)[a:b]
        timeout_s = r.timeout_s if timeout_s is None else timeout_s
        data_after = self.data.position()
        self.engine.memory_hook = self._hook(stop, stop_error)
        try:
            with timer.phase("rollout"), self.weights(), intra_op_threads(self.threads):
                if eval_mode:
                    self.model.eval()
                gen0 = self.engine.stats["generated_tokens"]
                wd0 = self.engine.stats.get("watchdog_events", 0)
                seed = self.seed * 7919 + seed_index
                env, logged = {}, []
                if self._make_turns is not None:
                    samples, env, logged = self.trajectories(rows, self.sampling(), version,
                                                             seed, first + a, seed_index,
                                                             timeout_s)
                else:
                    samples = generate(self.engine, [self.encode(x[self.field])
                                                     for x in rows], rows, self.sampling(),
                                       version, seed, deadline_s=timeout_s or None,
                                       first=first + a)
                gen_tokens = self.engine.stats["generated_tokens"] - gen0
        finally:
            self.engine.memory_hook = self.governor
            self.engine.release_packed()  # priced for the rollout phase only (packed_budget)
        return Rollout(samples=samples, gen_tokens=gen_tokens,
                       watchdog=self.engine.stats.get("watchdog_events", 0) - wd0,
                       timeline=list(self.engine.timeline), data_after=data_after,
                       governor=self.governor.state() if self.governor else {},
                       env=env, trajectories=logged)

    def trajectories(self, rows, params, version: int, seed: int, first: int = 0,
                     step: int = 0, timeout_s: float | None = None):
        """Samples of multi-turn trajectories (``env.name`` set), their metrics and the
        records to log (rl/trajectory.py)."""
        if self._turns is None:
            self._turns = self._make_turns()
        return self._turns(rows, params, version, seed, first, step, timeout_s)

    def _hook(self, stop, stop_error):
        """Before each engine step: a stop request aborts the rollout, then the governor."""
        gov = self.governor

        def hook(engine):
            if stop():
                engine.abort()
                raise stop_error()
            if gov is not None:
                gov(engine)
        return hook


def build_engine(cfg, model, tok, reference, device, prompt_len: int, devices: int):
    """The engine and its KV plan: the pool from ``rollout.kv_budget_mb`` or, at 0, from the
    memory training's predicted need leaves (``ledger.runtime.kv_pool_for_run``; the plan's
    ``cap`` bounds the governor's growth). Returns (engine, plan or None). A model
    without native code generates through transformers (``engine/hf_generate.py``, no
    pool, no plan)."""
    if isinstance(model, HFDecoder):
        return HFEngine(model, tok, seed=cfg.train.seed), None
    r, c = cfg.rollout, model.config
    kv_dtype = engine_kv_dtype(r.kv_dtype)
    plan, budget = None, int(r.kv_budget_mb * 2**20)
    bb = kv_block_bytes(model, kv_dtype, r.block_size)
    if not budget:
        plan = kv_pool_for_run(cfg, c.hf, prompt_len, bb, available=available_memory(device),
                               resident=tensor_bytes(model, reference, device=device),
                               device=device.type, devices=devices)
        budget = plan["blocks"] * bb
    packed = packed_budget(cfg, model, prompt_len, budget // bb, device, devices)
    engine = Engine(model, tok, kv_budget_bytes=budget, kv_dtype=kv_dtype,
                    block_size=r.block_size, seed=cfg.train.seed, packed_bytes=packed)
    # the trainer's forwards run these weights' GEMMs on oneDNN too (rl/batch.score,
    # model/gemm.py), packed in the rollout or not, and both sides LoRA's A and B: the
    # rollout's logprobs then round as the trainer's do
    model.rollout_gemms = (tuple(engine.packed.mods) + tuple(engine.packed.route_plain())
                           + tuple(ab for m in model.modules() if isinstance(m, LoRALinear)
                                   for ab in (m.lora_A, m.lora_B))) if engine.packed.mods else ()
    if plan is not None:
        engine.max_blocks = plan["cap"]
    return engine, plan


def rollout_threads(rollout, engine, distributed: bool) -> int:
    """``rollout.threads``, or for auto (0) every core when the rollout runs alone on packed
    weights: a colocated one-process CPU run whose engine packs (the training's side-by-side
    workers are idle then, one core each), with ``train.threads`` 1 (the process default).
    Else 0: the thread count stays. Packed rollouts already differ from the trainer's GEMMs
    in the last bits (TIS weighs it); the built-in models, unpacked, keep their bit-equal
    logprobs. The one-step overlap's rollout runs beside training: never more there."""
    if rollout.threads:
        return rollout.threads
    alone = not rollout.overlap and not distributed and torch.get_num_threads() == 1
    return cores() if alone and engine.packed.planned_bytes > 0 else 0


def packed_budget(cfg, model, prompt_len: int, kv_blocks: int, device, devices: int) -> int:
    """Bytes of oneDNN-packed weight copies (engine/packed.py) the rollout engine may make
    (``rollout.packed_weights``). They live for one rollout (``Rollouts`` frees them after
    it), so the ledger prices them in the rollout phase only (and oneDNN's state, kept after
    them, in every phase): ``auto`` takes what the predicted rollout phase leaves below the
    predicted training peak (less one unit's staging), so the copies never raise the run's
    peak (oneDNN's state does: ledger/runtime.py onednn_state_bytes), when that is at least
    ``PACKED_MIN_BYTES``; only for a colocated run in one process on a CPU (with the rollout
    beside training, or on rollout ranks that sync weights, the copies would sit beside
    training's memory or be remade at every sync)."""
    mode = cfg.rollout.packed_weights
    units = packing_units(model) if device.type == "cpu" else []
    packable = sum(unit_bytes(u) for u in units)
    if mode == "off" or not packable:
        return 0
    if mode == "on":
        return packable
    if cfg.rollout.overlap or cfg.schedule.shape != "colocated" or devices > 1 or \
            packable < PACKED_MIN_BYTES:
        return 0
    pred = runtime_prediction(cfg, model.config.hf, prompt_len, kv_blocks=kv_blocks,
                              device=device.type,
                              recompute=bool(getattr(model, "recompute", False)),
                              devices=devices)
    # (oneDNN's state is in both phases; the staging of one unit only in the rollout)
    left = pred["train"] - pred["rollout"] - staging_bytes(units)
    return min(packable, left) if left >= PACKED_MIN_BYTES else 0


# auto packs a model whose copies would take at least this (a few-row GEMM streams its
# weight 2-3x faster packed, engine/packed.py), so that oneDNN's state stays small beside
# what packing buys; below it, as for the built-in models, the rollout runs on the
# trainer's GEMMs, bit-equal
PACKED_MIN_BYTES = 256 << 20
