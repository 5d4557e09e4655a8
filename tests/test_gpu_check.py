"""scripts/gpu_check.sh's checks before any GPU work, on this CPU machine: a Python module
that does not import stops it (exit 1, named) unless a wheel for it is in the wheels folder,
which it installs offline into a temporary folder; then no CUDA device stops it (exit 2)."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# hides torchao unless it comes from the folder the script installs wheels into
BLOCK = """
import sys, importlib.abc
class _Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torchao" and not any("orbitrl-gpu-site" in p for p in sys.path):
            raise ModuleNotFoundError("torchao hidden by the test")
        return None
sys.meta_path.insert(0, _Hide())
"""


def _run(tmp_path, wheels: Path, hide: bool):
    env = dict(os.environ, GPU_CHECK_WHEELS=str(wheels), TMPDIR=str(tmp_path),
               PYTHON=sys.executable)
    if hide:
        site = tmp_path / "hide"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(BLOCK)
        env["PYTHONPATH"] = str(site)
    return subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), "--preflight"],
                          capture_output=True, text=True, env=env, timeout=300)


def _fake_wheel(folder: Path) -> None:
    folder.mkdir()
    with zipfile.ZipFile(folder / "torchao-0.0.1-py3-none-any.whl", "w") as z:
        z.writestr("torchao/__init__.py", "__version__ = '0.0.1'\n")
        z.writestr("torchao-0.0.1.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: torchao\nVersion: 0.0.1\n")
        z.writestr("torchao-0.0.1.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("torchao-0.0.1.dist-info/RECORD", "")


@pytest.mark.skipif(not Path("/bin/bash").exists(), reason="needs bash")
def test_preflight_names_what_is_missing_installs_wheels_and_needs_a_device(tmp_path):
    for mod in ("triton", "torchao", "matplotlib"):  # what the check wants, besides torchao
        pytest.importorskip(mod)
    empty = tmp_path / "none"
    empty.mkdir()
    r = _run(tmp_path, empty, hide=True)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "do not import here: torchao" in r.stderr and "gpu_wheels.sh" in r.stderr

    wheels = tmp_path / "wheels"
    _fake_wheel(wheels)
    r = _run(tmp_path, wheels, hide=True)
    assert "installing the wheels" in r.stdout, r.stdout + r.stderr
    assert (tmp_path / "orbitrl-gpu-site" / "torchao" / "__init__.py").exists()
    assert r.returncode == 2 and "no CUDA device" in r.stderr  # past the packages

    r = _run(tmp_path, empty, hide=False)  # everything imports here: only the device
    assert r.returncode == 2 and "installing" not in r.stdout, r.stdout + r.stderr
