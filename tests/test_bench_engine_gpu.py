"""benchmarks/bench_engine_gpu.py's code, run end to end on the CPU with a tiny model (its
``--device cpu`` smoke mode): every system's row and the per-step line print, so the script
that the one GPU run depends on has already run here (its timings mean nothing)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_rollout_benchmark_runs_on_cpu():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_engine_gpu.py"),
                        "--device", "cpu", "--tiny", "--quick", "--n", "2"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert "failed" not in out.lower(), out
    for row in ("every sample 32 tokens", "long-tailed caps"):
        assert f"{row}: 8 prompts x n=2" in out
    for system in ("orbitrl", "orbitrl, async_decode off", "transformers generate (repeat run)"):
        assert out.count(f"| {system} | ") == 2, system
    assert out.count("| transformers generate_batch | ") == 1  # --quick: the tail row only
    assert out.count("orbitrl: decode at batch ") == 2
    assert out.count("orbitrl, async_decode off: decode at batch ") == 2
