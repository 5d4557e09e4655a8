"""Pack samples into short rows for the trainer and score them chunk by chunk.

Samples' prompt + completion sequences are laid end to end in rows of at most ``L`` tokens
(``L``: the longest sample, at least ``ROW_TOKENS``), first fit in sample order; positions
restart per sample and attention stays inside it; a row's tail is padding (sequence id -1).
Rows, not one row for the whole batch: attention over a packed row is dense ([T, T] scores
per head, all but the diagonal blocks masked), so one row of N tokens costs N^2 while rows
of L cost N * L; padding costs a few tokens per row. At the built-in task's 64 samples x
about 16 tokens, one row computed a million masked score pairs per head for 16 thousand
useful ones, more than every projection of the forward together.

The samples of one prompt share one copy of it (``_layout``): a GRPO group of n samples is
laid out as [prompt][completion 1]...[completion n], each completion attending to the
prompt and to itself. At the built-in task's 8 x 8 samples this lays out about half the
tokens of one prompt copy per sample, and the forward and backward cost follows; a group
wider than the rows is laid out whole in a wider row when its attention costs no more
than its samples' own rows (a long chat prompt: SmolLM2's groups train on 175 positions
instead of 504).

The trainer needs the log-probability of each completion token: the hidden state at the
token before it is projected to the vocabulary through the chunked ``token_logprobs`` (no
[tokens, vocab] logits), then scattered into padded [B, T] tensors that the loss functions
take.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from orbitrl.ledger.memory import ROW_TOKENS as LEDGER_ROW_TOKENS
from orbitrl.ledger.memory import first_fit_rows, unit_layout
from orbitrl.model.decoder import Decoder
from orbitrl.model.gemm import onednn_gemms
from orbitrl.model.moe import replay_routing
from orbitrl.rl.types import Sample
from orbitrl.train.logprobs import token_logprobs


# minimum row length (rows of short samples hold a few samples each): the ledger's figure
ROW_TOKENS = LEDGER_ROW_TOKENS


@dataclass
class PackedBatch:
    input_ids: torch.Tensor   # [R, L] R rows of L tokens
    positions: torch.Tensor   # [R, L]
    seq_ids: torch.Tensor     # [R, L] sample index (a shared prompt: B + k), -1 on padding
    src: torch.Tensor         # [M] flat index into [R * L] whose hidden state predicts a target
    targets: torch.Tensor     # [M] the completion tokens
    dst: torch.Tensor         # [M] flat index into the padded [B, T] layout
    mask: torch.Tensor        # [B, T] 1.0 on completion tokens the policy sampled (a
    #                           trajectory's environment tokens are inputs and targets, mask 0)
    rollout_logp: torch.Tensor  # [B, T]
    num_tokens: int           # tokens laid out (padding excluded; a shared prompt once)
    parent_ids: torch.Tensor | None = None  # [R, L] the prompt a completion token reads
    routing: torch.Tensor | None = None  # mixtures: [S, R * L, k] experts to replay, -1 free

    @property
    def shape(self):
        return tuple(self.mask.shape)

    def pad(self, flat: torch.Tensor) -> torch.Tensor:
        """[M] -> [B, T] (zeros off the mask), differentiable."""
        out = flat.new_zeros(self.mask.numel())
        return out.index_put((self.dst,), flat).view(self.mask.shape)


def _layout(samples: list[Sample], row_tokens: int, share: bool
            ) -> tuple[list[list[int]], list[int], int]:
    """(units, their lengths, the row width): the samples of one prompt (same group, same
    prompt; each sample alone without ``share``) form one unit laid out as one copy of the
    prompt followed by every completion where ``ledger.memory.unit_layout`` shares it (the
    row widening to hold it), else each sample is its own unit; in order of first sample."""
    by_prompt: dict[tuple, list[int]] = {}
    for b, s in enumerate(samples):
        key = (s.group, tuple(s.prompt_ids)) if share else (b,)
        by_prompt.setdefault(key, []).append(b)
    groups = list(by_prompt.values())
    shared, ulens, width = unit_layout(
        [(len(samples[g[0]].prompt_ids), [len(samples[b].completion_ids) for b in g])
         for g in groups], row_tokens)
    units = []
    for g, sh in zip(groups, shared):
        units += [g] if sh else [[b] for b in g]
    return units, ulens, width


def pack(samples: list[Sample], device, row_tokens: int = ROW_TOKENS,
         share_prompts: bool = True) -> PackedBatch:
    """Samples -> rows of at most max(longest sample, ``row_tokens``, longest shared prompt
    unit) tokens, built on the
    host and moved to ``device`` in one copy per tensor. With ``share_prompts`` the samples
    of one prompt are laid out after a single copy of it (see ``_layout``): the prompt's
    tokens are computed once for the group, and each completion attends to that copy as its
    prefix (``parent_ids``), with positions continuing from it. The log-probabilities are
    the same as with one copy per sample, up to float rounding."""
    B = len(samples)
    T = max(len(s.completion_ids) for s in samples)
    units, ulens, width = _layout(samples, row_tokens, share_prompts)
    where, R, L = first_fit_rows(ulens, width)
    ids, pos, sid, par = [0] * (R * L), [0] * (R * L), [-1] * (R * L), [-1] * (R * L)
    src, tgt, dst, rlp, msk = [], [], [], [], []

    def lay(at: int, toks: list[int], p0: int, seq: int, parent: int) -> None:
        n = len(toks)
        ids[at:at + n], pos[at:at + n] = toks, range(p0, p0 + n)
        sid[at:at + n], par[at:at + n] = [seq] * n, [parent] * n

    for k, (u, (r, o)) in enumerate(zip(units, where)):
        prompt = samples[u[0]].prompt_ids
        P, at = len(prompt), r * L + o
        shared = B + k if len(u) > 1 else u[0]
        lay(at, prompt, 0, shared, shared)
        last, at = at + P - 1, at + P  # the prompt's last token predicts each first token
        for b in u:
            s = samples[b]
            C = len(s.completion_ids)
            lay(at, s.completion_ids, P, b, shared)
            src += [last] + list(range(at, at + C - 1)) if C else []
            tgt += s.completion_ids
            dst += range(b * T, b * T + C)
            rlp += s.rollout_logprobs[:C]
            msk += s.loss_mask[:C] if s.loss_mask is not None else [1.0] * C
            at += C
    dst_t = torch.tensor(dst, dtype=torch.long)
    mask = torch.zeros(B * T)
    mask[dst_t] = torch.tensor(msk, dtype=torch.float32)  # trajectories: 0 on env tokens
    rollout = torch.zeros(B * T)
    rollout[dst_t] = torch.tensor(rlp, dtype=torch.float32)
    t = lambda v: torch.tensor(v, dtype=torch.long).to(device)  # noqa: E731
    parent = t(par).view(R, L) if any(len(u) > 1 for u in units) else None
    return PackedBatch(t(ids).view(R, L), t(pos).view(R, L), t(sid).view(R, L), t(src),
                       t(tgt), dst_t.to(device), mask.view(B, T).to(device),
                       rollout.view(B, T).to(device), sum(ulens), parent)


def micro_batches(samples: list[Sample], max_tokens: int) -> list[list[int]]:
    """Indices of samples grouped so that each group's positions as ``pack`` lays them out
    (its rows x row length, padding included: what the forward computes and keeps for
    backward) stay within max_tokens; a sample longer than that is a group alone. Counting
    sample tokens alone let short samples fill a group to about twice the positions the
    memory ledger prices (rows padded to the longest: 3 samples of 179 tokens in 3 x 63)."""
    groups, cur = [], []
    for i in range(len(samples)):
        if cur and positions([samples[j] for j in cur + [i]]) > max_tokens:
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    return groups


def positions(samples: list[Sample], row_tokens: int = ROW_TOKENS,
              share_prompts: bool = True) -> int:
    """Rows x row length of ``pack(samples)``: the positions its forward computes."""
    _, ulens, width = _layout(samples, row_tokens, share_prompts)
    _, rows, length = first_fit_rows(ulens, width)
    return rows * length


def score(model: Decoder, batch: PackedBatch, temperature: float = 1.0,
          with_entropy: bool = False, return_hidden: bool = False, routing=None):
    """Log-probabilities [B, T] of the completion tokens; with ``with_entropy`` also the
    entropy [B, T]; with ``return_hidden`` also the hidden states [M, H] that predict them
    (for the critic). ``routing``: a mixture's ``moe.Routing`` for this forward; default
    replays ``batch.routing`` (the experts the engine used) when the model replays."""
    if routing is None:
        routing = replay_routing(model, batch.routing)
    # the weights the rollout engine multiplies on oneDNN: here too (model/gemm.py)
    with onednn_gemms(getattr(model, "rollout_gemms", ())):
        hidden = model(batch.input_ids, positions=batch.positions, seq_ids=batch.seq_ids,
                       parent_ids=batch.parent_ids, return_hidden=True,
                       routing=routing).flatten(0, 1)[batch.src]
        out = token_logprobs(hidden, model.lm_head.weight, batch.targets,
                             temperature=temperature, with_entropy=with_entropy,
                             softcap=getattr(model.config, "final_softcap", None))
    res = (batch.pad(out[0]), batch.pad(out[1])) if with_entropy else (batch.pad(out),)
    if return_hidden:
        res = res + (hidden,)
    return res if len(res) > 1 else res[0]
