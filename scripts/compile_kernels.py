"""Compile the engine's Triton attention kernels for a CUDA GPU, on any host (no GPU needed).

Every variant the engine launches on CUDA goes through Triton's compiler to a cubin for the
chosen architecture; the table gives each kernel's shared memory, warps, stages, registers
and spilled bytes. Exit status 1 when a kernel does not compile or needs more shared memory
than the architecture has (it would fail at its first launch); spills are reported, not
failed. See ``orbitrl/engine/triton_aot.py``.

    python scripts/compile_kernels.py                      # sm_90 (H100, H200), default shapes
    python scripts/compile_kernels.py --arch 86            # an RTX 30xx / A10 / A40
    python scripts/compile_kernels.py --model DIR          # that model's attention shape

The first run compiles about 120 kernels per architecture (about two minutes on two cores);
Triton caches them, so a rerun takes seconds.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compiled, not interpreted: set before Triton loads
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated


def main() -> int:
    from orbitrl.engine import triton_aot as aot
    from orbitrl.errors import OrbitError

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, choices=sorted(aot.SHARED_LIMIT),
                    help="CUDA compute capability without the dot (default 90)")
    ap.add_argument("--model", action="append", default=[],
                    help="a model directory whose attention shape to compile (repeatable; "
                         "default: the built-in set of shapes)")
    ap.add_argument("--no-fp8", action="store_true", help="skip the fp8 KV variants")
    a = ap.parse_args()
    try:
        shapes = tuple(aot.model_shape(m) for m in a.model) or aot.DEFAULT_SHAPES
    except OrbitError as e:
        print(f"compile_kernels: {e}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    fp8 = (False,) if a.no_fp8 else (False, True)
    bar = tqdm(total=len(shapes) * len(fp8) * aot.VARIANTS, unit="variant",
               desc=f"compiling for sm_{a.arch}")
    try:
        compiled = aot.compile_all(a.arch, shapes, fp8, progress=bar)
    except RuntimeError as e:
        bar.close()
        print(f"compile_kernels: FAILED: {e}", file=sys.stderr)
        return 1
    bar.close()
    print("\n| variant | kernel | shared (KiB) | warps | stages | registers | spilled (B) |")
    print("|---|---|---|---|---|---|---|")
    for c in compiled:
        print(f"| {c.variant} | {c.kernel} | {c.shared / 1024:.1f} | {c.num_warps} | "
              f"{c.num_stages} | {c.registers if c.registers is not None else '-'} | "
              f"{c.local if c.local is not None else '-'} |")
    worst = max(compiled, key=lambda c: c.shared)
    print(f"\n{len(compiled)} kernels compiled for sm_{a.arch}; the most shared memory: "
          f"{worst.shared} bytes ({worst.kernel}, {worst.variant}) of "
          f"{aot.SHARED_LIMIT[a.arch]}")
    for line in aot.spills(compiled):
        print(f"warning: {line}")
    bad = aot.over_limit(a.arch, compiled)
    for line in bad:
        print(f"FAILED: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
