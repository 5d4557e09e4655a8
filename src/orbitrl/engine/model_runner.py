"""One forward pass of the model over a scheduled batch, flattened into one row [1, N].

The runner holds the model object, not its weights: every step calls the model's modules as
they are at that moment, so after an optimizer step (or an adapter swap) the next rollout
samples the updated policy with nothing copied or synced.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from orbitrl.engine.decode_runner import resolve_backend
from orbitrl.engine.packed import PackedLinears
from orbitrl.engine.paged_attention import KVCache, PagedAttention
from orbitrl.engine.sequence import Sequence
from orbitrl.model.decoder import inference_safe
from orbitrl.model.gemm import onednn_gemms
from orbitrl.model.moe import ROW_FLOOR, Routing, record_routing, row_count, wants_routing


class RowPadded(TorchFunctionMode):
    """Runs every GEMM (``F.linear``, ``addmm``, ``mm``, ``matmul`` against a matrix) of a
    step of fewer than ``ROW_FLOOR`` tokens on ``moe.row_count`` rows (zero rows appended,
    dropped after): on a CPU a GEMM of such a row count takes other kernels and rounds each
    row differently from the trainer's larger batches, and the rollout's logprobs would
    carry that difference (docs/moe.md, "Routing replay"). Used for a mixture's short steps
    and the head; a dense model's short step pads its token rows instead (``_run``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _GEMMS and len(args) >= 2:
            a = 1 if func is torch.addmm else 0  # the row operand
            x, w = args[a], args[a + 1]
            if isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and \
                    x.dim() >= 2 and w.dim() == 2:
                m = x.numel() // x.shape[-1]
                if row_count(m) != m:
                    return _padded_gemm(func, a, list(args), kwargs, m)
        return func(*args, **kwargs)


def _padded_gemm(func, a: int, args: list, kwargs: dict, m: int):
    x = args[a]
    extra = row_count(m) - m
    args[a] = F.pad(x.reshape(m, x.shape[-1]), (0, 0, 0, extra))
    if a == 1:  # addmm's added matrix: broadcast to [m, n], padded alike
        c = args[0]
        args[0] = F.pad(c.expand(m, -1) if c.dim() < 2 else c, (0, 0, 0, extra))
    out = func(*args, **kwargs)[:m]
    return out.reshape(*x.shape[:-1], out.shape[-1])


_GEMMS = (F.linear, torch.addmm, torch.mm, torch.matmul, torch.Tensor.__matmul__,
          torch.Tensor.mm)


class ModelRunner:
    def __init__(self, model, cache: KVCache):
        self.model, self.cache = model, cache
        cfg = model.config
        self.windows, self.scale = cfg.sliding_windows, cfg.attn_scale
        self.softcap = cfg.attn_softcap  # Gemma 2's attention soft-capping
        self.packed = None  # the engine's PackedLinears (CPU), entered around each step
        # paged attention: "triton" (the kernels, the CUDA default) or "torch" (gather + SDPA)
        self.backend = resolve_backend(model.device, "auto", self.softcap is not None,
                                       cfg.mla is not None)

    def run(self, items: list[tuple[Sequence, int]]):
        """Compute ``num_new`` tokens of each sequence. Returns (logits [S, V] fp32, the S
        sequences that computed their last token and so sample next, in row order).

        Under ``torch.inference_mode`` where ``decoder.inference_safe`` (about 10% of a
        small model's decode step on a CPU: dispatch overhead), else ``no_grad``."""
        # a training run's rollout: LoRA's products on oneDNN too, as its trainer's
        # (model/gemm.py; the packed copies serve the projections themselves)
        with torch.inference_mode() if inference_safe(self.model) else torch.no_grad(), \
                self.packed or nullcontext(), \
                onednn_gemms(getattr(self.model, "rollout_gemms", ()), mode=False):
            return self._run(items)

    def _run(self, items: list[tuple[Sequence, int]]):
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
        # fp64 attention (model.attention_fp64) makes the rollout's logprobs the trainer's
        # to the bit, with the trainer's GEMMs. oneDNN's packed GEMMs (packed.py) round
        # otherwise: with them attention stays in fp64 only where the trainer multiplies
        # the same weights on oneDNN too (a training run's rollouts: ``rollout_gemms``,
        # model/gemm.py), else fp32 (``orbitrl generate``: a third of the time). Packed
        # steps read a GRPO group's shared prompt once (paged_attention.Cascade; ``packed``
        # is false when nothing would pack: weights made in inference mode)
        packed = bool(self.packed)
        exact = getattr(self.model, "attention_fp64", True) and (
            not packed or bool(getattr(self.model, "rollout_gemms", ())))
        attn = PagedAttention.build(self.cache, self.windows, self.scale,
                                    [(s.block_table, s.num_computed, n) for s, n in items],
                                    exact=exact, backend=self.backend, softcap=self.softcap,
                                    cascade=packed)
        # mixtures with routing replay: each token's experts, kept per sequence for training
        routing = Routing(record=True) if wants_routing(self.model) else None
        small = dev.type == "cpu" and len(ids) < ROW_FLOOR
        if small and getattr(self.model.config, "moe", None) is None:
            # a dense model runs a short step on row_count(N) token rows instead: every GEMM
            # then has the rows RowPadded would give it, without RowPadded's Python call per
            # op; the padding rows (token 0 at position 0) are ignored by the attention
            # backend and dropped at the head. Packed GEMMs round every row the same at
            # any row count: they only need the rows that make them fastest (packed.py)
            rows_to = max(len(ids), PackedLinears.MIN_ROWS) if packed else row_count(len(ids))
            extra = rows_to - len(ids)
            ids, pos, small = ids + [0] * extra, pos + [0] * extra, False
        ids_t = torch.tensor([ids], dtype=torch.long, device=dev)
        pos_t = torch.tensor([pos], dtype=torch.long, device=dev)
        with RowPadded() if small else nullcontext():
            hidden = self.model(ids_t, positions=pos_t, attn=attn, return_hidden=True,
                                routing=routing)[0]
        if routing is not None:
            record_routing(items, routing)
        if not rows:
            return None, done
        k = len(rows)
        if packed and k < PackedLinears.MIN_ROWS:  # the head's rows likewise (repeats)
            rows = rows + rows[-1:] * (PackedLinears.MIN_ROWS - k)
        last = hidden.index_select(0, torch.tensor(rows, device=dev))
        with RowPadded() if not packed and dev.type == "cpu" and k < ROW_FLOOR else \
                nullcontext():
            return self.model.head(last)[:k].float(), done
