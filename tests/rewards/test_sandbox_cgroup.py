"""The memory cgroup per worker slot (rewards/cgroup.py), on both layouts: cgroup v2
(``memory.max``) and the v1 memory controller (``memory.limit_in_bytes``). A machine has
one of them, so each is also set up as a fake cgroup file system, plain directories where
the kernel would put its files: what orbitrl writes and reads there is checked, and a
sandbox run through each fake tree enters it (its pid lands in ``cgroup.procs``) and keeps
its other bounds, the one file budget and the SysV IPC refusal, which do not need a cgroup
(the kernel's limit itself is absent from a fake tree; tests/rewards/test_sandbox_hostile.py
runs the real one where this machine can make it)."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from orbitrl.config import SandboxSection
from orbitrl.rewards import cgroup
from orbitrl.rewards.cgroup import SlotCgroups
from orbitrl.rewards.sandbox import Job, Sandbox
from sandbox_util import BACKENDS, LIMITS, SYSV_PROBE, SYSV_REFUSED, fill_three, sandbox

LIMIT = 64 << 20


@pytest.fixture
def fake(monkeypatch):
    """fake(layout) -> this process's cgroup directory in a fake tree of that layout (which
    anyone may enter, as a real one: a slot's uid writes its pid there)."""
    top = Path(tempfile.mkdtemp(prefix="orbitrl-cgroup-"))
    os.chmod(top, 0o755)

    def make(layout: str) -> str:
        root = top / "cgroup"
        if layout == "v2":
            own = root / "me"
            own.mkdir(parents=True)
            (root / "cgroup.controllers").write_text("cpu io memory pids\n")
            (top / "self").write_text("0::/me\n")
        else:  # v1, hybrid as many machines have it: no cgroup.controllers at the top
            own = root / "memory" / "me"
            own.mkdir(parents=True)
            (top / "self").write_text("5:cpu,cpuacct:/\n4:memory:/me\n0::/\n")
        monkeypatch.setattr(cgroup, "_V2", str(root))
        monkeypatch.setattr(cgroup, "_V1", str(root / "memory"))
        monkeypatch.setattr(cgroup, "_SELF", str(top / "self"))
        real_mkdir = os.mkdir

        def mkdir(path, *args, **kwargs):  # as the kernel does: a new cgroup has its files
            real_mkdir(path, *args, **kwargs)
            if os.path.abspath(path).startswith(str(root) + os.sep):
                open(os.path.join(path, "cgroup.procs"), "w").close()

        monkeypatch.setattr(os, "mkdir", mkdir)
        return str(own)

    yield make
    shutil.rmtree(top, ignore_errors=True)


def _uids(n: int) -> list[int]:
    return [61000 + k for k in range(n)] if os.geteuid() == 0 else [-1] * n


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def test_v2_layout(fake):
    """v2: a parent with the memory controller enabled for its children, one child per
    slot with memory.max, cgroup.procs handed to the slot's uid; OOM kills read from
    memory.events."""
    own = fake("v2")
    cg = SlotCgroups.create(2, LIMIT, _uids(2))
    assert cg is not None and cg.v2
    (parent,) = os.listdir(own)
    assert _read(os.path.join(own, parent, "cgroup.subtree_control")) == "+memory"
    assert cg.dirs == [os.path.join(own, parent, f"{parent}-{k}") for k in range(2)]
    for k, d in enumerate(cg.dirs):
        assert _read(os.path.join(d, "memory.max")) == str(LIMIT)
        if os.geteuid() == 0:
            assert os.stat(os.path.join(d, "cgroup.procs")).st_uid == 61000 + k
    with open(os.path.join(cg.dirs[1], "memory.events"), "w") as f:
        f.write("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\noom_group_kill 0\n")
    assert (cg.oom_kills(0), cg.oom_kills(1)) == (0, 2)
    argv = cg.wrap(1, ["prog", "arg"])
    assert argv[-3:] == [os.path.join(cg.dirs[1], "cgroup.procs"), "prog", "arg"]


def test_v1_layout(fake):
    """v1: one cgroup per slot right under this process's, memory.limit_in_bytes and (where
    swap is accounted) memory.memsw.limit_in_bytes; OOM kills read from memory.oom_control."""
    own = fake("v1")
    cg = SlotCgroups.create(2, LIMIT, _uids(2))
    assert cg is not None and not cg.v2
    assert sorted(os.listdir(own)) == sorted(os.path.basename(d) for d in cg.dirs)
    for d in cg.dirs:
        assert os.path.dirname(d) == own
        assert _read(os.path.join(d, "memory.limit_in_bytes")) == str(LIMIT)
        assert _read(os.path.join(d, "memory.memsw.limit_in_bytes")) == str(LIMIT)
    with open(os.path.join(cg.dirs[0], "memory.oom_control"), "w") as f:
        f.write("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    assert (cg.oom_kills(0), cg.oom_kills(1)) == (3, 0)


@pytest.mark.parametrize("layout", ["v2", "v1"])
def test_no_cgroup_where_this_process_has_none(fake, layout):
    """No memory line for this process: no cgroups, no error."""
    fake(layout)
    with open(cgroup._SELF, "w") as f:
        f.write("1:cpu:/\n")
    assert SlotCgroups.create(2, LIMIT, _uids(2)) is None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["v2", "v1"])
def test_a_run_enters_its_slot_and_keeps_its_bounds(fake, layout, backend):
    """Through each layout's code path: the program's pid is written to its slot's
    cgroup.procs before it starts, and it still gets one file budget and no SysV IPC."""
    sandbox(backend)  # skips where the backend does not work at all
    fake(layout)
    box = Sandbox(SandboxSection(backend=backend, **{**LIMITS, "workers": 1, "file_mb": 16}))
    assert box.cgroups is not None and box.cgroups.v2 == (layout == "v2")
    procs = os.path.join(box.cgroups.dirs[0], "cgroup.procs")
    os.truncate(procs, 0)
    assert box.run(Job(SYSV_PROBE)).stdout == SYSV_REFUSED
    assert int(_read(procs)) > 0
    res = box.run(Job(fill_three(16, catch=True)))
    assert res.status == "ok", res
    assert sum(eval(res.stdout)) <= 16 << 20
