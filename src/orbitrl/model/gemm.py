"""The trainer's fp32 GEMMs on oneDNN, so that they round as the rollout engine's do.

On a CPU the engine runs its fp32 projections and head through oneDNN's inner product over
prepacked weights (``engine/packed.py``), the trainer through ``F.linear`` (MKL). The two
round differently, and 30 layers amplify that into 2-4e-5 of a sampled token's logprob
(SmolLM2-135M, LoRA). oneDNN's inner product over the plain weight gives the bits of the
packed copy, whatever the row count (3 to 9,000 rows checked), for any slice of the
output columns, and for a column-major weight; on 2,048 training rows it also ran faster
than MKL (11.2 against 16.2 ms at 576 x 960, 686 against 925 ms for SmolLM2's head, two
threads). So inside :func:`onednn_gemms` a forward's ``F.linear`` over one of the given
modules' weights (or a slice of one: the chunked head in ``train/logprobs.py`` asks
:func:`head_gemm`) runs there instead, with or without gradients (:class:`OneDNNLinear`;
its backward is plain matmuls).

Routed by a ``TorchFunctionMode``, which is per thread: an overlapped rollout's engine
thread is untouched. Off where this torch build lacks oneDNN, for other dtypes and devices.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from orbitrl.ledger.memory import row_bucket

_LOCAL = threading.local()


def available() -> bool:
    """Whether this build has oneDNN's inner product (``mkldnn._linear_pointwise``)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                            "_linear_pointwise")


# oneDNN keeps a primitive, and the kernels behind it, for every row count it has multiplied
# a weight shape by (0.6 MiB each, never given back: ledger/runtime.py onednn_state_bytes).
# A decode step has at most a batch of rows; prefill chunks and training micro-batches
# change their row count every step, so past EXACT_ROWS they are padded up to row_bucket's
# counts (ledger/memory.py, which prices them): each row's product does not depend on the
# others (the row-invariance above), so the bits do not move. One row over a plain weight
# oneDNN multiplies as a matrix-vector product, whose bits differ from the same row in a
# batch (2.7e-5 to 1.0e-4 on SmolLM2's shapes): a lone row is padded to two.
MIN_ROWS = 2


def onednn_mm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)`` through oneDNN, no autograd (x: [..., K], w: [N, K]); rows
    padded to :func:`row_bucket`, at least ``MIN_ROWS`` (the padding's rows are dropped)."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    mb = max(row_bucket(m), MIN_ROWS) if m else 0
    if mb == m:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [None], "")
    xp = x.new_empty(mb, k)
    xp[:m] = x.reshape(m, k)
    xp[m:].zero_()
    y = torch.ops.mkldnn._linear_pointwise(xp, w, b, "none", [None], "")
    return y[:m].view(*x.shape[:-1], w.shape[0])


class OneDNNLinear(torch.autograd.Function):
    """``F.linear`` with a oneDNN forward; backward as ``F.linear``'s (MKL matmuls), keeping
    the input only when the weight needs its gradient (as autograd does for a frozen
    weight)."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x if w.requires_grad else None, w)
        ctx.bias = b is not None
        return onednn_mm(x, w, b)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = g.matmul(w)
        if ctx.needs_input_grad[1] or (ctx.bias and ctx.needs_input_grad[2]):
            g2 = g.reshape(-1, g.shape[-1])
            if ctx.needs_input_grad[1]:
                gw = g2.t().mm(x.reshape(-1, x.shape[-1]))
            if ctx.bias and ctx.needs_input_grad[2]:
                gb = g2.sum(0)
        return gx, gw, gb


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _eligible(x, w) -> bool:
    return (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and w.dim() == 2
            and x.dim() >= 2 and x.dtype == torch.float32 and w.dtype == torch.float32
            and x.device.type == "cpu" and w.device.type == "cpu")


class _Route(TorchFunctionMode):
    def __init__(self, storages: frozenset):
        super().__init__()
        self.storages = storages

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2:
            x, w = args[0], args[1]
            if _eligible(x, w) and _storage(w) in self.storages:
                b = args[2] if len(args) > 2 else kwargs.get("bias")
                return OneDNNLinear.apply(x, w, b)
        return func(*args, **kwargs)


@contextmanager
def onednn_gemms(modules, mode: bool = True):
    """Inside, in this thread, ``F.linear`` over the weight of any of ``modules`` (fp32
    ``nn.Linear`` on a CPU) runs on oneDNN (see the module docstring); nothing changes
    without oneDNN or modules. ``mode`` False: only the calls that ask (:func:`linear`,
    :func:`routed`, :func:`head_gemm`), without a ``TorchFunctionMode`` over every op (the
    engine's decode steps, where the packed copies serve the projections)."""
    storages = frozenset(_storage(m.weight) for m in modules
                         if m.weight.dtype == torch.float32 and m.weight.device.type == "cpu")
    with _routing(storages if available() else frozenset(), mode):
        yield


@contextmanager
def _routing(storages: frozenset, mode: bool = True):
    if not storages:
        yield
        return
    before = getattr(_LOCAL, "storages", frozenset())
    _LOCAL.storages = before | storages
    try:
        if mode:
            with _Route(_LOCAL.storages):
                yield
        else:
            yield
    finally:
        _LOCAL.storages = before


def checkpoint_contexts():
    """``torch.utils.checkpoint``'s ``context_fn``: a recomputed layer (backward, after the
    forward's :func:`onednn_gemms` has exited) runs under the routing its forward ran
    under; else it would multiply on MKL, save other tensors, and checkpoint refuses
    those (and the gradients would be of other products)."""
    return nullcontext(), _routing(getattr(_LOCAL, "storages", frozenset()))


def routed(w: torch.Tensor) -> bool:
    """Whether this thread multiplies ``w`` on oneDNN now (inside :func:`onednn_gemms`)."""
    storages = getattr(_LOCAL, "storages", None)
    return bool(storages) and w.device.type == "cpu" and _storage(w) in storages


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, on oneDNN where :func:`routed` (with autograd): for products a module
    computes itself, such as LoRA's A and B (``model/lora.py``)."""
    if routed(w) and _eligible(x, w):
        return OneDNNLinear.apply(x, w, b)
    return F.linear(x, w, b)


def head_gemm(weight: torch.Tensor):
    """``onednn_mm`` when this thread is inside :func:`onednn_gemms` over ``weight`` (a
    vocabulary projection the chunked logprobs slice), else None."""
    return _head_tile if weight.dtype == torch.float32 and routed(weight) else None


def _head_tile(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # a row slice of a column-major head (Decoder.head_column_major) is strided past its
    # own width, and oneDNN rounds such an operand otherwise: made contiguous first, the
    # tile has the bits of the whole head's product (a tile's weight: 19 MB at 8192 x 576)
    return onednn_mm(h, w if w.is_contiguous() else w.contiguous())
