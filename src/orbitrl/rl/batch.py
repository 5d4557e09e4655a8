"""Pack samples into one row for the trainer and score them chunk by chunk.

Every sample's prompt + completion is laid end to end in a single row (positions restart
per sample, attention stays inside it), so no padding is computed. The trainer needs the
log-probability of each completion token: the hidden state at the token before it is
projected to the vocabulary through the chunked ``token_logprobs`` (no [tokens, vocab]
logits), then scattered into padded [B, T] tensors that the loss functions take.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from orbitrl.model.decoder import Decoder
from orbitrl.rl.types import Sample
from orbitrl.train.logprobs import token_logprobs


@dataclass
class PackedBatch:
    input_ids: torch.Tensor   # [1, N]
    positions: torch.Tensor   # [1, N]
    seq_ids: torch.Tensor     # [1, N]
    src: torch.Tensor         # [M] row positions whose hidden state predicts a target
    targets: torch.Tensor     # [M] the completion tokens
    dst: torch.Tensor         # [M] flat index into the padded [B, T] layout
    mask: torch.Tensor        # [B, T] 1.0 on completion tokens
    rollout_logp: torch.Tensor  # [B, T]
    num_tokens: int

    @property
    def shape(self):
        return tuple(self.mask.shape)

    def pad(self, flat: torch.Tensor) -> torch.Tensor:
        """[M] -> [B, T] (zeros off the mask), differentiable."""
        out = flat.new_zeros(self.mask.numel())
        return out.index_put((self.dst,), flat).view(self.mask.shape)


def pack(samples: list[Sample], device) -> PackedBatch:
    B = len(samples)
    T = max(len(s.completion_ids) for s in samples)
    ids, pos, sid, src, tgt, dst = [], [], [], [], [], []
    mask = torch.zeros(B, T)
    rlp = torch.zeros(B, T)
    for b, s in enumerate(samples):
        start = len(ids)
        seq = s.prompt_ids + s.completion_ids
        ids += seq
        pos += range(len(seq))
        sid += [b] * len(seq)
        P, C = len(s.prompt_ids), len(s.completion_ids)
        src += range(start + P - 1, start + P - 1 + C)
        tgt += s.completion_ids
        dst += range(b * T, b * T + C)
        mask[b, :C] = 1.0
        rlp[b, :C] = torch.tensor(s.rollout_logprobs[:C])
    t = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
    return PackedBatch(t([ids]), t([pos]), t([sid]), t(src), t(tgt), t(dst), mask.to(device),
                       rlp.to(device), len(ids))


def micro_batches(samples: list[Sample], max_tokens: int) -> list[list[int]]:
    """Indices of samples grouped so each group's packed length stays under max_tokens."""
    groups, cur, n = [], [], 0
    for i, s in enumerate(samples):
        L = len(s.prompt_ids) + len(s.completion_ids)
        if cur and n + L > max_tokens:
            groups.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += L
    if cur:
        groups.append(cur)
    return groups


def score(model: Decoder, batch: PackedBatch, temperature: float = 1.0,
          with_entropy: bool = False, return_hidden: bool = False):
    """Log-probabilities [B, T] of the completion tokens; with ``with_entropy`` also the
    entropy [B, T]; with ``return_hidden`` also the hidden states [M, H] that predict them
    (for the critic)."""
    hidden = model(batch.input_ids, positions=batch.positions, seq_ids=batch.seq_ids,
                   return_hidden=True)[0][batch.src]
    out = token_logprobs(hidden, model.lm_head.weight, batch.targets,
                         temperature=temperature, with_entropy=with_entropy)
    res = (batch.pad(out[0]), batch.pad(out[1])) if with_entropy else (batch.pad(out),)
    if return_hidden:
        res = res + (hidden,)
    return res if len(res) > 1 else res[0]
