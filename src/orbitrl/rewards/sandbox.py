"""Run untrusted Python programs: one process per program, isolated and bounded.

Each program gets a fresh, empty working directory, a cleared environment, its own user id
(when orbitrl runs as root), and limits on CPU time, wall time, address space, open files,
file size and processes. The isolation comes from one of three backends:

- ``bwrap`` (bubblewrap): new user, pid, network, ipc, uts and cgroup namespaces; a root
  file system holding only the interpreter, its standard library and the system libraries
  (read-only), /dev with the usual null/zero/urandom nodes. Nothing else of the host is
  visible.
- ``unshare`` (fallback when bwrap is missing): new network, pid, ipc and mount namespaces,
  an unprivileged uid when started as root. The file system is the host's: the program can
  read what Unix permissions let its uid read; the host's world-writable and socket
  directories (/tmp, /var/tmp, /dev/shm, /run) are covered. See docs/sandbox.md.
- ``rlimits``: limits and the uid only, no namespaces (no network isolation); never chosen
  by ``auto``.

On bwrap and unshare everything the program can write is one budget: a single tmpfs of
``file_mb`` (and one inode per KiB of it) that the harness mounts on the working directory,
with directories on it bind-mounted on /tmp and /dev/shm (and, on the fallback, /var/tmp
and /run), so all of them together hold at most ``file_mb``; ``RLIMIT_FSIZE`` also caps
each file. SysV IPC (shared memory segments, message queues, semaphores: kernel memory that
no address space counts) is refused by a seccomp filter on every backend.

Why a separate uid: RLIMIT_NPROC is counted per user and ignored for root, so a fork bomb
is only bounded when the program runs as an unprivileged uid. Each worker slot gets its own
uid (``uid_base + slot``) so one program's fork bomb cannot starve a neighbour's threads.

Why a trusted harness: the interpreter starts on ``_HARNESS``, which sets the limits (and,
in the fallback, drops root) before it compiles and runs the program; it writes one marker
byte to stderr first, so a run whose stderr lacks it failed in the sandbox itself
(``sandbox_error``), which a program cannot fake after the fact. In a pid namespace the
harness is the namespace's init (bwrap ``--as-pid-1``, unshare ``--fork``): it forks the
program and exits with its status. The program cannot signal it (an init ignores signals
from inside its namespace), and when it exits the kernel kills whatever the program left
behind. bwrap's own init is not used because bwrap's outer process exits without reaping it,
leaving a zombie for the host's init to collect.

Output is read incrementally and bounded: past ``output_kb`` the program is killed, so
printing a gigabyte costs at most that much host memory.
"""

from __future__ import annotations

import errno
import functools
import json
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass

from orbitrl.config import SandboxSection
from orbitrl.errors import OrbitError
from orbitrl.rewards.cgroup import SlotCgroups
from orbitrl.rewards.probes import HARNESS_PROBES, RECORD
from orbitrl.rewards.procpool import Launch, RunResult, run_pool

# exit code of the harness when the program ran out of address space (MemoryError)
EXIT_MEMORY = 86
MARKER = b"\x1e"

# argv: uid (-1 = keep), nproc, cpu_s, as_bytes, fsize, nofile, fork_if_init (0/1), the file
# system to set up (JSON: "hide", directories covered by an empty read-only tmpfs; "tmp",
# directories that become writable; "newns", whether to make a mount namespace first, as
# bwrap's harness must), the seccomp program refusing SysV IPC (hex, or empty), and for an
# assert test the JSON list of probes (rewards/probes.py). Writable places share one tmpfs
# of fsize bytes (the budget), mounted on the work dir: the work dir and each "tmp" directory
# are bind mounts of directories on it. As init it forks the program and reports its status
# the way a shell does (128 + signal). The marker byte goes out once the sandbox is set up.
_HARNESS = r"""
import os, sys, ctypes, resource as R, json as _json
uid, nproc, cpu, mem, fsize, nofile, fork = map(int, sys.argv[1:8])
_fs = _json.loads(sys.argv[8])
_filter = bytes.fromhex(sys.argv[9])
_probes = _json.loads(sys.argv[10]) if len(sys.argv) > 10 else None
RECORD = %r
_libc = ctypes.CDLL(None, use_errno=True)
def _fail(code, what):
    os.write(2, ("%%s: %%s\n" %% (what, os.strerror(ctypes.get_errno()))).encode())
    os._exit(code)
def _mount(src, dst, fstype, flags, opts):
    if _libc.mount(src, dst.encode(), fstype, flags, opts) != 0:
        _fail(70, "cannot mount on %%s" %% dst)
def _drop_caps():
    for _cap in range(64):
        _libc.prctl(24, _cap, 0, 0, 0)  # PR_CAPBSET_DROP (fails harmlessly past the last)
    _hdr = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    if _libc.capset(_hdr, (ctypes.c_uint32 * 6)()) != 0:
        _fail(72, "cannot drop capabilities")
if _fs.get("newns") and _libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
    _fail(70, "cannot make a mount namespace")
_tmp, _hide = _fs.get("tmp", []), _fs.get("hide", [])
if _tmp:
    with open("main.py", "rb") as f:
        _src = f.read()
    _work = os.getcwd()
    # the budget: one tmpfs (nosuid, nodev; one inode per KiB) on the work dir, whose
    # directory "w" becomes the work dir first, while the path still leads there (a cover
    # below may hide it); the bind sources below are relative to the budget's root
    _mount(b"tmpfs", _work, b"tmpfs", 6,
           ("size=%%d,nr_inodes=%%d,mode=0755" %% (fsize, max(64, fsize >> 10))).encode())
    _root = os.open(_work, os.O_RDONLY | os.O_DIRECTORY)
    os.fchdir(_root)
    os.mkdir("w", 0o700)
    if uid >= 0 and os.geteuid() == 0:
        os.chown("w", uid, uid)
    _mount(b"w", _work, None, 4096, None)  # MS_BIND
    _wd = os.open(_work, os.O_RDONLY | os.O_DIRECTORY)
for _d in _hide:  # before the tmp dirs: a hidden dir may be in /tmp
    _mount(b"tmpfs", _d, b"tmpfs", 1, b"size=4k,mode=0555")
if _tmp:
    for _k, _d in enumerate(_tmp):
        os.mkdir("t%%d" %% _k)
        os.chmod("t%%d" %% _k, 0o1777)
        _mount(b"t%%d" %% _k, _d, None, 4096, None)
    os.fchdir(_wd)
    os.close(_root); os.close(_wd)
    with open("main.py", "wb") as f:
        f.write(_src)
    if uid >= 0 and os.geteuid() == 0:
        os.chown("main.py", uid, uid)
if uid < 0 and (_tmp or _hide) and os.geteuid() == 0:
    # no uid to drop to (the fallback without root runs as root of its user namespace):
    # a nested user + mount namespace locks the mounts (they cannot be unmounted, nor
    # bind-mounted away), then every capability goes
    if _libc.unshare(0x10000000 | 0x00020000) != 0:  # CLONE_NEWUSER | CLONE_NEWNS
        _fail(72, "cannot lock the covers")
    _drop_caps()
elif _fs.get("newns"):  # bwrap lent the harness CAP_SYS_ADMIN and CAP_SETPCAP for the mounts
    _drop_caps()
if _libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS: setuid binaries gain nothing
    os.write(2, b"cannot set no_new_privs\n")
    os._exit(71)
if _filter:  # SysV IPC refused (and any other syscall ABI): PR_SET_SECCOMP, SECCOMP_MODE_FILTER
    class _Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
    if _libc.prctl(22, 2, ctypes.byref(_Prog(len(_filter) // 8, _filter)), 0, 0) != 0:
        _fail(73, "cannot install the seccomp filter")
os.write(2, b"\x1e")
if fork and os.getpid() == 1:
    pid = os.fork()
    if pid:
        st = os.waitpid(pid, 0)[1]
        os._exit(128 + os.WTERMSIG(st) if os.WIFSIGNALED(st) else os.WEXITSTATUS(st))
if uid >= 0 and os.geteuid() == 0:
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
_keyctl = {"x86_64": 250, "aarch64": 219}.get(os.uname().machine)
if _keyctl:  # KEYCTL_CLEAR the slot uid's keyrings: nothing passes to the next program
    for _ring in (-4, -5):  # user, user-session
        _libc.syscall(_keyctl, 7, _ring)
for k, v in ((R.RLIMIT_CPU, (cpu, cpu + 1)), (R.RLIMIT_AS, (mem, mem)),
             (R.RLIMIT_FSIZE, (fsize, fsize)), (R.RLIMIT_NOFILE, (nofile, nofile)),
             (R.RLIMIT_NPROC, (nproc, nproc)), (R.RLIMIT_CORE, (0, 0))):
    R.setrlimit(k, v)
del uid, nproc, cpu, mem, fsize, nofile, fork, k, v, R, _fs, _tmp, _hide, _filter, _libc
sys.argv = ["main.py"]
with open("main.py", "rb") as f:
    src = f.read()
g = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
try:
    exec(compile(src, "main.py", "exec"), g)
    if _probes is not None:
%s
except MemoryError:
    os.write(2, b"MemoryError\n")
    os._exit(86)
""" % (RECORD, textwrap.indent(HARNESS_PROBES.strip("\n"), " " * 8))


@dataclass
class Job:
    """One program run: its source, what it reads on stdin, and for an assert test the
    expressions whose values the harness reports after the program ran (probes.py)."""

    source: str
    stdin: bytes = b""
    probes: tuple[str, ...] | None = None


@dataclass(frozen=True)
class _Python:
    executable: str
    binds: tuple[str, ...]  # directories the interpreter needs (stdlib, its shared library)
    hidden: tuple[str, ...]  # site-packages directories inside those, masked by a tmpfs


class Sandbox:
    """Runs programs under one SandboxSection's limits.

    Args:
        cfg: the limits and backend (config ``reward.sandbox``).

    Raises:
        OrbitError: the requested backend (or, for ``auto``, every backend) does not work on
            this machine, or no interpreter the sandbox user can run was found.
    """

    def __init__(self, cfg: SandboxSection | None = None):
        self.cfg = cfg or SandboxSection()
        self.workers = self.cfg.workers or os.cpu_count() or 1
        self.as_root = os.geteuid() == 0
        self.python = _find_python(self.cfg.python, self.as_root)
        self.cover = _fallback_cover(self.python)
        self.cgroups = SlotCgroups.create(
            self.workers, self.cfg.memory_mb << 20,
            [self.cfg.uid_base + k if self.as_root else -1 for k in range(self.workers)])
        order = ["bwrap", "unshare"] if self.cfg.backend == "auto" else [self.cfg.backend]
        problems = []
        for backend in order:
            problem = _probe(self, backend)
            if problem is None:
                self.backend = backend
                break
            problems.append(f"{backend}: {problem}")
        else:
            raise OrbitError(f"config key 'reward.sandbox.backend' ({self.cfg.backend}): no "
                             f"working sandbox ({'; '.join(problems)}); install bubblewrap, "
                             f"or set reward.sandbox.backend=rlimits to run without namespaces")
        _warn_once(self)

    def run(self, job: Job) -> RunResult:
        """Run one program (see run_many)."""
        return self.run_many([job])[0]

    def run_many(self, jobs: list[Job], deadline_s: float | None = None) -> list[RunResult]:
        """Run programs, up to ``workers`` at once, each under the per-test limits.

        Args:
            jobs: the programs.
            deadline_s: the whole batch's budget (default: the config's ``deadline_s``);
                programs running at that moment are killed, those not started are not
                started, and both are reported with status ``deadline``.

        Returns:
            One RunResult per job, in order.
        """
        deadline = self.cfg.deadline_s if deadline_s is None else deadline_s
        return run_pool([functools.partial(self._launch, job) for job in jobs],
                        self.workers, deadline, self.cfg.time_limit_s,
                        self.cfg.output_kb * 1024, _classify)

    # --- one launch --------------------------------------------------------------------
    def _launch(self, job: Job, slot: int, backend: str | None = None) -> Launch:
        """Start ``job`` in worker slot ``slot``; the pool owns the process from then on."""
        backend = backend or self.backend
        c = self.cfg
        uid = c.uid_base + slot if self.as_root else -1
        harness = [self.python.executable, "-S", "-s", "-B", "-X", "utf8", "-c", _HARNESS,
                   str(uid), str(c.max_procs), str(max(1, math.ceil(c.time_limit_s))),
                   str(c.memory_mb << 20), str(c.file_mb << 20), str(c.open_files)]
        env = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "LC_ALL": "C.UTF-8"}
        fs = {"bwrap": {"tmp": list(_BWRAP_TMP), "newns": True},
              "unshare": self.cover}.get(backend, {})
        tail = [json.dumps(fs), _SYSV_FILTER.hex()] + (
            [] if job.probes is None else [json.dumps(list(job.probes))])
        cg = self.cgroups
        enter = (lambda argv: cg.wrap(slot, argv)) if cg else (lambda argv: argv)
        ooms = cg.oom_kills(slot) if cg else 0
        stdin = _memfile(job.stdin)
        workdir = None
        try:
            if backend == "bwrap":
                prog = _memfile(job.source.encode())
                argv = enter(self._bwrap_argv(prog, uid) + harness + ["1"] + tail)
                user = dict(user=uid, group=uid, extra_groups=[]) if self.as_root else {}
                try:
                    proc = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, env=env, cwd="/",
                                            pass_fds=(prog,), start_new_session=True, **user)
                finally:
                    os.close(prog)
            else:
                workdir = tempfile.mkdtemp(prefix="orbitrl-sbx-")
                with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
                    f.write(job.source)
                if self.as_root:
                    for p in (workdir, os.path.join(workdir, "main.py")):
                        os.chown(p, uid, uid)
                prefix = _unshare_prefix(self.as_root) if backend == "unshare" else []
                proc = subprocess.Popen(enter(prefix + harness + ["1" if prefix else "0"] + tail),
                                        stdin=stdin, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, env=env, cwd=workdir,
                                        start_new_session=True)
        except BaseException:
            if workdir:
                shutil.rmtree(workdir, ignore_errors=True)
            raise
        finally:
            os.close(stdin)
        def cleanup() -> None:
            if backend == "rlimits" and uid >= 0:
                _kill_uid(uid, self.python.executable)
            if workdir:
                shutil.rmtree(workdir, ignore_errors=True)

        def explain() -> tuple[str, str] | None:
            if cg and cg.oom_kills(slot) > ooms:
                return "memory", f"out of memory (memory cgroup, {c.memory_mb} MB)"
            return None
        return Launch(proc, cleanup, wrapped=backend != "rlimits", explain=explain)

    def _bwrap_argv(self, prog_fd: int, uid: int) -> list[str]:
        argv = ["bwrap", "--unshare-all", "--unshare-user", "--disable-userns",
                "--die-with-parent", "--new-session", "--clearenv", "--as-pid-1",
                "--setenv", "PYTHONHASHSEED", "0", "--setenv", "LC_ALL", "C.UTF-8"]
        if uid >= 0:
            argv += ["--uid", str(uid), "--gid", str(uid)]
        # for the harness only, which mounts the file budget and drops them (_HARNESS)
        argv += ["--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_SETPCAP"]
        for d in ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/lib32", "/lib32"):
            if os.path.islink(d):
                argv += ["--symlink", os.readlink(d), d]
            elif os.path.isdir(d):
                argv += ["--ro-bind", d, d]
        for d in self.python.binds:
            argv += ["--ro-bind", d, d]
        for d in self.python.hidden:  # empty and read-only
            argv += ["--size", "4096", "--tmpfs", d, "--remount-ro", d]
        # the root and /dev (bwrap's own tmpfs) are read-only once built; the harness mounts
        # the one writable tmpfs (file_mb) on /sandbox, and binds its directories on /tmp and
        # /dev/shm (which --dev makes)
        argv += ["--ro-bind", self.python.executable, self.python.executable,
                 "--dev", "/dev", "--proc", "/proc", "--dir", "/tmp", "--dir", "/sandbox",
                 "--file", str(prog_fd), "/sandbox/main.py", "--chdir", "/sandbox",
                 "--remount-ro", "/dev", "--remount-ro", "/", "--"]
        return argv


_WARNED: set[str] = set()


def _warn_once(box: "Sandbox") -> None:
    """One line on stderr, once per process and kind, for the gaps docs/sandbox.md lists."""
    gaps = []
    if box.backend != "bwrap":
        gaps.append(f"the {box.backend} sandbox shows programs the host file system "
                    f"(world-readable files, including datasets outside the run's working "
                    f"directory; unix sockets outside /tmp and /run)")
    if box.cgroups is None:
        gaps.append("no memory cgroup, so memfds are not bounded by memory_mb")
        if not _SYSV_FILTER:
            gaps.append(f"SysV IPC is not refused on this machine ({os.uname().machine}), "
                        f"so SysV shared memory is not bounded")
    for gap in gaps:
        if gap not in _WARNED:
            _WARNED.add(gap)
            print(f"orbitrl: warning: {gap}; see docs/sandbox.md", file=sys.stderr)


def _classify(rc: int, stderr: bytes, time_limit_s: float) -> tuple[str, str]:
    """(status, reason) of a process that exited on its own with code ``rc``."""
    if not stderr.startswith(MARKER):
        text = stderr.decode("utf-8", "replace").strip().splitlines()
        return "sandbox_error", f"sandbox failed (exit {rc}): {text[-1] if text else 'no message'}"
    if rc == 0:
        return "ok", ""
    if rc == EXIT_MEMORY:
        return "memory", "out of memory (address-space limit)"
    if rc > 128:
        sig = rc - 128
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        if sig == signal.SIGXCPU:
            return "time_limit", f"CPU time limit ({time_limit_s:g} s)"
        if sig == signal.SIGXFSZ:
            return "file_limit", "file size limit"
        return "signal", f"killed by {name}"
    lines = stderr[1:].decode("utf-8", "replace").strip().splitlines()
    last = lines[-1].strip() if lines else ""
    if last.startswith("OSError: [Errno 27]") or last.startswith("OSError: [Errno 28]"):
        # Python ignores SIGXFSZ, so a file past the limit (or a full tmpfs) is an OSError
        return "file_limit", f"file size limit: {last[:120]}"
    return "runtime_error", f"exit {rc}" + (f": {last[:160]}" if last else "")


def _kill_uid(uid: int, python: str) -> None:
    """Kill every process of ``uid`` (a worker slot's own uid): without a pid namespace,
    children a program left behind outlive it. kill(-1) from that uid reaches exactly them."""
    kill = shutil.which("kill")
    argv = ([kill, "-9", "--", "-1"] if kill else
            [python, "-S", "-c", "import os, signal; os.kill(-1, signal.SIGKILL)"])
    subprocess.run(argv, user=uid, group=uid, extra_groups=[], env={}, cwd="/", timeout=10,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _memfile(data: bytes) -> int:
    """A readable fd positioned at the start of ``data`` (a memfd, else an unlinked file)."""
    try:
        fd = os.memfd_create("orbitrl-sbx", 0)
    except (AttributeError, OSError):
        fd, path = tempfile.mkstemp(prefix="orbitrl-sbx-")
        os.unlink(path)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


# SysV IPC holds kernel memory that no address space counts (a 256 MB segment left detached,
# message queues, semaphore sets), and the programs never need it: every SysV IPC call fails
# with ENOSYS (as on a kernel built without it). machine -> (AUDIT_ARCH_*, the calls: shmget
# shmat shmctl shmdt msgget msgsnd msgrcv msgctl semget semop semctl semtimedop).
_SYSV_CALLS = {
    "x86_64": (0xC000003E, (29, 30, 31, 67, 68, 69, 70, 71, 64, 65, 66, 220)),
    "aarch64": (0xC00000B7, tuple(range(186, 198))),  # the generic syscall table
    "riscv64": (0xC00000F3, tuple(range(186, 198))),
}


def _sysv_filter(machine: str) -> bytes:
    """A seccomp program (``struct sock_filter[]``) that makes every SysV IPC call fail with
    ENOSYS, and every call of another ABI (i386's ``int 0x80``, x32) too, so the IPC calls
    cannot be reached by another number; b"" for a machine not in ``_SYSV_CALLS``."""
    if machine not in _SYSV_CALLS:
        return b""
    arch, calls = _SYSV_CALLS[machine]
    deny, allow = 0x00050000 | errno.ENOSYS, 0x7FFF0000  # SECCOMP_RET_ERRNO, _ALLOW
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, |JGE|K, BPF_RET
    body = [(jge, 0x40000000)] if machine == "x86_64" else []  # the x32 ABI
    body += [(jeq, nr) for nr in calls]
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, deny), (ld, 0, 0, 0)]
    # a match jumps over the rest of the body and the allow, to the deny
    prog += [(op, len(body) - i, 0, k) for i, (op, k) in enumerate(body)]
    prog += [(ret, 0, 0, allow), (ret, 0, 0, deny)]
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog)


_SYSV_FILTER = _sysv_filter(os.uname().machine)
_BWRAP_TMP = ("/tmp", "/dev/shm")  # bwrap's writable places besides the work dir


def _unshare_prefix(as_root: bool) -> list[str]:
    """unshare(1): new network, pid (with its own /proc), IPC and mount namespaces; without
    root, a user namespace too. In the mount namespace the harness covers the host's
    writable and socket directories and the task data (``_fallback_cover``)."""
    return ["unshare", "--net", "--pid", "--fork", "--kill-child", "--ipc", "--mount",
            "--mount-proc"] + ([] if as_root else ["-r"])


def _fallback_cover(python: _Python) -> dict[str, list[str]]:
    """Directories the unshare fallback covers: world-writable and socket directories become
    directories of the program's one file budget ("tmp"); orbitrl's own package (the
    built-in tasks' answers) and the working directory of the run (its data and run
    directory) get an empty read-only tmpfs ("hide"), unless the interpreter lives under
    it; /sys and /dev/mqueue too."""
    tmp = [d for d in ("/tmp", "/var/tmp", "/dev/shm", "/run")
           if os.path.isdir(d) and not os.path.islink(d)]
    needed = [python.executable, *python.binds]
    hide = []
    for d in (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.getcwd()):
        d = os.path.realpath(d)
        if d.count(os.sep) >= 2 and d not in hide and d not in tmp and \
                not any(n == d or n.startswith(d + os.sep) for n in needed):
            hide.append(d)
    # cgroup files, devices; the host IPC namespace's POSIX queues (systemd mounts them
    # world-writable): not needed
    hide += [d for d in ("/sys", "/dev/mqueue") if os.path.isdir(d) and not os.path.islink(d)]
    return {"tmp": tmp, "hide": hide}


def _world_usable(path: str) -> bool:
    """Whether a uid with no groups in common can reach ``path`` (every parent searchable
    by others, the file itself readable/executable by others)."""
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    for i in range(2, len(parts)):
        if not os.stat(os.sep.join(parts[:i]) or os.sep).st_mode & 0o001:
            return False
    return bool(os.stat(path).st_mode & 0o005 == 0o005)


@functools.lru_cache(maxsize=None)
def _python_info(executable: str) -> _Python | None:
    code = ("import sys, sysconfig, os; p = sysconfig.get_paths(); "
            "print(p['stdlib']); print(p['platstdlib']); "
            "print(sysconfig.get_config_var('LIBDIR') or ''); "
            "print(sysconfig.get_config_var('LDLIBRARY') or '')")
    try:
        out = subprocess.run([executable, "-S", "-s", "-c", code], capture_output=True,
                             text=True, timeout=30, env={})
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    stdlib, platstdlib, libdir, ldlib = (out.stdout.splitlines() + ["", "", "", ""])[:4]
    binds = {os.path.realpath(stdlib), os.path.realpath(platstdlib)}
    if libdir and ldlib and os.path.exists(os.path.join(libdir, ldlib)):
        binds.add(os.path.realpath(os.path.join(libdir, ldlib)))
    system = ("/usr/lib/", "/usr/lib64/", "/lib/", "/lib64/")
    binds = tuple(sorted(b for b in binds if os.path.exists(b)
                         and not (b + "/").startswith(system)))
    hidden = tuple(os.path.join(d, sub) for d in {os.path.realpath(stdlib)}
                   for sub in ("site-packages", "dist-packages")
                   if os.path.isdir(os.path.join(d, sub)))
    return _Python(os.path.realpath(executable), binds, hidden)


def _find_python(configured: str, as_root: bool) -> _Python:
    """The interpreter programs run with. As root, programs run as an unprivileged uid, so
    the interpreter must be usable by others (a Python installed under /root is not)."""
    if configured:
        candidates = [configured]
    else:
        ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
        candidates = [sys.executable, f"/usr/local/bin/{ver}", f"/usr/bin/{ver}",
                      "/usr/local/bin/python3", "/usr/bin/python3"]
    tried = []
    for c in candidates:
        path = shutil.which(c) if os.sep not in c else c
        if not path or not os.path.exists(path):
            tried.append(f"{c} (not found)")
            continue
        if as_root and not _world_usable(path):
            tried.append(f"{c} (not usable by an unprivileged uid)")
            continue
        info = _python_info(path)
        if info is None:
            tried.append(f"{c} (does not run)")
            continue
        return info
    raise OrbitError(f"config key 'reward.sandbox.python': no interpreter the sandbox can "
                     f"run; tried {', '.join(tried)}")


def _probe(box: Sandbox, backend: str) -> str | None:
    """None when ``backend`` runs a trivial program correctly here, else why not."""
    if backend == "bwrap" and shutil.which("bwrap") is None:
        return "bwrap not installed"
    if backend == "unshare" and shutil.which("unshare") is None:
        return "unshare not installed"
    job = Job("import math, json\nprint(json.dumps(math.gcd(12, 18)))\n")
    res = run_pool([lambda slot: box._launch(job, slot, backend)], 1, 30.0, 30.0, 1 << 16,
                   _classify)[0]
    if res.status == "ok" and res.stdout.strip() == b"6":
        return None
    return f"{res.status}: {res.reason or res.stdout[:80]!r}"
