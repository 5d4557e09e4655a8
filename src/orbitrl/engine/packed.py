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
made at the first call. A layer's q/k/v projections are one packing unit, and its gate/up
projections another (``FUSED``): one concatenated weight, one GEMM, whose columns serve the
members' calls on the same input.

At each step a copy is remade if its weight has become another tensor or storage or its
version has moved. At the start of every ``generate`` (and of a stream) each copy is also
checked against its weights' content: a fingerprint taken when the copy was made (the bits
summed as 64-bit words along rows and columns, and the biases' bits: two reads of the
weights, about 20 ms for 156 MB on one core) is taken again, and a copy whose weights moved
is dropped. So an in-place change that bumps no version (``p.data.copy_``, a fused
optimizer step) is seen from the next ``generate`` on, and an unchanged model is packed
once, not at every batch (packing 156 MB took 0.1-0.4 s on one core, most of it
first-touch page faults). ``Engine.weights_changed`` drops every copy.

Memory: one packed copy of those weights, held by the engine, for the units that fit the
budget (``Engine(packed_bytes=...)``, 1 GiB by default; taken in turn, the rest run through
``F.linear``). An RL run's rollout engine gets the budget ``rollout.packed_weights`` sets
(``rl/rollout.py packed_budget``: by default what the rollout phase leaves below the
predicted training peak), the ledger prices the copy in the rollout phase, and the run
frees it after each rollout (``Engine.release_packed``); there the rest run on oneDNN over
their plain weights (``PackedLinears.route_plain``), as its trainer multiplies them. Nothing is packed while the model has
forward hooks (layer tiers and sharding swap weights in through them), for weights made
under ``torch.inference_mode``, or for calls that need gradients; any other thread gets
``F.linear`` as before.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from orbitrl.model import gemm


def available() -> bool:
    """Whether this build has oneDNN's prepacked inner product."""
    return gemm.available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


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


def packing_units(model: nn.Module) -> list[tuple[nn.Linear, ...]]:
    """Every packing unit of ``model`` (``FUSED`` groups first), none without oneDNN."""
    return _units(model, _candidates(model)) if available() else []


def unit_bytes(unit) -> int:
    """Bytes of one unit's packed copy (fp32)."""
    return sum(m.weight.numel() * 4 for m in unit)


def packable_bytes(model: nn.Module) -> int:
    """Bytes the packed copies of every candidate weight would hold (fp32)."""
    return sum(unit_bytes(u) for u in packing_units(model))


def staging_bytes(units) -> int:
    """The largest staging copy while a unit is reordered: a group's concatenated weight or
    a column-major weight made contiguous (oneDNN reorders from row-major)."""
    return max((unit_bytes(u) for u in units if len(u) > 1 or not u[0].weight.is_contiguous()),
               default=0)


# sibling projections that a forward calls one after another on the same input: packed as
# one weight, one GEMM for the group (the first member's call computes all of them)
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _units(model: nn.Module, mods: list[nn.Linear]) -> list[tuple[nn.Linear, ...]]:
    """``mods`` as packing units: the FUSED sibling groups whose members are all there with
    one input width, and every other module alone."""
    left = {id(m) for m in mods}
    units = []
    for parent in model.modules():
        for names in FUSED:
            group = tuple(getattr(parent, n, None) for n in names)
            if all(isinstance(m, nn.Linear) and id(m) in left for m in group) and \
                    len({m.in_features for m in group}) == 1:
                units.append(group)
                left -= {id(m) for m in group}
    return units + [(m,) for m in mods if id(m) in left]


class PackedLinears:
    """Context manager over a model's fp32 ``nn.Linear`` modules on a CPU (see the module
    docstring). ``budget_bytes``: the packing units are taken in turn while their
    weights fit it (the rest run through ``F.linear``, or :meth:`route_plain`); 0 turns it
    off. ``bytes``:
    what the packed copies hold now; ``planned_bytes``: what they hold when all are made."""

    # the batch the weight layout is tuned for (any row count runs): interleaved timings of
    # the benchmark model's GEMMs at 3-4 rows gave 10.2 and 9.6 ms with 64 against 11.4 and
    # 10.4 ms with 16, and the same from 8 to 128 rows
    ROWS_HINT = 64
    # the fewest rows a step's GEMMs run with while packed (the engine pads the token rows
    # and the head's rows up to it): the benchmark model's 33 packed GEMMs, fastest of 11
    # interleaved passes on one core, took 6.5-8.2 ms at 1-3 rows, 5.8-6.0 ms at 4-6 and
    # 7.0-7.6 ms at 7-8 (the head alone: 3.8-5.0, 3.3-3.4 and 4.3-4.6 ms). The rows' bits
    # do not depend on the row count here, so above it the rows run as they are.
    MIN_ROWS = 4

    def __init__(self, model: nn.Module, budget_bytes: int):
        self.model = model
        mods = _candidates(model) if budget_bytes > 0 and available() else []
        # the units in turn (fused groups first) while they fit the budget (a decode step
        # streams every weight once, so each byte packed saves about the same time)
        self.units, size = [], 0
        for unit in _units(model, mods):
            if size + unit_bytes(unit) > budget_bytes:
                break
            self.units.append(unit)
            size += unit_bytes(unit)
        kept = {id(m) for unit in self.units for m in unit}
        self.mods = [m for m in mods if id(m) in kept]  # (in the model's order)
        self._left_out = [m for m in mods if id(m) not in kept] if self.mods else []
        self.plain: list[nn.Linear] = []  # see route_plain
        self.planned_bytes = size  # what the copies hold once every unit is packed
        self.workspace_bytes = staging_bytes(self.units)
        self._unit_of = {id(u): u for u in self.units}
        self._forwards = [(m, _Forward(self, unit, i)) for unit in self.units
                          for i, m in enumerate(unit)]  # made once
        self.active = bool(self.mods)
        # id(unit) -> (keys, fingerprint, packed weight, bias or None, member widths)
        self._packed: dict[int, tuple] = {}
        # the last fused unit's (id, input, its version, every member's output): siblings
        # are called back to back on one input; one slot, so no layer's outputs outlive it
        self._stash: tuple | None = None
        self._checked: dict[int, tuple] = {}
        self._thread = None
        self.seconds = 0.0  # spent making copies and checking them

    def route_plain(self) -> list[nn.Linear]:
        """Run the candidates the budget left out on oneDNN over their plain weights while
        packed, and return them. A training run's rollout (rl/rollout.py) packs what fits
        below its training peak (SmolLM2's 113 MB head stays out) and its trainer
        multiplies the same weights on oneDNN (``model.rollout_gemms``): there these give
        the packed copies' bits (model/gemm.py) where MKL rounds by row count, and run
        faster than MKL at a decode step's rows (SmolLM2's column-major head: 14.3 against
        29.9 ms at 32 rows). Elsewhere (``orbitrl generate``) they stay on ``F.linear``:
        oneDNN keeps state per weight shape and row count that only a training run prices."""
        if not self.plain:
            self.plain = list(self._left_out)
            self._forwards += [(m, _Plain(self, m)) for m in self.plain]
        return self.plain

    @property
    def bytes(self) -> int:
        return sum(hit[2].numel() * 4 for hit in self._packed.values())

    def reset(self, keep: bool = True) -> None:
        """At the start of a batch: keep the copies whose weights are the same tensors,
        storages and versions with the same fingerprints (``keep=False``: drop every copy),
        and pack only while the model has no forward hooks."""
        t0 = time.perf_counter()
        if keep:
            units = self._unit_of
            self._packed = {i: hit for i, hit in self._packed.items()
                            if _keys(units[i]) == hit[0]
                            and torch.equal(_fingerprint(units[i]), hit[1])}
        else:
            self._packed = {}
        self.seconds += time.perf_counter() - t0
        # nothing packs for weights made in inference mode (see ``packed``)
        self.active = bool(self.mods) and not any(
            m._forward_hooks or m._forward_pre_hooks for m in self.model.modules()) and \
            not all(m.weight.is_inference() for m in self.mods)

    def __bool__(self) -> bool:
        return self.active

    def __enter__(self):
        self._thread = threading.get_ident()
        self._checked = {}  # id(unit) -> its copy, checked once this step
        for m, fwd in self._forwards:
            m.__dict__["forward"] = fwd  # an instance attribute (not a parameter or module)
        return self

    def __exit__(self, *exc):
        for m, _ in self._forwards:
            m.__dict__.pop("forward", None)
        self._stash, self._checked = None, {}
        self._thread = None

    def packed(self, unit: tuple[nn.Linear, ...]) -> tuple | None:
        """``unit``'s (packed weight, bias, each member's columns or None), made or remade
        as needed; None if it cannot be packed. Checked against the weights once per
        step."""
        got = self._checked.get(id(unit))
        if got is not None:
            return got
        keys = _keys(unit)
        if keys is None:
            return None
        hit = self._packed.get(id(unit))
        if hit is None or hit[0] != keys:
            t0 = time.perf_counter()
            with torch.inference_mode(False), torch.no_grad():
                ws = [m.weight.detach() for m in unit]
                w = ws[0] if len(unit) == 1 else torch.cat(ws)
                bias = None
                if any(m.bias is not None for m in unit):
                    bias = torch.cat([m.bias.detach() if m.bias is not None else
                                      m.weight.new_zeros(m.out_features) for m in unit])
                sizes = [m.out_features for m in unit] if len(unit) > 1 else None
                hit = (keys, _fingerprint(unit),
                       torch.ops.mkldnn._reorder_linear_weight(w, self.ROWS_HINT), bias,
                       sizes)
            self._packed[id(unit)] = hit
            self.seconds += time.perf_counter() - t0
        self._checked[id(unit)] = got = hit[2:]
        return got


def _keys(unit) -> tuple | None:
    """What identifies the unit's weights and biases now: each tensor, its storage and its
    version (the copy holds its own bias: its version is watched here, its bits by
    ``_fingerprint``); None if a weight is an inference tensor (no version counter to
    watch). Taken for every unit at every step: one attribute read per tensor."""
    keys = []
    for m in unit:
        got = m._parameters  # where nn.Module.__getattr__ finds them, read directly
        if "weight" in got and "bias" in got:
            w, b = got["weight"], got["bias"]
        else:  # one of them replaced by a plain tensor attribute
            w, b = m.weight, m.bias
        if w.is_inference():
            return None
        keys.append((id(w), w.data_ptr(), w._version, None if b is None else (id(b), b._version)))
    return tuple(keys)


def _fingerprint(unit) -> torch.Tensor:
    """The weights' bits as 64-bit words (wrapping), summed along each row and along each
    column of the layout in memory, and the biases' bits, for every module of the unit (two
    reads of the weight):
    a change that keeps every row and column sum mod 2**64 (values swapped between equal
    ones at the corners of a rectangle, say) goes unseen; a flip, a shuffle or an update
    does not."""
    out = []
    with torch.inference_mode(False), torch.no_grad():
        for m in unit:
            w = m.weight.detach()
            if not w.is_contiguous() and w.t().is_contiguous():
                w = w.t()  # a column-major head (Decoder.head_column_major): its columns
            if w.is_contiguous() and w.shape[1] % 2 == 0 and w.data_ptr() % 8 == 0:
                bits = w.view(torch.int64)
                out += [bits.sum(1), bits.sum(0)]
            else:
                bits = w.reshape(w.shape[0], -1).view(torch.int32)
                out += [bits.sum(1, dtype=torch.int64), bits.sum(0, dtype=torch.int64)]
            if m.bias is not None:  # small: every bit
                out.append(m.bias.detach().reshape(-1).view(torch.int32).to(torch.int64))
    return torch.cat(out)


class _Forward:
    """A module's forward while packed: oneDNN in the engine's thread, F.linear elsewhere.
    A fused group's first call on an input computes every member's output and keeps them,
    for the step, for the other members' calls on that same input."""

    __slots__ = ("owner", "unit", "index", "mod")

    def __init__(self, owner: PackedLinears, unit: tuple[nn.Linear, ...], index: int):
        self.owner, self.unit, self.index = owner, unit, index
        self.mod = unit[index]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.mod
        hit = None
        if threading.get_ident() == self.owner._thread and x.dtype == torch.float32 and not (
                torch.is_grad_enabled() and (x.requires_grad or m.weight.requires_grad)):
            st = self.owner._stash
            if st is not None and st[0] == id(self.unit) and st[1] is x and \
                    st[2] == _version(x):
                return st[3][self.index]
            hit = self.owner.packed(self.unit)
        if hit is None:
            return F.linear(x, m.weight, m.bias)
        w, bias, sizes = hit
        if x.dim() >= 2:  # the op flattens the leading dimensions and restores them itself
            y = gemm.onednn_mm(x, w, bias)
        else:
            y = gemm.onednn_mm(x[None], w, bias)[0]
        if sizes is None:
            return y
        outs = y.split(sizes, -1)
        self.owner._stash = (id(self.unit), x, _version(x), outs)
        return outs[self.index]


class _Plain:
    """An unpacked candidate's forward while packed: oneDNN over its plain weight in the
    engine's thread (the packed copies' bits), F.linear elsewhere."""

    __slots__ = ("owner", "mod")

    def __init__(self, owner: PackedLinears, mod: nn.Linear):
        self.owner, self.mod = owner, mod

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.mod
        if threading.get_ident() != self.owner._thread or x.dtype != torch.float32 or (
                torch.is_grad_enabled() and (x.requires_grad or m.weight.requires_grad)):
            return F.linear(x, m.weight, m.bias)
        return gemm.onednn_mm(x, m.weight, m.bias)  # (any leading shape, 1-D too)


def _version(x: torch.Tensor) -> int | None:
    """An input's version (an inference tensor has none: within one step the decoder does
    not change a projection's input between the calls of a fused group)."""
    return None if x.is_inference() else x._version
