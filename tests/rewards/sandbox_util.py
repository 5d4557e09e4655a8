"""Backends to test on this machine (each one that works here: bwrap may be absent), and the
hostile programs more than one test file runs."""

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


# the fallback as it runs without root (simulated as root: the harness keeps its uid, so it
# runs as root of the fallback's user namespace and locks its mounts in a nested one)
VARIANTS = ["bwrap", "unshare", "unshare, no root"]


@functools.lru_cache(maxsize=None)
def variant(name: str, **over) -> Sandbox:
    """A sandbox for one of VARIANTS."""
    if name != "unshare, no root":
        return sandbox(name, **over)
    box = sandbox_of_its_own("unshare", **over)
    box.as_root = False
    return box


def sandbox_of_its_own(backend: str, **over) -> Sandbox:
    """A new sandbox (not shared with other tests), to change after it is made."""
    try:
        return Sandbox(SandboxSection(backend=backend, **{**LIMITS, **over}))
    except OrbitError as e:
        pytest.skip(f"backend {backend} unavailable here: {e}")


def sysv_fill(segments: int, mb: int) -> str:
    """Fill ``segments`` SysV segments of ``mb`` MB each, detached after (pages that no
    address space counts); an assert fails when a segment cannot be had."""
    return ("import ctypes\nlibc = ctypes.CDLL(None)\nlibc.shmat.restype = ctypes.c_void_p\n"
            f"for _ in range({segments}):\n    sid = libc.shmget(0, {mb} * 2**20, 0o1600)\n"
            "    addr = libc.shmat(sid, None, 0)\n    assert addr not in (None, 2**64 - 1)\n"
            f"    ctypes.memset(addr, 1, {mb} * 2**20)\n    libc.shmdt(ctypes.c_void_p(addr))\n"
            "print(42)")


# asks for a 256 MB SysV segment, a message queue and a semaphore set; prints each
# result and errno (refused: -1 and ENOSYS, 38)
SYSV_PROBE = ("import ctypes\nl = ctypes.CDLL(None, use_errno=True)\n"
              "print(l.shmget(0, 256 * 2**20, 0o1600), ctypes.get_errno())\n"
              "print(l.msgget(0, 0o1600), ctypes.get_errno())\n"
              "print(l.semget(0, 1, 0o1600), ctypes.get_errno())")
SYSV_REFUSED = b"-1 38\n-1 38\n-1 38\n"

# the capability sets of the program, as {"CapEff": int, ...}
CAPS = ("print({l.split(':')[0]: int(l.split()[1], 16) for l in open('/proc/self/status')"
        " if l.startswith('Cap')})")


def fill_three(file_mb: int, catch: bool = False) -> str:
    """Write file_mb / 2 MB in the work dir, file_mb MB in /tmp and file_mb MB in /dev/shm,
    one file each (each within the file size limit), in 1 MB writes; with ``catch``, a file
    stops at its first error and the program prints the bytes each one got."""
    fill = ("def fill(path, mb):\n    n = 0\n    fd = os.open(path, os.O_WRONLY | os.O_CREAT)\n"
            "    b = b'x' * 2**20\n" +
            ("    try:\n        for _ in range(mb):\n            n += os.write(fd, b)\n"
             "    except OSError:\n        pass\n" if catch else
             "    for _ in range(mb):\n        n += os.write(fd, b)\n") +
            "    return n\n")
    got = (f"got = [fill('big', {file_mb // 2}), fill('/tmp/big', {file_mb}), "
           f"fill('/dev/shm/big', {file_mb})]\n")
    return "import os\n" + fill + got + ("print(got)\n" if catch else "")
