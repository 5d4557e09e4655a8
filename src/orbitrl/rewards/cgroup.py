"""A memory cgroup per sandbox worker slot, where the machine lets us make one.

``RLIMIT_AS`` bounds what a program maps, not what it leaves in shared memory: a tmpfs file,
a memfd written with ``write()`` or a SysV segment it detached from hold pages that no
address space counts. A memory cgroup charges those pages to the program that touched them,
so a slot's cgroup with ``memory_mb`` as its limit bounds the program's whole footprint; past
it the kernel's OOM killer ends the program inside the cgroup, and the run is reported as
``memory``. The cgroups are made under this process's own (cgroup v2 ``memory.max``, or the
v1 memory controller's ``memory.limit_in_bytes``) and removed when the sandbox goes.
Where neither is writable (an unprivileged user, a container without delegation) there is
no cgroup; the sandbox still bounds tmpfs files by its one file budget (``file_mb``) and
refuses SysV IPC (sandbox.py), which leaves memfds, the gap docs/sandbox.md names.

A program enters its slot's cgroup before it starts: the launch command is wrapped in
``sh -c 'echo $$ > cgroup.procs && exec "$@"'``, so nothing it forks escapes and there is
no window in which it runs outside.
"""

from __future__ import annotations

import itertools
import os
import weakref

_IDS = itertools.count()  # several sandboxes in one process get distinct cgroups

_V2 = "/sys/fs/cgroup"
_V1 = "/sys/fs/cgroup/memory"
_SELF = "/proc/self/cgroup"  # this process's cgroups (the three paths: module-level for tests)


def _own(controller_root: str, v2: bool) -> str | None:
    """This process's cgroup directory under ``controller_root``, or None."""
    try:
        with open(_SELF) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, ctrls, path = line.split(":", 2)
        if (v2 and ctrls == "") or (not v2 and "memory" in ctrls.split(",")):
            d = os.path.join(controller_root, path.lstrip("/"))
            return d if os.path.isdir(d) else None
    return None


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class SlotCgroups:
    """One memory cgroup per slot; ``create`` returns None where none can be made."""

    def __init__(self, dirs: list[str], made: list[str], v2: bool):
        self.dirs, self.v2 = dirs, v2  # dirs[k]: slot k's cgroup
        self._finalizer = weakref.finalize(self, _remove, list(made))

    @classmethod
    def create(cls, workers: int, limit_bytes: int, uids: list[int]) -> "SlotCgroups | None":
        """Make ``workers`` cgroups limited to ``limit_bytes``; ``uids[k]`` (or -1) may move
        itself into cgroup k (it owns that cgroup's ``cgroup.procs``)."""
        for v2, root in ((True, _V2), (False, _V1)):
            if v2 and not os.path.exists(os.path.join(root, "cgroup.controllers")):
                continue
            base = _own(root, v2)
            if base is None:
                continue
            made: list[str] = []
            slots: list[str] = []
            name = f"orbitrl-sbx-{os.getpid()}-{next(_IDS)}"
            try:
                if v2:  # children need the memory controller enabled in their parent
                    parent = os.path.join(base, name)
                    os.mkdir(parent)
                    made.append(parent)
                    _write(os.path.join(parent, "cgroup.subtree_control"), "+memory")
                else:
                    parent = base
                for k in range(workers):
                    d = os.path.join(parent, f"{name}-{k}")
                    os.mkdir(d)
                    made.append(d)
                    slots.append(d)
                    _write(os.path.join(d, "memory.max" if v2 else "memory.limit_in_bytes"),
                           str(limit_bytes))
                    if not v2:  # swap too, where swap is accounted
                        try:
                            _write(os.path.join(d, "memory.memsw.limit_in_bytes"),
                                   str(limit_bytes))
                        except OSError:
                            pass
                    if uids[k] >= 0:
                        os.chown(os.path.join(d, "cgroup.procs"), uids[k], uids[k])
            except OSError:
                _remove(made)
                continue
            return cls(slots, made, v2)
        return None

    def wrap(self, slot: int, argv: list[str]) -> list[str]:
        """``argv`` started inside slot ``slot``'s cgroup."""
        procs = os.path.join(self.dirs[slot], "cgroup.procs")
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', procs] + argv

    def oom_kills(self, slot: int) -> int:
        """Programs the OOM killer has ended in this slot so far."""
        name = "memory.events" if self.v2 else "memory.oom_control"
        try:
            with open(os.path.join(self.dirs[slot], name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def close(self) -> None:
        self._finalizer()


def _remove(dirs: list[str]) -> None:
    for d in reversed(dirs):
        try:
            os.rmdir(d)
        except OSError:
            pass
