"""oneDNN GEMMs with prepacked weights for the engine's fp32 projections on a CPU.

MKL's fp32 GEMM, which ``nn.Linear`` reaches on a CPU, streams a weight matrix at about
6 GB/s when the batch has a few rows (it repacks the weight on every call); gemv does 21 GB/s
but only for one row. oneDNN's inner product over a weight reordered once into its blocked
layout (``torch.ops.mkldnn._reorder_linear_weight``) ran a 32000 x 512 head at 4.3 ms for 4
rows and 6.0 ms for 12, against 12.3 and 17.3 ms through ``F.linear`` (one core), and gives
every row the same bits whatever the row count (1 to 512 rows checked), where MKL changes
kernel below 12 rows.

:class:`PackedLinears` picks the model's plain ``nn.Linear`` modules with fp32 weights on
the CPU that a forward calls (a loaded model's projections and head, a LoRA module's plain
base layer; not the LoRA A/B matrices, which the LoRA module multiplies itself, nor weights
that are views into a larger tensor, such as a mixture's stacked experts) and, while a step
runs (``with packed:``), routes their forward in the engine's thread through a packed copy
made at the first call. The copies are dropped at the start of every ``generate`` (and of a
stream, and on ``Engine.weights_changed``), so each batch samples the weights as they are
then; within a batch a copy is remade if its weight becomes another tensor or storage or
its version moves. (An in-place change that bumps no version, ``p.data.copy_`` or a fused
optimizer step, is seen from the next ``generate`` on.)

Memory: one packed copy of those weights, held by the engine, only when they fit the budget
(``Engine(packed_bytes=...)``, 512 MiB by default; an RL run's rollout engine packs nothing,
because the memory ledger does not price the copy). Nothing is packed while the model has
forward hooks (layer tiers and sharding swap weights in through them), for weights made
under ``torch.inference_mode``, or for calls that need gradients; any other thread gets
``F.linear`` as before.
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


def _candidates(model: nn.Module) -> list[nn.Linear]:
    out = []
    for name, m in model.named_modules():
        if type(m) is not nn.Linear or name.rsplit(".", 1)[-1] in ("lora_A", "lora_B"):
            continue
        w = m.weight
        if w.dtype == torch.float32 and w.device.type == "cpu" and w.numel() and \
                w.untyped_storage().nbytes() == w.numel() * w.element_size():
            out.append(m)
    return out


class PackedLinears:
    """Context manager over a model's fp32 ``nn.Linear`` modules on a CPU (see the module
    docstring). ``budget_bytes``: pack only if all of them take at most this; 0 turns it
    off. ``bytes``: what the packed copies hold now."""

    ROWS_HINT = 16  # the batch the weight layout is tuned for (any row count runs)

    def __init__(self, model: nn.Module, budget_bytes: int):
        self.model = model
        mods = _candidates(model) if budget_bytes > 0 and available() else []
        size = sum(m.weight.numel() * 4 for m in mods)
        self.mods = mods if size <= budget_bytes else []
        self._forwards = [(m, _Forward(self, m)) for m in self.mods]  # made once
        self.active = bool(self.mods)
        self._packed: dict[int, tuple] = {}
        self._thread = None

    @property
    def bytes(self) -> int:
        return sum(hit[1].numel() * 4 for hit in self._packed.values())

    def reset(self) -> None:
        """At the start of a batch: drop every copy (the weights may have changed since)
        and pack only while the model has no forward hooks."""
        self._packed = {}
        self.active = bool(self.mods) and not any(
            m._forward_hooks or m._forward_pre_hooks for m in self.model.modules())

    def __bool__(self) -> bool:
        return self.active

    def __enter__(self):
        self._thread = threading.get_ident()
        for m, fwd in self._forwards:
            m.forward = fwd
        return self

    def __exit__(self, *exc):
        for m in self.mods:
            m.__dict__.pop("forward", None)
        self._thread = None

    def packed(self, m: nn.Linear) -> torch.Tensor | None:
        """``m``'s packed weight, made or remade as needed; None if it cannot be packed."""
        w = m.weight
        if w.is_inference():  # no version counter to watch
            return None
        key = (id(w), w.data_ptr(), w._version)
        hit = self._packed.get(id(m))
        if hit is None or hit[0] != key:
            with torch.inference_mode(False), torch.no_grad():
                hit = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach(),
                                                                    self.ROWS_HINT))
            self._packed[id(m)] = hit
        return hit[1]


class _Forward:
    """A module's forward while packed: oneDNN in the engine's thread, F.linear elsewhere."""

    __slots__ = ("owner", "mod")

    def __init__(self, owner: PackedLinears, mod: nn.Linear):
        self.owner, self.mod = owner, mod

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.mod
        w = None
        if threading.get_ident() == self.owner._thread and x.dtype == torch.float32 and not (
                torch.is_grad_enabled() and (x.requires_grad or m.weight.requires_grad)):
            w = self.owner.packed(m)
        if w is None:
            return F.linear(x, m.weight, m.bias)
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), w, m.bias, "none",
                                               [None], "")
        return y.view(*shape[:-1], y.shape[-1])
