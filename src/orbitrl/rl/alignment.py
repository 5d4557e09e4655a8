"""Engine-vs-trainer alignment, measured: collect the engine's and the trainer's next-token
logits over the same sampled tokens (observe/alignment.py turns them into figures).

Engine path: the rollout engine samples a completion for each prompt; a forward hook on
the engine model's ``lm_head`` records the logits the engine sampled each token from (one
request at a time, one sequence in flight, so each call holds exactly one row). Trainer
path: the prompt plus the sampled completion go through the trainer's packed forward
(``seq_ids``, as a training batch is packed) to its final hidden states; the logits are
those states times the head, and the sampled tokens' logprobs come from the trainer's own
chunked ``token_logprobs``.

``engine_model`` and ``trainer_model`` are one object when rollout and training share the
modules (the colocated default); two when the engine serves another copy (a merged export,
a separate rollout pool), which is what a weight mismatch looks like. A model without
native code (``model/hf_fallback.py``) samples through transformers' generate (HFEngine)
and recomputes through its padded forward: the figures are that fallback's own mismatch.

Two callers: training's periodic check (``log.align_every``, :func:`training_row`, from
``rl/trainer.py``) and ``orbitrl check-alignment`` (:func:`measure`, through
``evals/alignment.py``, which re-exports these). It lives in ``rl/`` because rl never
imports evals.
"""

from __future__ import annotations

import threading

import torch

from orbitrl.engine import Engine, Request, SamplingParams
from orbitrl.engine.engine import kv_block_bytes
from orbitrl.engine.hf_generate import HFEngine
from orbitrl.errors import OrbitError
from orbitrl.model.attention import soft_cap
from orbitrl.model.decoder import Decoder
from orbitrl.model.hf_fallback import HFDecoder
from orbitrl.observe.alignment import AlignmentBounds, compare, violations
from orbitrl.train.logprobs import token_logprobs


def engine_samples(model, tok, prompts: list[list[int]], max_tokens: int,
                   temperature: float, seed: int) -> list[tuple[list[int], torch.Tensor,
                                                                torch.Tensor]]:
    """(completion ids, engine logits [T, V], engine raw logprobs [T]) per prompt."""
    cfg = model.config
    fallback = isinstance(model, HFDecoder)
    if fallback:  # no native code: transformers' generate with its KV cache, as the rollout
        engine = HFEngine(model, tok, max_num_seqs=1)
    else:
        longest = max(len(p) for p in prompts) + max_tokens + 16
        # packed_bytes=0: the trainer's GEMMs (a run's rollout engine packs its weights
        # only with rollout.packed_weights on, or auto on a large enough model:
        # rl/rollout.py); the pool as the engine lays it out (a latent-attention model's
        # one row per token)
        engine = Engine(model, tok, max_num_seqs=1, packed_bytes=0,
                        kv_budget_bytes=-(-longest // 16) * kv_block_bytes(model, None, 16))
    rows: list[torch.Tensor] = []
    me = threading.get_ident()  # (a rollout thread may share the model: overlapped mode)

    cap = getattr(cfg, "final_softcap", None)  # the logits sampled from: Decoder.head

    def keep(module, inputs, output):
        if threading.get_ident() == me:
            # transformers' forward: [1, positions, V], the last position sampled from
            out = output.detach()[:, -1] if fallback else output.detach()
            rows.append(soft_cap(out, cap).float())

    hook = model.lm_head.register_forward_hook(keep)
    out = []
    try:
        for j, p in enumerate(prompts):
            rows.clear()
            res = engine.generate([Request(prompt_ids=p)], SamplingParams(
                n=1, max_tokens=max_tokens, temperature=temperature, seed=seed + j))[0]
            if res.error is not None:
                raise OrbitError(f"prompt {j}: rejected by the engine: {res.error}")
            s = res.samples[0]
            logits = torch.cat(rows) if rows else torch.empty(0)
            if logits.dim() != 2 or logits.shape[0] != len(s.token_ids):
                raise OrbitError(f"prompt {j}: the engine's head ran {len(rows)} times for "
                                 f"{len(s.token_ids)} tokens; cannot pair logits with tokens")
            out.append((list(s.token_ids), logits, torch.tensor(s.raw_logprobs)))
    finally:
        hook.remove()
    return out


@torch.no_grad()
def trainer_logits(model, prompts: list[list[int]], completions: list[list[int]]):
    """(logits [N, V], logprobs of the completion tokens [N]) from the trainer's packed
    forward, N = all completion tokens in prompt order."""
    seqs = [p + c for p, c in zip(prompts, completions)]
    ids, pos, sid = Decoder.packed_inputs(seqs, device=model.device)
    hidden = model(ids, positions=pos, seq_ids=sid, return_hidden=True)[0]  # [L, H]
    picks, targets, at = [], [], 0
    for p, c in zip(prompts, completions):
        picks += range(at + len(p) - 1, at + len(p) - 1 + len(c))
        targets += c
        at += len(p) + len(c)
    h = hidden[torch.tensor(picks, device=hidden.device)]
    w, cap = model.lm_head.weight, getattr(model.config, "final_softcap", None)
    logits = soft_cap(h.float() @ w.float().t(), cap)
    logp = token_logprobs(h, w, torch.tensor(targets, device=h.device), softcap=cap)
    return logits.cpu(), logp.float().cpu()


def measure(engine_model, trainer_model, tok, prompts: list[list[int]], max_tokens: int = 16,
            temperature: float = 1.0, seed: int = 0, top_k: int = 5) -> dict[str, float]:
    """Sample with the engine, recompute with the trainer, compare (observe/alignment)."""
    samples = engine_samples(engine_model, tok, prompts, max_tokens, temperature, seed)
    comps = [c for c, _, _ in samples]
    t_logits, t_logp = trainer_logits(trainer_model, prompts, comps)
    e_logits = torch.cat([x for _, x, _ in samples])
    e_logp = torch.cat([x for _, _, x in samples])
    return compare(e_logits, t_logits, e_logp, t_logp, top_k)


def training_row(model, tok, prompts: list[list[int]], max_tokens: int,
                 bounds=None) -> dict[str, float]:
    """The check inside training (``log.align_every``): the figures as ``align_*`` metrics,
    ``align_ok`` 1 or 0 against the default bounds. The model is put in eval mode for the
    check (LoRA dropout off, as the rollout sees it) and left as it was."""
    was_training = model.training
    model.eval()
    try:
        m = measure(model, model, tok, prompts, max_tokens=max_tokens)
    finally:
        model.train(was_training)
    row = {f"align_{k}": v for k, v in m.items() if k != "positions"}
    row["align_ok"] = float(not violations(m, bounds or AlignmentBounds()))
    return row
