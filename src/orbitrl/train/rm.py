"""Reward-model training on preference pairs (``orbitrl rm``): the Bradley-Terry loss
``-log sigmoid(r_chosen - r_rejected)`` over a scalar head on a decoder (full fine-tuning,
AdamW), judged by held-out pair accuracy (the share of pairs with r_chosen > r_rejected).

A pair is a JSONL row ``{"prompt": ..., "chosen": ..., "rejected": ...}``; both replies are
read as ``train/reward_model.py`` ``reward_ids`` reads a rollout's completion, so the model
is trained on what it will score.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from orbitrl.data.datasets import jsonl_rows
from orbitrl.errors import OrbitError
from orbitrl.train.optim import lr_at
from orbitrl.train.reward_model import ScalarRewardModel, reward_ids

FIELDS = ("prompt", "chosen", "rejected")


@dataclass
class RMConfig:
    lr: float = 1e-5
    epochs: int = 1
    batch_size: int = 16  # pairs per step (twice as many rows per forward)
    warmup: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    seed: int = 0


def read_pairs(path: str | Path) -> list[dict]:
    """The pairs of a JSONL file; one-line errors name the file, the line and the field."""
    p = Path(path)
    if not p.is_file():
        raise OrbitError(f"{p}: pairs file not found")
    rows = []
    for n, row in jsonl_rows(p):
        for f in FIELDS:
            if f not in row:
                raise OrbitError(f"{p}: line {n} has no field {f!r} (a pair needs "
                                 f"{', '.join(FIELDS)})")
            if not isinstance(row[f], str):
                raise OrbitError(f"{p}: line {n}: field {f!r} is "
                                 f"{type(row[f]).__name__}, not a string")
        rows.append(row)
    if not rows:
        raise OrbitError(f"{p}: no pairs")
    return rows


def encode_pairs(tok, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    """(chosen ids, rejected ids) per pair."""
    return [tuple(reward_ids(tok, r["prompt"], r[k]) for k in ("chosen", "rejected"))
            for r in rows]


def split_pairs(pairs: list, fraction: float, seed: int) -> tuple[list, list]:
    """(train, held out): ``fraction`` of the pairs (at least one) held out at random."""
    idx = list(range(len(pairs)))
    random.Random(seed).shuffle(idx)
    k = max(1, round(len(pairs) * fraction))
    if k >= len(pairs):
        raise OrbitError(f"--held-out {fraction:g}: leaves no pair of {len(pairs)} to train on")
    return [pairs[i] for i in sorted(idx[k:])], [pairs[i] for i in sorted(idx[:k])]


def bt_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> torch.Tensor:
    """Mean Bradley-Terry loss over pairs (rewards [P] each)."""
    return -F.logsigmoid(r_chosen - r_rejected).mean()


def pair_accuracy(rm: ScalarRewardModel, pairs, batch_size: int = 16) -> float:
    """The share of pairs whose chosen reply scores above the rejected one."""
    if not pairs:
        return float("nan")
    c = rm.scores([a for a, _ in pairs], batch_size)
    r = rm.scores([b for _, b in pairs], batch_size)
    return sum(x > y for x, y in zip(c, r)) / len(pairs)


def train_rm(rm: ScalarRewardModel, pairs, cfg: RMConfig, progress=None) -> list[float]:
    """AdamW over every parameter, ``cfg.epochs`` passes over the shuffled pairs, the
    learning rate warmed up then cosine to 0; ``progress(step, loss)`` after each step.
    Returns the loss per step."""
    rng = random.Random(cfg.seed)
    params = [p for p in rm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    per_epoch = math.ceil(len(pairs) / cfg.batch_size)
    total, losses = cfg.epochs * per_epoch, []
    rm.train()
    for _ in range(cfg.epochs):
        order = rng.sample(range(len(pairs)), len(pairs))
        for b in range(per_epoch):
            batch = [pairs[i] for i in order[b * cfg.batch_size:(b + 1) * cfg.batch_size]]
            for g in opt.param_groups:
                g["lr"] = lr_at(len(losses), cfg.lr, warmup=cfg.warmup, total=total,
                                schedule="cosine")
            r = rm([c for c, _ in batch] + [x for _, x in batch])  # chosen rows, then rejected
            loss = bt_loss(r[:len(batch)], r[len(batch):])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            opt.step()
            losses.append(loss.item())
            if progress is not None:
                progress(len(losses) - 1, losses[-1])
    rm.eval()
    return losses
