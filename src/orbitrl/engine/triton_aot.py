"""Compile the engine's Triton attention kernels for a CUDA GPU on a host without one.

Triton's interpreter (how the CPU tests run the kernels) executes a kernel's Python with
numpy; it never lowers it to a GPU. A kernel can pass every interpreted test and still fail
on its first launch on a GPU: a construct the GPU compiler rejects, or tiles that ask for
more shared memory than the GPU has. This module runs Triton's own compiler (source to
PTX to a cubin, with the ptxas shipped in Triton's wheel) for every variant the engine
launches on CUDA, on CPU tensors of the right shapes and dtypes, through the same launch
functions (``triton_attention.decode`` / ``prefill``) with the GPU's tile sizes, and checks
each cubin's shared memory against the architecture's limit and its local memory (register
spills) with the ``cuobjdump`` shipped beside ptxas.

Variants per attention shape (heads, kv heads, head size, dtype) and KV dtype (the model's
or fp8 e4m3 with scales): decode on one split, with a sliding window, split-K with its
reduce kernel, GRPO prefix groups (the shared-prefix kernel, then decode from each row's
first unshared key), chunked prefill with and without a window, and attention sinks
(gpt-oss) in the direct decode, the reduce and the prefill.

    python scripts/compile_kernels.py --arch 90                  # the default shapes
    python scripts/compile_kernels.py --arch 86 --model DIR      # one model's shapes

It drives Triton's runtime from outside (a stand-in driver that names the target, launches
turned into compiles): checked with Triton 3.6 and 3.9. It must run in a process where
``orbitrl.engine.triton_attention`` is imported without ``TRITON_INTERPRET=1`` (Triton decides at decoration time whether a kernel is interpreted);
``compiling_for`` raises if it was not.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from orbitrl.engine.attention_kernels import shared_prefix_groups
from orbitrl.model.config import ModelConfig

# the most shared memory one thread block may use (the opt-in limit), bytes, per compute
# capability (CUDA programming guide, "Technical Specifications per Compute Capability")
SHARED_LIMIT = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "bf16", "fp16" or "fp32"
    window: int | None = None  # a sliding window (the window variants use 64 when None)

    def __str__(self):
        return f"{self.num_heads}/{self.num_kv_heads} heads x {self.head_dim}, {self.dtype}"


# Qwen2-0.5B (the GPU benchmark's model), SmolLM2-135M (the real model checked offline),
# Llama-3-8B's attention, and fp16 / fp32 with heads wider than 64 (fp32 takes smaller tiles)
DEFAULT_SHAPES = (AttentionShape(14, 2, 64, "bf16"), AttentionShape(9, 3, 64, "bf16"),
                  AttentionShape(32, 8, 128, "bf16"), AttentionShape(32, 8, 128, "fp16"),
                  AttentionShape(16, 4, 128, "fp32"))


def model_shape(model_dir: str) -> AttentionShape:
    """The attention shape of a model directory (its config.json) in its dtype (bf16 if
    it names none)."""
    c = ModelConfig.from_dir(model_dir)
    named = c.hf.get("torch_dtype") or c.hf.get("dtype")
    dt = {"float16": "fp16", "float32": "fp32"}.get(named, "bf16")
    win = next((w for w in c.sliding_windows if w), None)
    return AttentionShape(c.num_heads, c.num_kv_heads, c.head_dim, dt, win)


@dataclass
class Compiled:
    kernel: str
    variant: str
    shared: int  # bytes of shared memory the cubin asks for
    num_warps: int
    num_stages: int
    registers: int | None  # per thread, from cuobjdump (None where it is not at hand)
    local: int | None  # bytes of local memory per thread: register spills


@contextmanager
def compiling_for(arch: int):
    """Within it, every Triton kernel launch compiles for ``sm_{arch}`` and returns without
    running (outputs are left unwritten); yields the list that collects each compiled
    kernel as ``(name, CompiledKernel)``."""
    import triton.runtime.jit as jit  # optional: triton
    from triton.backends.compiler import GPUTarget  # optional: triton
    from triton.runtime import driver  # optional: triton

    from orbitrl.engine import triton_attention as ta  # optional: triton

    if ta.INTERPRETED:
        raise RuntimeError("orbitrl.engine.triton_attention was imported under "
                           "TRITON_INTERPRET=1, so its kernels only interpret; compile in a "
                           "process without it")

    class _Target:  # what JITFunction.run asks the driver: a device, a stream, a target
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

    seen: list = []
    run = jit.JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        seen.append((self.fn.__name__, kernel))
        return kernel

    # the per-device caches hold the target: a fresh cache per arch
    kernels = [getattr(ta, n) for n in dir(ta) if isinstance(getattr(ta, n), jit.JITFunction)]
    saved = [(k, k.__dict__.get("device_caches")) for k in kernels]
    before = getattr(driver, "_active", None)  # None on a host without a GPU driver
    driver.set_active(_Target())
    jit.JITFunction.run, ta.COMPILE_FOR = compile_only, arch
    for k in kernels:
        k.device_caches = defaultdict(k.create_binder)
    try:
        yield seen
    finally:
        jit.JITFunction.run, ta.COMPILE_FOR = run, None
        driver._active = before
        for k, caches in saved:
            if caches is None:
                k.__dict__.pop("device_caches", None)
            else:
                k.device_caches = caches


VARIANTS = 10  # launches per (shape, KV dtype) in _launches


def _launches(shape: AttentionShape, fp8: bool):
    """(variant name, thunk) for every launch kind, on small CPU tensors of the shape."""
    from orbitrl.engine import triton_attention as ta  # optional: triton

    dt = _DTYPES[shape.dtype]
    hq, hkv, d, bs, batch, nb = shape.num_heads, shape.num_kv_heads, shape.head_dim, 16, 8, 8
    slots = nb * bs * batch
    if fp8:
        k = torch.zeros(slots, hkv, d, dtype=torch.uint8)
        ks = torch.ones(slots, hkv, 1)
    else:
        k, ks = torch.zeros(slots, hkv, d, dtype=dt), None
    q = torch.zeros(batch, hq, d, dtype=dt)
    bt = torch.arange(batch * nb, dtype=torch.int32).view(batch, nb)
    bt[:, 0] = 0  # every row shares its first block: one GRPO group
    ctx = torch.full((batch,), nb * bs, dtype=torch.int32)
    win = shape.window or 64
    kw = dict(block_size=bs, scale=d ** -0.5, k_scale=ks, v_scale=ks)
    groups = shared_prefix_groups(bt, ctx, bs)
    yield "decode", lambda: ta.decode(q, k, k, bt, ctx, window=shape.window, num_splits=1,
                                      groups=None, **kw)
    yield "decode, window", lambda: ta.decode(q, k, k, bt, ctx, window=win, num_splits=1,
                                              groups=None, **kw)
    yield "decode, 4 splits", lambda: ta.decode(q, k, k, bt, ctx, window=shape.window,
                                                num_splits=4, groups=None, **kw)
    yield "decode, prefix groups", lambda: ta.decode(q, k, k, bt, ctx, window=shape.window,
                                                     num_splits=1, groups=groups, **kw)
    yield "decode, prefix groups, window", lambda: ta.decode(
        q, k, k, bt, ctx, window=win, num_splits=2, groups=groups, **kw)
    qp = torch.zeros(100, hq, d, dtype=dt)
    yield "prefill", lambda: ta.prefill(qp, k, k, bt[0], 20, window=shape.window, **kw)
    yield "prefill, window", lambda: ta.prefill(qp, k, k, bt[0], 20, window=win, **kw)
    sinks = torch.zeros(hq, dtype=dt)
    yield "decode, sinks", lambda: ta.decode(q, k, k, bt, ctx, window=win, num_splits=1,
                                             groups=None, sinks=sinks, **kw)
    yield "decode, 4 splits, sinks", lambda: ta.decode(q, k, k, bt, ctx, window=shape.window,
                                                       num_splits=4, groups=None, sinks=sinks,
                                                       **kw)
    yield "prefill, sinks", lambda: ta.prefill(qp, k, k, bt[0], 20, window=win, sinks=sinks,
                                               **kw)


def _resources(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers, local bytes) per thread from ``cuobjdump -res-usage``; Nones without it."""
    import triton  # optional: triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    if not os.path.exists(tool):
        tool = shutil.which("cuobjdump")
    if not tool:
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True)
    reg = re.search(r"REG:(\d+)", out.stdout)
    # spilled registers live in the thread's stack frame (Triton kernels have no local
    # arrays, so a frame means spills); LOCAL counts other local memory
    mem = [int(m) for m in re.findall(r"(?:STACK|LOCAL):(\d+)", out.stdout)]
    return (int(reg.group(1)) if reg else None), (sum(mem) if mem else None)


def compile_all(arch: int, shapes=DEFAULT_SHAPES, fp8=(False, True), progress=None):
    """Compile every variant for ``sm_{arch}``; returns one ``Compiled`` per kernel each
    variant launched. A kernel the compiler rejects raises, named with its variant."""
    out = []
    todo = [(s, f) for s in shapes for f in fp8]
    with compiling_for(arch) as seen:
        for shape, f8 in todo:
            for name, launch in _launches(shape, f8):
                variant = f"{shape}, KV {'fp8' if f8 else shape.dtype}: {name}"
                first = len(seen)
                try:
                    launch()
                except Exception as e:
                    raise RuntimeError(f"sm_{arch}: {variant}: {type(e).__name__}: "
                                       f"{str(e).strip().splitlines()[0]}") from e
                for kname, k in seen[first:]:
                    md = k.metadata
                    reg, loc = _resources(k.asm["cubin"])
                    out.append(Compiled(kname, variant, md.shared, md.num_warps,
                                        md.num_stages, reg, loc))
                if progress is not None:
                    progress.update(1)
    return out


def over_limit(arch: int, compiled: list[Compiled]) -> list[str]:
    """One line per kernel that would not launch on ``sm_{arch}``: more shared memory than
    a thread block may have there."""
    limit = SHARED_LIMIT.get(arch)
    return [f"{c.variant}: {c.kernel} needs {c.shared} bytes of shared memory, sm_{arch} has "
            f"{limit}" for c in compiled if limit is not None and c.shared > limit]


def spills(compiled: list[Compiled]) -> list[str]:
    """One line per kernel that spills registers (it runs, slower)."""
    return [f"{c.variant}: {c.kernel} spills, {c.local} bytes of stack per thread at "
            f"{c.registers} registers" for c in compiled if c.local]
