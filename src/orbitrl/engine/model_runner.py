"""One forward pass of the model over a scheduled batch, flattened into one row [1, N].

The runner holds the model object, not its weights: every step calls the model's modules as
they are at that moment, so after an optimizer step (or an adapter swap) the next rollout
samples the updated policy with nothing copied or synced. One exception, on the CPU only:
the output head (see :class:`HeadCache`).
"""

from __future__ import annotations

import torch
from torch import nn

from orbitrl.engine.paged_attention import KVCache, PagedAttention
from orbitrl.engine.sequence import Sequence


class HeadCache:
    """The vocabulary projection with its weight stored ``[H, V]`` (column-major), CPU only.

    ``nn.Linear`` keeps the head ``[V, H]`` and computes ``x @ W.T``. For the few rows of a
    decode step that is a GEMV over the transposed operand, which MKL streams at well under
    the machine's bandwidth: a 32k x 512 head took 6.0 ms at one row and 12 ms at two, against
    2.4 ms and 4.6 ms as ``x @ W_t`` with ``W_t`` contiguous (one thread). The head is the
    largest matrix of a small model, so a batch-1 decode step went from 18 to 14 ms.

    The copy costs ``V * H`` elements (``nbytes``). :meth:`refresh` (called by the engine at
    the start of every ``generate``) remakes it when the weight may have changed: always if
    the head trains (``requires_grad``), else when its storage or version counter moved.
    ``release`` drops it (the engine does so after a rollout when the head trains, so the
    copy never sits through a training phase). Heads that are not a plain bias-free
    ``nn.Linear`` on the CPU (sharded, quantized, on a GPU) run as the model's own module.
    """

    def __init__(self, model, enabled: bool | None = None):
        self.model, self.t, self.key = model, None, None
        head = getattr(model, "lm_head", None)
        from orbitrl.dist.env import is_dtensor

        usable = (type(head) is nn.Linear and head.bias is None
                  and not is_dtensor(head.weight) and head.weight.device.type == "cpu")
        self.enabled = usable if enabled is None else (enabled and usable)

    @property
    def trains(self) -> bool:
        return self.model.lm_head.weight.requires_grad

    @property
    def nbytes(self) -> int:
        return 0 if self.t is None else self.t.numel() * self.t.element_size()

    def refresh(self) -> None:
        if not self.enabled:
            return
        w = self.model.lm_head.weight
        key = (w.data_ptr(), w._version, w.dtype, tuple(w.shape))
        if self.t is None or self.trains or key != self.key:
            self.t = None  # free the old copy before making the new one
            self.t, self.key = w.detach().t().contiguous(), key

    def release(self) -> None:
        self.t = self.key = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.t is None:
            return self.model.lm_head(x)
        return x.to(self.t.dtype) @ self.t


class ModelRunner:
    def __init__(self, model, cache: KVCache, head_copy: bool | None = None):
        self.model, self.cache = model, cache
        cfg = model.config
        self.windows, self.scale = cfg.sliding_windows, cfg.head_dim ** -0.5
        self.head = HeadCache(model, head_copy)

    @torch.no_grad()
    def run(self, items: list[tuple[Sequence, int]]):
        """Compute ``num_new`` tokens of each sequence. Returns (logits [S, V] fp32, the S
        sequences that computed their last token and so sample next, in row order)."""
        # decode tokens first: PagedAttention batches them in one call
        items = [it for it in items if it[1] == 1] + [it for it in items if it[1] != 1]
        ids, pos, rows, done = [], [], [], []
        for seq, n in items:
            c = seq.num_computed
            ids += seq.token_ids[c:c + n]
            pos += range(c, c + n)
            if c + n == len(seq):
                rows.append(len(ids) - 1)
                done.append(seq)
        dev = self.model.device
        attn = PagedAttention.build(self.cache, self.windows, self.scale,
                                    [(s.block_table, s.num_computed, n) for s, n in items])
        ids_t = torch.tensor([ids], dtype=torch.long, device=dev)
        pos_t = torch.tensor([pos], dtype=torch.long, device=dev)
        hidden = self.model(ids_t, positions=pos_t, attn=attn, return_hidden=True)[0]
        if not rows:
            return None, done
        last = hidden.index_select(0, torch.tensor(rows, device=dev))
        return self.head(last).float(), done
