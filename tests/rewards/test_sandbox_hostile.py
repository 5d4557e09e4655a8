"""Hostile programs: each scores 0 with its reason recorded (a runaway one as "time_limit"),
leaves the host unharmed, and the next program runs normally. Run on every backend that
works here (bwrap, and the unshare fallback forced by config). How long the kill takes is
measured by benchmarks/bench_sandbox.py; a hang fails through tests/conftest.py's limit."""

import contextlib
import ctypes
import os
import shutil
import socket
import tempfile
import time

import pytest

from orbitrl.config import SandboxSection
from orbitrl.rewards.code import CodeReward
from orbitrl.rewards.sandbox import Job, Sandbox
from sandbox_util import (BACKENDS, CAPS, LIMITS, SYSV_PROBE, SYSV_REFUSED, VARIANTS,
                          fill_three, sandbox, sandbox_of_its_own, sysv_fill, variant)

SECRET = "orbitrl-secret-7f3a9c"
TEST = [{"input": "", "output": "42\n"}]


def host_dir(prefix: str) -> str:
    """A new directory on the host disk outside the places the fallback covers with its own
    tmpfs (/tmp, /var/tmp, /dev/shm, /run), so Unix permissions are what protects it."""
    for base in ("/var/lib", "/opt", "/srv"):
        if os.access(base, os.W_OK):
            return tempfile.mkdtemp(prefix=prefix, dir=base)
    return tempfile.mkdtemp(prefix=prefix)


@pytest.fixture(scope="module")
def planted():
    """A secret file only root can read, and a directory only root can write."""
    d = host_dir("orbitrl-host-")
    path = os.path.join(d, "secret.txt")
    with open(path, "w") as f:
        f.write(SECRET)
    os.chmod(path, 0o600)
    os.chmod(d, 0o755)
    yield d, path
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    srv.setblocking(False)
    yield srv
    srv.close()


def _hostile(planted, listener):
    d, secret = planted
    port = listener.getsockname()[1]
    return {
        "read_file": (f"print(open({secret!r}).read())", {"runtime_error"}),
        "write_outside": (f"open({os.path.join(d, 'pwned')!r}, 'w').write('x')\nprint(42)",
                          {"runtime_error"}),
        "socket": (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), "
                   f"timeout=1)\nprint(42)", {"runtime_error"}),
        "fork_bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n"
                      "    except OSError:\n        pass", {"time_limit"}),
        "infinite_loop": ("while True:\n    pass", {"time_limit"}),
        "alloc_20gb": ("x = bytearray(20 * 2**30)\nprint(42)", {"memory"}),
        "write_10gb": ("b = b'x' * 2**20\nwith open('big', 'wb') as f:\n"
                       "    for _ in range(10240):\n        f.write(b)\nprint(42)",
                       {"file_limit"}),
        "print_1gb": ("import sys\nb = 'x' * 2**20\nfor _ in range(1024):\n"
                      "    sys.stdout.write(b)", {"output_limit"}),
        # the parent is the namespace's init (ignores signals from inside) or root-owned;
        # kill(-1) reaches at most the program's own uid, i.e. itself
        "kill_parent": ("import os\nos.kill(os.getppid(), 9)\ntry:\n    os.kill(-1, 9)\n"
                        "except OSError:\n    pass\nprint('alive')",
                        {"runtime_error", "wrong", "signal"}),
        "missing_module": ("import no_such_module_orbitrl\nprint(42)", {"runtime_error"}),
        # shared memory no address space counts: a memfd, detached SysV segments (refused:
        # the attach fails), /dev/shm
        "memfd_1gb": ("import os\nfds = []\nfor _ in range(56):\n    fd = os.memfd_create('x')"
                      "\n    for _ in range(7):\n        os.write(fd, b'x' * 2**20)\n"
                      "    fds.append(fd)\nprint(42)", {"memory", "time_limit"}),
        "sysv_shm_1gb": (sysv_fill(8, 200), {"runtime_error"}),
        # 256 MB in segments that each fit the address-space limit: all outside it at the end
        "sysv_shm_256mb": (sysv_fill(4, 64), {"runtime_error"}),
        # one file budget: half of it in the work dir, all of it in /tmp and in /dev/shm
        # (each file within file_mb); what fits in one of them does not fit in all three
        "files_3_mounts": (fill_three(LIMITS["file_mb"]) + "print(42)", {"file_limit"}),
        "dev_shm_fill": ("b = b'x' * 2**20\nfor i in range(64):\n"
                         "    with open(f'/dev/shm/f{i}', 'wb') as f:\n        f.write(b * 15)\n"
                         "print(42)", {"file_limit", "runtime_error", "memory"}),
        "write_root": ("for d in ('/', '/dev', '/usr/lib'):\n    try:\n"
                       "        open(d + '/orbitrl-x', 'w').write('x')\n        print(42)\n"
                       "        break\n    except OSError:\n        pass\nelse:\n"
                       "    raise SystemExit(1)", {"runtime_error"}),
    }


def _uid_processes(uids):
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status") as f:
                    for line in f:
                        if line.startswith("Uid:"):
                            n += int(line.split()[1]) in uids
                            break
            except OSError:
                pass
    return n


def _gone(uids, within_s=5.0):
    """True once no process of ``uids`` is left (exiting ones may take a moment to reap)."""
    end = time.monotonic() + within_s
    while _uid_processes(uids):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


NAMES = ["read_file", "write_outside", "socket", "fork_bomb", "infinite_loop", "alloc_20gb",
         "write_10gb", "print_1gb", "kill_parent", "missing_module", "memfd_1gb",
         "sysv_shm_1gb", "sysv_shm_256mb", "dev_shm_fill", "files_3_mounts", "write_root"]
# without a memory cgroup, pages in memfds are not bounded (docs/sandbox.md)
NEEDS_CGROUP = {"memfd_1gb"}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", NAMES)
def test_hostile_program(backend, name, planted, listener):
    box = sandbox(backend)
    if name in NEEDS_CGROUP and box.cgroups is None:
        pytest.skip("no memory cgroup here: shared memory is the documented gap")
    reward = CodeReward(box.cfg)
    reward._sandbox = box
    source, statuses = _hostile(planted, listener)[name]
    parent = os.getppid()
    out = reward.score_batch(["p"], [f"```python\n{source}\n```"], [{"tests": TEST}])
    assert out.scores == [0.0] and not out.errors
    (detail,) = out.details[0]
    assert detail["status"] in statuses, detail
    assert detail["reason"], "a failure must say why"
    # the raw run: bounded output, no secret anywhere
    (res,) = box.run_many([Job(source)])
    assert len(res.stdout) <= LIMITS["output_kb"] * 1024
    assert SECRET not in (res.stdout + res.stderr).decode("utf-8", "replace") + res.reason
    assert SECRET not in detail["reason"]
    # the host: nothing written, no connection, parent untouched, the uid's processes gone
    assert not os.path.exists(os.path.join(planted[0], "pwned"))
    with pytest.raises(BlockingIOError):
        listener.accept()
    assert os.getppid() == parent
    if box.as_root:
        uids = set(range(box.cfg.uid_base, box.cfg.uid_base + box.workers))
        assert _gone(uids)
    # and the next program runs normally
    ok = reward.score_batch(["p"], ["print(6 * 7)"], [{"tests": TEST}])
    assert ok.scores == [1.0], ok.details


@pytest.mark.parametrize("backend", BACKENDS)
def test_fork_bomb_is_contained(backend):
    """While a fork bomb runs, its uid never holds more than max_procs processes (plus the
    sandbox's own init and wrapper)."""
    box = sandbox(backend)
    if not box.as_root:
        pytest.skip("per-slot uids need root; without it the bomb shares the user's count")
    import threading

    uids = set(range(box.cfg.uid_base, box.cfg.uid_base + box.workers))
    peak, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], _uid_processes(uids))
            time.sleep(0.02)

    t = threading.Thread(target=watch)
    t.start()
    res = box.run(Job("import os\nwhile True:\n    try:\n        os.fork()\n"
                      "    except OSError:\n        pass"))
    done.set()
    t.join()
    assert res.status == "time_limit"
    assert 3 <= peak[0] <= box.cfg.max_procs + 2, peak[0]
    assert _gone(uids)


@contextlib.contextmanager
def world_readable(text: str):
    """A file anyone may read, in a directory anyone may enter; removed afterwards."""
    d = host_dir("orbitrl-open-")
    try:
        os.chmod(d, 0o755)
        path = os.path.join(d, "open.txt")
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, 0o644)
        yield path
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_bwrap_hides_world_readable_files():
    """bwrap shows only the interpreter and system libraries: a world-readable file
    elsewhere does not exist inside."""
    box = sandbox("bwrap")
    with world_readable(SECRET) as path:
        res = box.run(Job(f"import os\nprint(os.path.exists({path!r}), "
                          f"os.path.exists({os.getcwd()!r}), sorted(os.listdir('/')))"))
        assert res.status == "ok"
        exists, cwd_visible, _ = res.stdout.decode().split(" ", 2)
        assert (exists, cwd_visible) == ("False", "False")
        res = box.run(Job("open('/tmp/x', 'w').write('y')\nprint(open('/tmp/x').read())"))
        assert res.stdout == b"y\n"  # a private /tmp works ...
        assert not os.path.exists("/tmp/x") or open("/tmp/x").read() != "y"  # ... privately


def test_fallback_leaves_world_readable_files_readable():
    """The documented gap of the unshare fallback: the host file system is visible, so a
    world-readable file can be read (permissions, not namespaces, protect files there)."""
    box = sandbox("unshare")
    with world_readable("visible") as path:
        assert box.run(Job(f"print(open({path!r}).read())")).stdout == b"visible\n"


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_new_privileges(backend):
    """no_new_privs is set: a setuid binary the program runs gains nothing."""
    res = sandbox(backend).run(Job("print([l.split()[1] for l in open('/proc/self/status') "
                                   "if l.startswith('NoNewPrivs')][0])"))
    assert (res.status, res.stdout) == ("ok", b"1\n")


@contextlib.contextmanager
def no_new_shm_segments(box):
    """The host gains no SysV segment of the sandbox's uids (the slot uids, or this user's);
    any it gained is removed: a segment outlives its creator, so a regression must not leave
    them behind."""
    uids = (set(range(box.cfg.uid_base, box.cfg.uid_base + box.workers)) if box.as_root
            else {os.geteuid()})

    def ids():
        with open("/proc/sysvipc/shm") as f:  # key shmid perms size cpid lpid nattch uid gid cuid
            rows = [line.split() for line in f.read().splitlines()[1:]]
        return {int(r[1]) for r in rows if int(r[9]) in uids}

    before = ids()
    try:
        yield
    finally:
        new = ids() - before
        for shmid in new:
            ctypes.CDLL(None).shmctl(shmid, 0, None)  # IPC_RMID
    assert not new, f"the host gained SysV segments {sorted(new)}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_ipc_is_private_to_one_run(backend):
    """A POSIX message queue one program leaves behind is gone for the next (same slot uid),
    and never reaches the host: each run has an IPC namespace of its own (SysV IPC, the other
    kind, is refused outright: test_sysv_ipc_is_refused)."""
    box = sandbox(backend, workers=1)
    lib = "import ctypes, os\nl = ctypes.CDLL(None, use_errno=True)\n"
    put = box.run(Job(lib + "q = l.mq_open(b'/orbitrl-q', os.O_CREAT | os.O_RDWR, 0o600, None)"
                            "\nprint(q >= 0 and l.mq_send(q, b'leaked', 6, 0) == 0)"))
    get = box.run(Job(lib + "print(l.mq_open(b'/orbitrl-q', os.O_RDONLY), ctypes.get_errno())"))
    assert (put.stdout, get.stdout) == (b"True\n", b"-1 2\n"), (put, get)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mq_open(b"/orbitrl-q", os.O_RDONLY) == -1 and ctypes.get_errno() == 2


@pytest.mark.parametrize("cgroup", ["as made here", "none"])
@pytest.mark.parametrize("backend", VARIANTS + ["rlimits"])
def test_sysv_ipc_is_refused(backend, cgroup):
    """256 MB of SysV shared memory lived outside RLIMIT_AS, bounded only by a memory
    cgroup; now every SysV IPC call fails with ENOSYS (a seccomp filter the harness
    installs), with a cgroup or without one, on every backend (rlimits too, where the
    program shares the host's IPC namespace). The host gains no segment."""
    box = variant(backend)
    if cgroup == "none":
        as_root = box.as_root
        box = sandbox_of_its_own(box.backend)
        box.as_root = as_root
        if box.cgroups is not None:
            box.cgroups.close()
        box.cgroups = None
    elif box.cgroups is None:
        pytest.skip("no memory cgroup can be made here")
    with no_new_shm_segments(box):
        assert box.run(Job(SYSV_PROBE)).stdout == SYSV_REFUSED
        res = box.run(Job(sysv_fill(4, 64)))
        assert res.status == "runtime_error" and b"AssertionError" in res.stderr, res


# the i386 ABI (int 0x80) from a 64-bit process: eax = 117 (ipc), ebx = 23 (SHMGET), ecx = 0
# (IPC_PRIVATE), edx = 4096 bytes, esi = IPC_CREAT | 0600; returns eax
I386_SHMGET = (
    "import ctypes, mmap\n"
    "code = bytes([0x53, 0xb8, 117, 0, 0, 0, 0xbb, 23, 0, 0, 0, 0x31, 0xc9, 0xba, 0, 0x10, 0, 0,"
    " 0xbe, 0x80, 0x03, 0, 0, 0xcd, 0x80, 0x5b, 0xc3])\n"
    "m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
    "m.write(code)\n"
    "print(ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(m)))())")


@pytest.mark.parametrize("backend", BACKENDS)
def test_sysv_ipc_is_refused_through_another_abi(backend):
    """The i386 system call ABI (int 0x80 from machine code the program writes) is another
    way to the same SysV calls: every call of another ABI fails with ENOSYS."""
    if os.uname().machine != "x86_64":
        pytest.skip("the i386 ABI is an x86_64 matter")
    box = sandbox(backend)
    with no_new_shm_segments(box):
        res = box.run(Job(I386_SHMGET))
        assert (res.status, res.stdout) == ("ok", b"-38\n"), res


@pytest.mark.parametrize("backend", VARIANTS)
def test_the_program_has_no_capabilities(backend):
    """The harness needs capabilities to mount the file budget (bwrap lends it CAP_SYS_ADMIN
    and CAP_SETPCAP; the fallback runs it as root, of the host or of a user namespace); the
    program has none (and, on bwrap, none left to gain)."""
    res = variant(backend).run(Job(CAPS))
    assert res.status == "ok", res
    caps = eval(res.stdout)
    assert caps["CapEff"] == caps["CapPrm"] == caps["CapInh"] == caps["CapAmb"] == 0, caps
    if backend == "bwrap":
        assert caps["CapBnd"] == 0, caps


@pytest.mark.parametrize("backend", VARIANTS)
def test_files_share_one_budget(backend):
    """The program that wrote 40 MB against file_mb 16 (8 MB in its work dir, 16 MB in /tmp,
    16 MB in /dev/shm, when each mount had its own cap) gets 16 MB in all; all of the budget
    is usable (less main.py's page); the next program starts with an empty one."""
    box = variant(backend, file_mb=16)
    res = box.run(Job(fill_three(16, catch=True)))
    assert res.status == "ok", res
    got = eval(res.stdout)
    assert got[0] == 8 << 20 and (15 << 20) < sum(got) <= 16 << 20, got
    res = box.run(Job("import os\nst = os.statvfs('.')\n"
                      "print(os.listdir('.'), os.listdir('/tmp'), os.listdir('/dev/shm'), "
                      "st.f_bfree * st.f_frsize >> 20)"))
    assert res.stdout == b"['main.py'] [] [] 15\n", res


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["/tmp", "/run"])
def test_host_unix_sockets_are_unreachable(backend, where):
    """A path-based unix socket of the host, in the places sockets live, cannot be reached
    (bwrap: not mounted; fallback: a private tmpfs covers them)."""
    if not os.path.isdir(where) or not os.access(where, os.W_OK):
        pytest.skip(f"{where} is not writable here")
    path = os.path.join(where, f"orbitrl-sock-{os.getpid()}")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    os.chmod(path, 0o777)
    srv.listen()
    srv.setblocking(False)
    try:
        res = sandbox(backend).run(Job(
            f"import socket\ns = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect({path!r})"
            f"\n    print('connected')\nexcept OSError as e:\n    print('refused')"))
        assert res.stdout == b"refused\n", res
        with pytest.raises(BlockingIOError):
            srv.accept()
    finally:
        srv.close()
        os.unlink(path)


@pytest.mark.parametrize("backend", BACKENDS)
def test_task_answers_are_not_readable_inside(backend):
    """The built-in tasks' tests and answers ship in orbitrl's package: not visible inside."""
    import orbitrl.data.code_tasks as tasks

    res = sandbox(backend).run(Job(f"import os\nprint(os.path.exists({tasks.__file__!r}))"))
    assert (res.status, res.stdout) == ("ok", b"False\n")


@pytest.mark.parametrize("backend", VARIANTS)
def test_every_writable_mount_is_one_budget(backend):
    """Every writable tmpfs the program can reach, and its work dir, are one file system
    (bind mounts of one tmpfs: one device) of file_mb in all; bwrap's root and /dev are
    read-only once built, and the host's tmpfs are covered on the fallback (a covered mount
    is still listed, but its path leads to the cover)."""
    box = variant(backend)
    res = box.run(Job(
        "import os\ntop = {}\nfor line in open('/proc/self/mounts'):\n"
        "    dev, mnt, fs, opts = line.split()[:4]\n    top[mnt] = (fs, opts.split(','))\n"
        "seen = [m for m, (fs, opts) in top.items()  # the last mount on a path is the one seen\n"
        "        if fs == 'tmpfs' and 'rw' in opts and os.path.ismount(m)]\n"
        "for m in seen + ['.']:\n"
        "    st = os.statvfs(m)\n    print(m, os.stat(m).st_dev, st.f_blocks * st.f_frsize)"))
    assert res.status == "ok", res
    rows = [line.split() for line in res.stdout.decode().splitlines()]
    assert {m for m, _, _ in rows} >= {".", "/tmp", "/dev/shm"}, rows
    assert len({dev for _, dev, _ in rows}) == 1, f"more than one writable file system: {rows}"
    assert {int(size) for _, _, size in rows} == {box.cfg.file_mb << 20}, rows


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_flood_on_stderr_does_not_stall_a_neighbour(backend):
    """A program that floods stderr is killed at the output limit; the correct programs
    that share the pool with it are scored on their own merits, not timed out while the
    pool waits on the flood's wrapper."""
    box = sandbox(backend)
    flood = Job("import os\nwhile True:\n    os.write(2, b'x' * 65536)")
    good = Job("import time\ntime.sleep(0.2)\nprint(42)")
    res = box.run_many([flood, good] * 3)
    assert [r.status for r in res] == ["output_limit", "ok"] * 3
    assert all(r.stdout == b"42\n" for r in res[1::2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_keyrings_do_not_carry_data_to_the_next_program(backend):
    """A key one program adds to its uid's keyring is gone for the next in the slot."""
    if os.uname().machine not in ("x86_64", "aarch64"):
        pytest.skip("keyctl syscall number not known for this machine")
    add_key, request_key = (248, 249) if os.uname().machine == "x86_64" else (217, 218)
    box = sandbox(backend, workers=1)
    lib = "import ctypes\nl = ctypes.CDLL(None, use_errno=True)\n"
    put = box.run(Job(lib + f"print(l.syscall({add_key}, b'user', b'orbitrl-k', b'leak', 4, -4)"
                            f" > 0)"))
    get = box.run(Job(lib + f"print(l.syscall({request_key}, b'user', b'orbitrl-k', None, -4))"))
    assert put.stdout == b"True\n" and get.stdout == b"-1\n", (put, get)


@pytest.mark.parametrize("as_root", [True, False])
def test_fallback_covers_cannot_be_unmounted(as_root):
    """The fallback's covers hold against a program that unmounts them, also without root
    (there the harness runs as root of its user namespace: the covers are locked in a
    nested one and every capability dropped)."""
    import orbitrl.data.code_tasks as tasks

    box = Sandbox(SandboxSection(backend="unshare", **{**LIMITS, "workers": 1}))
    box.as_root = as_root and box.as_root  # False: the harness keeps its uid (no root path)
    targets = [d for d in box.cover["hide"] + box.cover["tmp"] if d != "/sys"]
    res = box.run(Job("import ctypes, os\nl = ctypes.CDLL(None, use_errno=True)\n"
                      f"print([l.umount2(d.encode(), 2) for d in {targets!r}])\n"
                      f"print(os.path.exists({tasks.__file__!r}))"))
    assert res.status == "ok", res
    codes, visible = res.stdout.decode().splitlines()
    assert set(eval(codes)) == {-1} and visible == "False"


# runs as a normal user: makes a sandbox (argv[1]: its config), runs programs (argv[2]:
# name -> source), prints name -> [status, stdout] as JSON, or {"skip": why}
AS_USER = """
import json, sys
try:
    from orbitrl.config import SandboxSection
    from orbitrl.errors import OrbitError
    from orbitrl.rewards.sandbox import Job, Sandbox
except ImportError as e:
    print(json.dumps({"skip": "orbitrl does not import as a normal user here: %s" % e}))
    raise SystemExit
try:
    box = Sandbox(SandboxSection(**json.loads(sys.argv[1])))
except OrbitError as e:
    print(json.dumps({"skip": str(e)}))
    raise SystemExit
out = {"as_root": box.as_root}
for name, source in json.loads(sys.argv[2]).items():
    res = box.run(Job(source))
    out[name] = [res.status, res.stdout.decode()]
print(json.dumps(out))
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_bounds_hold_for_a_normal_user(backend):
    """Without root there is no slot uid and no memory cgroup (unless delegated), and the
    fallback's harness runs as root of a user namespace: the file budget, the SysV refusal
    and the capability drop hold all the same. Run as uid 65534 through setpriv, with the
    interpreter the sandbox uses (when root, one that others can run)."""
    import json
    import subprocess

    import orbitrl

    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to become a normal user")
    python = sandbox(backend).python.executable
    cfg = {**LIMITS, "backend": backend, "file_mb": 16}
    programs = {"files": fill_three(16, catch=True), "sysv": SYSV_PROBE, "caps": CAPS}
    out = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c", AS_USER,
         json.dumps(cfg), json.dumps(programs)], capture_output=True, cwd="/",
        env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1", "HOME": "/",
             "PYTHONPATH": os.path.dirname(os.path.dirname(orbitrl.__file__))})
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    got = json.loads(out.stdout)
    if "skip" in got:
        pytest.skip(got["skip"])
    assert got["as_root"] is False
    status, files = got["files"]
    assert status == "ok" and (15 << 20) < sum(eval(files)) <= 16 << 20, got
    assert got["sysv"] == ["ok", SYSV_REFUSED.decode()], got
    caps = eval(got["caps"][1])
    assert caps["CapEff"] == caps["CapPrm"] == caps["CapAmb"] == 0, caps
