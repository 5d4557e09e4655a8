"""The Triton attention kernels compile for CUDA GPUs (no GPU needed): Triton's compiler to
a cubin for sm_90 and sm_86, every launch variant, shared memory within the limit."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from orbitrl.engine import triton_aot as aot  # noqa: E402

_CHILD = r"""
import json, sys
from orbitrl.engine import triton_aot as aot
out = {}
for arch, shape, fp8 in [(90, aot.AttentionShape(14, 2, 64, "bf16"), (False, True)),
                         (86, aot.AttentionShape(32, 8, 128, "bf16"), (True,))]:
    cs = aot.compile_all(arch, (shape,), fp8)
    out[arch] = dict(compiled=[c.__dict__ for c in cs], over=aot.over_limit(arch, cs))
json.dump(out, sys.stdout)
"""


@pytest.mark.slow
def test_every_variant_compiles_for_sm90_and_sm86():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    per_variant = {"decode": ["_decode_kernel"], "decode, window": ["_decode_kernel"],
                   "decode, 4 splits": ["_decode_kernel", "_reduce_kernel"],
                   "decode, prefix groups": ["_shared_prefix_kernel", "_decode_kernel",
                                             "_reduce_kernel"],
                   "decode, prefix groups, window": ["_shared_prefix_kernel",
                                                     "_decode_kernel", "_reduce_kernel"],
                   "prefill": ["_prefill_kernel"], "prefill, window": ["_prefill_kernel"],
                   "decode, sinks": ["_decode_kernel"],
                   "decode, 4 splits, sinks": ["_decode_kernel", "_reduce_kernel"],
                   "prefill, sinks": ["_prefill_kernel"]}
    assert len(per_variant) == aot.VARIANTS
    for arch, kv_dtypes in (("90", ("bf16", "fp8")), ("86", ("fp8",))):
        got = out[arch]
        assert got["over"] == []
        kernels: dict[str, list[str]] = {}
        for c in got["compiled"]:
            shape, name = c["variant"].split(": ")
            kernels.setdefault(name, []).append(c["kernel"])
            assert 0 < c["shared"] <= aot.SHARED_LIMIT[int(arch)]
            if c["kernel"] == "_decode_kernel":  # the hot path: bf16 decode must not spill
                assert c["local"] == 0, c
        assert kernels == {k: v * len(kv_dtypes) for k, v in per_variant.items()}


def test_over_limit_and_spills_name_the_kernel():
    ok = aot.Compiled("_decode_kernel", "v1", 1000, 4, 3, 64, 0)
    big = aot.Compiled("_prefill_kernel", "v2", aot.SHARED_LIMIT[86] + 1, 4, 3, 255, 0)
    spill = aot.Compiled("_prefill_kernel", "v3", 1000, 4, 3, 255, 328)
    assert aot.over_limit(86, [ok, big, spill]) == [
        f"v2: _prefill_kernel needs {aot.SHARED_LIMIT[86] + 1} bytes of shared memory, "
        f"sm_86 has {aot.SHARED_LIMIT[86]}"]
    assert aot.over_limit(90, [big]) == []
    assert aot.spills([ok, big, spill]) == [
        "v3: _prefill_kernel spills, 328 bytes of stack per thread at 255 registers"]


def test_compiling_refuses_an_interpreted_module(monkeypatch):
    from orbitrl.engine import triton_attention as ta

    monkeypatch.setattr(ta, "INTERPRETED", True)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        with aot.compiling_for(90):
            pass
