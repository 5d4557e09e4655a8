"""Backends to test on this machine: each one that works here (bwrap may be absent)."""

import functools
import shutil

import pytest

from orbitrl.config import SandboxSection
from orbitrl.errors import OrbitError
from orbitrl.rewards.sandbox import Sandbox

LIMITS = dict(time_limit_s=1.0, workers=2, memory_mb=256, output_kb=64, file_mb=8)


@functools.lru_cache(maxsize=None)
def sandbox(backend: str, **over) -> Sandbox:
    try:
        return Sandbox(SandboxSection(backend=backend, **{**LIMITS, **over}))
    except OrbitError as e:
        pytest.skip(f"backend {backend} unavailable here: {e}")


BACKENDS = ["bwrap", "unshare"]

# what `auto` picks on this machine; tests that are not about one backend use it
DEFAULT = "bwrap" if shutil.which("bwrap") else "unshare"
