"""oneDNN GEMMs with prepacked weights for the engine's frozen fp32 projections on a CPU.

MKL's fp32 GEMM, which ``nn.Linear`` reaches on a CPU, streams a weight matrix at about
6 GB/s when the batch has a few rows (it repacks the weight on every call); gemv does 21 GB/s
but only for one row. oneDNN's inner product over a weight reordered once into its blocked
layout (``torch.ops.mkldnn._reorder_linear_weight``) ran a 32000 x 512 head at 4.3 ms for 4
rows and 6.0 ms for 12, against 12.3 and 17.3 ms through ``F.linear`` (one core), and gives
every row the same bits whatever the row count (1 to 512 rows checked), where MKL changes
kernel below 12 rows.

:class:`PackedLinears` picks the model's plain ``nn.Linear`` modules with fp32 weights on
the CPU (a loaded model's projections and head; in an adapter run, the head) and, while a
step runs (``with packed:``), routes their forward in the engine's thread through a packed
copy, made at the first call. The copy is remade whenever the weight changes (another
tensor, storage or version: an optimizer step or a ``load_state_dict`` in place), so the
engine still samples the model as it is. Memory: one packed copy of those weights, held by
the engine, only when they fit the budget (``Engine(packed_bytes=...)``, 512 MiB by default; an
RL run's rollout engine packs nothing, because the memory ledger does not price the copy). Any other thread, and any call that needs gradients, gets
``F.linear`` as before. LoRA modules and frozen quantized bases call ``F.linear`` on their
own weights and are not affected.
"""

from __future__ import annotations

import threading

import torch
import torch.nn as nn
import torch.nn.functional as F


def available() -> bool:
    """Whether this build has oneDNN's prepacked inner product."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                            "_reorder_linear_weight")


class PackedLinears:
    """Context manager over a model's fp32 ``nn.Linear`` modules on a CPU (see the
    module docstring). ``budget_bytes``: pack only if all of them take at most this; 0 turns
    it off. ``bytes`` is what the packed copies hold once made."""

    ROWS_HINT = 16  # the batch the weight layout is tuned for (any row count runs)

    def __init__(self, model: nn.Module, budget_bytes: int):
        mods = [m for m in model.modules() if type(m) is nn.Linear
                and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"]
        size = sum(m.weight.numel() * 4 for m in mods)
        self.mods = mods if mods and size <= budget_bytes and available() else []
        self._packed: dict[int, tuple] = {}
        self._thread = None

    @property
    def bytes(self) -> int:
        return sum(hit[-1].numel() * 4 for hit in self._packed.values())

    def __bool__(self) -> bool:
        return bool(self.mods)

    def __enter__(self):
        self._thread = threading.get_ident()
        for m in self.mods:
            m.forward = _Forward(self, m)
        return self

    def __exit__(self, *exc):
        for m in self.mods:
            m.__dict__.pop("forward", None)
        self._thread = None

    def packed(self, m: nn.Linear) -> torch.Tensor:
        w = m.weight
        key = (w.data_ptr(), w._version)
        hit = self._packed.get(id(m))
        if hit is None or hit[0] is not w or hit[1] != key:
            with torch.inference_mode(False), torch.no_grad():
                hit = (w, key, torch.ops.mkldnn._reorder_linear_weight(w.detach(),
                                                                       self.ROWS_HINT))
            self._packed[id(m)] = hit
        return hit[2]


class _Forward:
    """A module's forward while packed: oneDNN in the engine's thread, F.linear elsewhere."""

    __slots__ = ("owner", "mod")

    def __init__(self, owner: PackedLinears, mod: nn.Linear):
        self.owner, self.mod = owner, mod

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.mod
        if threading.get_ident() != self.owner._thread or x.dtype != torch.float32 or (
                torch.is_grad_enabled() and x.requires_grad):
            return F.linear(x, m.weight, m.bias)
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), self.owner.packed(m),
                                               m.bias, "none", [None], "")
        return y.view(*shape[:-1], y.shape[-1])
