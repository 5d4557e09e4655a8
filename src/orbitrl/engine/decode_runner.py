"""One decode step of every running sequence over static buffers, padded to a bucket.

The step (every layer through the model's own modules, the head, sampling, stop checks and
the state's advance) reads and writes only the :class:`DecodeState` buffers, the KV cache
and one static output buffer, so it has fixed shapes per batch-size bucket:

- on CUDA each (bucket, filtered) pair is captured once as a CUDA graph and replayed; the
  first use of a bucket runs the step eagerly on a side stream (that run is the real step,
  and warms up the allocator and the libraries) and then records the graph, which executes
  nothing, so no state is disturbed. Weights changed in place between steps (an optimizer
  step, a LoRA update, same addresses) are read by the next replay; graphs are dropped when
  the KV cache is reallocated (pool resize), when a state buffer grows, and when the model's
  adapter switches change (:meth:`DecodeRunner.begin`). A thread's adapter view
  (``lora.adapter_view``, the frozen adapters a rollout overlapped with training samples
  from) is copied into the runner's own tensors at each ``generate`` and the steps read
  those, so a new view (one per step under ``rollout.overlap``) is one copy of the adapters,
  not a new capture. While any module has forward hooks the steps run eagerly.
- on CPU the same step runs eagerly with the same padding and bookkeeping, and the KV is
  gathered only up to the longest row's blocks (shapes need not be static there).

A step is started by :meth:`DecodeRunner.launch` and its values read by
:meth:`DecodeRunner.fetch`; on CUDA the engine (``async_decode``) launches step k+1
before it fetches step k, so the host's per-token work overlaps the device's.

Attention goes through one function, :func:`decode_attention`, with the signature of the
Triton kernel ``orbitrl.engine.attention_kernels.paged_decode``, which reads the K/V blocks
in place; it is the default on CUDA when Triton imports. Elsewhere the plain-PyTorch
:class:`ReferencePagedDecode` (gather + mask + SDPA; fp32 on a CPU in fp64) takes its place.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from functools import partial

import torch
import torch.nn.functional as F

from orbitrl.engine import attention_kernels as kernels  # (as a module: tests count its calls)
from orbitrl.engine.decode_state import DecodeState
from orbitrl.engine.paged_attention import KVCache
from orbitrl.engine.paged_common import (LATENT_REFUSED, SOFTCAP_REFUSED, auto_splits,
                                         dequantize)
from orbitrl.engine.sampler import sample_rows, uniforms
from orbitrl.errors import OrbitError
from orbitrl.model.attention import decode_attention_exact, sdpa
from orbitrl.model.lora import adapter_view

GPU_BUCKETS = (1, 2, 4, 8) + tuple(range(16, 513, 16))
CPU_BUCKETS = tuple(range(1, 9)) + tuple(range(12, 33, 4)) + tuple(range(40, 513, 8))


class ReferencePagedDecode:
    """``paged_decode`` in plain PyTorch: each row gathers its ``MB * block_size`` slots
    with ``index_select``, masks past its context length (and outside its window) and runs
    SDPA, the ``G`` query heads of a kv head acting as ``G`` queries of it. fp32 on a CPU
    is computed in fp64 (``decode_attention_exact``): a row's result then does not depend
    on ``MB`` (the batch's longest row), on AVX-512 and AVX2 alike.

    Args (of ``__call__``): q [B, Hq, D]; k_cache, v_cache: one layer's slot-major cache
    [num_slots, Hkv, D] (uint8 bits of e4m3 when ``k_scale``/``v_scale`` [num_slots, Hkv, 1]
    are given); block_tables int32 [B, MB]; context_lens int32 [B] (0 for padding rows).
    Returns [B, Hq, D], zeros on padding rows.

    The gather index and the masks depend only on the block tables and context lengths, so
    an instance builds them once for the tensors (and versions) it last saw: every layer of
    one step shares them.
    """

    def __init__(self):
        self._key, self._idx, self._masks = None, None, {}

    def _meta(self, block_tables, context_lens, block_size, window):
        # (inference tensors keep no version: the runner makes a fresh instance per step)
        ver = lambda t: None if t.is_inference() else t._version  # noqa: E731
        key = (block_tables.data_ptr(), block_tables.shape, ver(block_tables),
               context_lens.data_ptr(), ver(context_lens))
        if key != self._key:
            ar = torch.arange(block_size, device=block_tables.device)
            self._idx = (block_tables.long()[:, :, None] * block_size + ar).reshape(-1)
            self._key, self._masks = key, {}
        if window not in self._masks:
            c = block_tables.shape[1] * block_size
            kpos = torch.arange(c, device=block_tables.device)[None]
            ctx = context_lens.long()[:, None]
            m = kpos < ctx
            if window is not None:
                m &= kpos >= ctx - window
            self._masks[window] = (m | (ctx == 0))[:, None, None, :]  # no empty softmax row
        return self._idx, self._masks[window]

    def __call__(self, q, k_cache, v_cache, block_tables, context_lens, *, block_size: int,
                 scale: float, window: int | None = None, k_scale=None, v_scale=None,
                 softcap: float | None = None):
        b, hq, d = q.shape
        hkv = k_cache.shape[1]
        idx, mask = self._meta(block_tables, context_lens, block_size, window)
        k, v = k_cache.index_select(0, idx), v_cache.index_select(0, idx)
        if k_scale is not None:
            k = dequantize(k, k_scale.index_select(0, idx), q.dtype)
            v = dequantize(v, v_scale.index_select(0, idx), q.dtype)
        if q.dtype == torch.float32 and q.device.type == "cpu":
            # fp64, as the general path's decode: fp32 SDPA's sums follow the gather's
            # extent C (the batch's longest row), so a row's bits would depend on its batch
            o = decode_attention_exact(q.view(b, hkv, hq // hkv, d), k.view(b, -1, hkv, d),
                                       v.view(b, -1, hkv, d), mask, scale, softcap)
        elif softcap is not None:  # Gemma 2's capped scores: no SDPA
            o = sdpa(q.view(b, hkv, hq // hkv, d), k.view(b, -1, hkv, d).transpose(1, 2),
                     v.view(b, -1, hkv, d).transpose(1, 2), mask, scale, False,
                     softcap=softcap)
        else:
            k = k.view(b, -1, hkv, d).transpose(1, 2)  # [B, Hkv, C, D]
            v = v.view(b, -1, hkv, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(q.view(b, hkv, hq // hkv, d), k, v,
                                               attn_mask=mask, scale=scale)
        return o.reshape(b, hq, d) * (context_lens > 0).to(q.dtype)[:, None, None]


def decode_attention(attend, q, cache: KVCache, layer: int, block_tables, context_lens,
                     window, scale, prefix_groups=None, num_splits=None, softcap=None):
    """The one call site of paged decode attention: ``attend`` has the signature of
    ``orbitrl.engine.attention_kernels.paged_decode`` (``prefix_groups`` and
    ``num_splits`` are passed only when given: the reference takes neither; ``softcap``,
    Gemma 2's, only when given: the reference alone takes it)."""
    ks, vs = (cache.k_scale[layer], cache.v_scale[layer]) if cache.fp8 else (None, None)
    kw = {} if prefix_groups is None else {"prefix_groups": prefix_groups}
    if num_splits is not None:
        kw["num_splits"] = num_splits
    if softcap is not None:
        kw["softcap"] = softcap
    return attend(q, cache.k[layer], cache.v[layer], block_tables, context_lens,
                  block_size=cache.block_size, scale=scale, window=window, k_scale=ks,
                  v_scale=vs, **kw)


def default_attend(device, backend: str = "auto", softcap: bool = False):
    """The paged decode attention a runner on ``device`` uses: the Triton kernel for
    ``backend`` "triton" (or "auto" on CUDA with Triton installed), else
    :class:`ReferencePagedDecode` (``softcap``: see :func:`resolve_backend`)."""
    if resolve_backend(device, backend, softcap) == "triton":
        return partial(kernels.paged_decode, backend="triton")
    return ReferencePagedDecode()


def resolve_backend(device, backend: str, softcap: bool = False, latent: bool = False) -> str:
    """"auto" -> "triton" on CUDA when Triton is installed, else "torch". ``softcap``: the
    model soft-caps its attention scores (Gemma 2), ``latent``: its cache holds latent rows
    (DeepSeek-V3's MLA), which the kernels cannot read: "auto" is "torch", "triton" is
    refused."""
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"attention backend {backend!r}: choose 'auto', 'torch' or 'triton'")
    if (softcap or latent) and backend == "triton":
        raise ValueError(SOFTCAP_REFUSED if softcap else LATENT_REFUSED)
    if softcap or latent:
        return "torch"
    if backend == "auto":
        return "triton" if device.type == "cuda" and kernels.triton_available() else "torch"
    if backend == "triton" and not kernels.triton_available():
        raise ValueError("attention backend 'triton': the triton package is not installed")
    if backend == "triton" and device.type != "cuda" and \
            os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention backend 'triton' on a CPU runs only in Triton's "
                         "interpreter: set TRITON_INTERPRET=1 before starting")
    return backend


class _StepAttention:
    """The decoder's attention backend inside a decode step: writes each row's new K/V
    into its slot (padding rows write row 0's values into row 0's slot, the same bytes, so
    real KV is never touched), then attends over the paged cache."""

    def __init__(self, runner: "DecodeRunner", b: int, nb: int):
        st = runner.state
        self.runner, self.cache = runner, runner.cache
        self.bt, self.ctx = st.block_tables[:b, :nb], st.context_lens[:b]
        self.groups = None
        if runner.grouped:
            # the kernel reads the blocks a GRPO group shares once per group (capturable)
            self.groups = kernels.shared_prefix_groups(self.bt, self.ctx,
                                                       runner.cache.block_size)
        # the kernel's key splits as a graph's step has them (from the buffers' full
        # width, not this step's longest row), for eager steps too: the two round alike
        self.splits = None if isinstance(runner.attend, ReferencePagedDecode) else \
            auto_splits(b, runner.model.config.num_kv_heads,
                        st.max_blocks * runner.cache.block_size, st.device)
        self.valid = (self.ctx > 0)[:, None, None]
        pos, bs = st.positions[:b], runner.cache.block_size
        slots = st.block_tables[:b].gather(1, (pos // bs)[:, None])[:, 0].long() * bs + pos % bs
        self.slots = torch.where(self.valid[:, 0, 0], slots, slots[:1])

    def __call__(self, layer, q, k, v):
        # q: [b, 1, Hq, D]; k, v: [b, 1, Hkv, D] -> [b, 1, Hq, D]
        k = torch.where(self.valid, k[:, 0], k[:1, 0])
        v = torch.where(self.valid, v[:, 0], v[:1, 0])
        self.cache.write(layer, self.slots, k, v)
        r = self.runner
        o = decode_attention(r.attend, q[:, 0], self.cache, layer, self.bt, self.ctx,
                             r.windows[layer], r.scale, self.groups, self.splits, r.softcap)
        return o[:, None]


class DecodeRunner:
    """Runs decode steps of the rows of ``state`` (see the module docstring).

    Args:
        model: the decoder (its modules are called as they are at each step).
        cache: the engine's KV cache.
        state: the static row buffers.
        buckets: batch sizes to pad to; default GPU_BUCKETS on CUDA, CPU_BUCKETS (finer:
            padding rows cost real matmul rows there) elsewhere.
        graphs: capture CUDA graphs (default: on CUDA).
        attend: paged decode attention with ``paged_decode``'s signature (default: the
            Triton kernel on CUDA when Triton imports, else :class:`ReferencePagedDecode`).
    """

    def __init__(self, model, cache: KVCache, state: DecodeState, buckets=None,
                 graphs: bool | None = None, attend=None, backend: str = "auto"):
        self.model, self.cache, self.state = model, cache, state
        cuda = state.device.type == "cuda"
        self.graphs = cuda if graphs is None else graphs
        self.buckets = [b for b in (buckets or (GPU_BUCKETS if cuda else CPU_BUCKETS))
                        if b < state.capacity] + [state.capacity]
        cfg = model.config
        self.windows, self.scale = cfg.sliding_windows, cfg.attn_scale
        self.softcap = cfg.attn_softcap  # Gemma 2's attention soft-capping
        try:
            self.attend = attend or default_attend(state.device, backend,
                                                   self.softcap is not None)
        except ValueError as e:
            raise OrbitError(str(e)) from None
        self.out = torch.zeros(state.capacity, 4, dtype=torch.float64, device=state.device)
        self._graphs: dict = {}
        self._sig = None
        self._view = None  # the runner's copy of the adapter view: {id: (A, B)}
        self.viewing = False  # this generate samples through an adapter view
        self.capture = self.graphs  # this generate's choice (begin)
        self.hooked = False  # a module has forward hooks (begin): no graphs, no async
        self.packed = None  # the engine's PackedLinears (CPU only)
        self.grouped = False  # this step passes prefix groups to the kernel (launch)
        self._host, self._flip = None, 0  # CUDA: pinned output buffers (launch)

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def begin(self, signature, view=None) -> None:
        """Called once per ``generate``. ``signature``: the LoRA modules' switches; ``view``:
        the thread's adapter view (``lora.adapter_view``) or None. Captured graphs are
        dropped when the switches change, when a view comes or goes, or when its tensors'
        shapes change; a view's values are copied into the runner's own tensors (the
        addresses the graphs read). The steps run eagerly while any module of the model
        has forward hooks: a replay runs none of them, so hooks that move weights in
        (tiers, sharding) or read outputs (a logits probe) would be skipped."""
        if view is not None:
            mine = self._view
            if mine is not None and mine.keys() == view.keys() and all(
                    a.shape == va.shape and a.dtype == va.dtype and a.device == va.device
                    and b.shape == vb.shape and b.dtype == vb.dtype
                    for k, (a, b) in mine.items() for va, vb in [view[k]]):
                for k, (a, b) in mine.items():
                    a.copy_(view[k][0])
                    b.copy_(view[k][1])
            else:
                self._view = {k: (a.detach().clone(), b.detach().clone())
                              for k, (a, b) in view.items()}
                self._graphs = {}
        key = (signature, view is not None)
        if key != self._sig:
            self._graphs, self._sig = {}, key
        self.viewing = view is not None
        self.hooked = any(m._forward_hooks or m._forward_pre_hooks
                          for m in self.model.modules())
        self.capture = self.graphs and not self.hooked

    def invalidate(self) -> None:
        """Drop every captured graph (the KV cache or a state buffer was reallocated)."""
        self._graphs = {}

    @torch.no_grad()
    def _step(self, b: int, nb: int, filtered: bool) -> None:
        """The graph body: forward, sample, stop checks, advance; writes ``out[:b]`` as
        (token, logprob, raw logprob, reason: 0 running, 1 stop id, 2 length)."""
        st = self.state
        attn = _StepAttention(self, b, nb)
        if isinstance(self.attend, ReferencePagedDecode):
            self.attend = ReferencePagedDecode()  # fresh memo for this step
        with adapter_view(self._view) if self.viewing else nullcontext(), \
                self.packed or nullcontext():
            hidden = self.model(st.tokens[:b, None], positions=st.positions[:b, None],
                                attn=attn, return_hidden=True)[:, 0]
            logits = self.model.head(hidden).float()
        u = uniforms(st.keys[:b], st.counters[:b])
        filt = (st.top_k[:b], st.top_p[:b]) if filtered else (None, None)
        tok, lp, raw = sample_rows(logits, st.inv_temp[:b], st.greedy[:b], u, *filt)
        stop = (st.stop_ids[:b] == tok[:, None]).any(-1)
        length = st.counters[:b] + 1 >= st.limits[:b]
        reason = torch.where(stop, 1, torch.where(length, 2, 0))
        self.out[:b].copy_(torch.stack([tok.double(), lp.double(), raw.double(),
                                        reason.double()], -1))
        valid = st.context_lens[:b] > 0
        st.tokens[:b].copy_(tok)
        st.positions[:b] += valid
        st.counters[:b] += valid
        st.context_lens[:b] += valid.int()

    def launch(self):
        """Start one decode step of the ``state.n`` rows and return a handle for
        :meth:`fetch`. On CUDA the step is queued (a graph replay, then its output copied
        into one of two pinned host buffers behind an event), so the host may prepare and
        launch the next step before it reads this one's values: the two buffers keep a
        step's values until the step after next is launched."""
        st = self.state
        n = st.n
        b, filtered = self.bucket(n), st.filtered > 0
        # prefix groups where neighbouring rows share a first block (a GRPO request's
        # samples), for the kernel only; a graph is captured per choice
        seqs = st.seqs
        self.grouped = not isinstance(self.attend, ReferencePagedDecode) and any(
            a.block_table[0] == c.block_table[0] for a, c in zip(seqs, seqs[1:]))
        if st.grown:
            self.invalidate()
            st.grown = False
        if not self.capture:
            nb = int(st.nblk_h[:n].max())  # eager: gather only up to the longest row
            self._step(b, nb, filtered)
        else:
            self._replay(b, filtered, self.grouped)
        if st.device.type != "cuda":
            return self.out[:n].tolist()  # the step has run: its values now
        if self._host is None:
            self._host = [torch.empty(st.capacity, 4, dtype=torch.float64, pin_memory=True)
                          for _ in range(2)]
        buf = self._host[self._flip][:n]
        self._flip ^= 1
        buf.copy_(self.out[:n], non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(st.device))
        return buf, done

    @staticmethod
    def fetch(handle) -> list[list[float]]:
        """A launched step's values per row, [token, logprob, raw logprob, reason] (waits
        for the step on CUDA)."""
        if isinstance(handle, list):
            return handle
        buf, done = handle
        done.synchronize()
        return buf.tolist()

    def _replay(self, b: int, filtered: bool, grouped: bool) -> None:
        key = (b, filtered, grouped, self.cache.k.data_ptr())
        g = self._graphs.get(key)
        # replay, streams and capture on the state's device, not whichever is current (an
        # engine on cuda:1 in a process that never called set_device)
        with torch.cuda.device(self.state.device):
            if g is not None:
                g.replay()
            else:
                self._capture(key, b, filtered)

    def _capture(self, key, b: int, filtered: bool) -> None:
        mb = self.state.max_blocks
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the real step, eager; warms up allocator and libs
            self._step(b, mb, filtered)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        pool = next(iter(self._graphs.values())).pool() if self._graphs else None
        # records only (state is not advanced); thread_local: a training thread running
        # beside this one (rollout.overlap) may sync or allocate during the capture
        with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
            self._step(b, mb, filtered)
        self._graphs[key] = g
