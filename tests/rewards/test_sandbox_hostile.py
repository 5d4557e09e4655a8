"""Hostile programs: each scores 0 with its reason recorded (a runaway one as "time_limit"),
leaves the host unharmed, and the next program runs normally. Run on every backend that
works here (bwrap, and the unshare fallback forced by config). How long the kill takes is
measured by benchmarks/bench_sandbox.py; a hang fails through tests/conftest.py's limit."""

import contextlib
import os
import shutil
import socket
import tempfile
import time

import pytest

from orbitrl.config import SandboxSection
from orbitrl.rewards.code import CodeReward
from orbitrl.rewards.sandbox import Job, Sandbox
from sandbox_util import BACKENDS, LIMITS, sandbox

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
        # shared memory no address space counts: a memfd, detached SysV segments, /dev/shm
        "memfd_1gb": ("import os\nfds = []\nfor _ in range(56):\n    fd = os.memfd_create('x')"
                      "\n    for _ in range(7):\n        os.write(fd, b'x' * 2**20)\n"
                      "    fds.append(fd)\nprint(42)", {"memory", "time_limit"}),
        "sysv_shm_1gb": (SYSV_FILL, {"memory", "time_limit"}),
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


SYSV_FILL = ("import ctypes\nlibc = ctypes.CDLL(None)\nlibc.shmat.restype = ctypes.c_void_p\n"
             "for _ in range(8):\n    sid = libc.shmget(0, 200 * 2**20, 0o1600)\n"
             "    addr = libc.shmat(sid, None, 0)\n    assert addr not in (None, 2**64 - 1)\n"
             "    ctypes.memset(addr, 1, 200 * 2**20)\n    libc.shmdt(ctypes.c_void_p(addr))\n"
             "print(42)")

NAMES = ["read_file", "write_outside", "socket", "fork_bomb", "infinite_loop", "alloc_20gb",
         "write_10gb", "print_1gb", "kill_parent", "missing_module", "memfd_1gb",
         "sysv_shm_1gb", "dev_shm_fill", "write_root"]
# without a memory cgroup, pages in shared memory are not bounded (docs/sandbox.md)
NEEDS_CGROUP = {"memfd_1gb", "sysv_shm_1gb"}


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


def _shm_segments() -> int:
    with open("/proc/sysvipc/shm") as f:
        return len(f.read().splitlines()) - 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_ipc_is_private_to_one_run(backend):
    """A SysV segment one program leaves behind is gone for the next (same slot uid), and
    never reaches the host."""
    box = sandbox(backend)
    before = _shm_segments()
    put = ("import ctypes\nlibc = ctypes.CDLL(None)\nlibc.shmat.restype = ctypes.c_void_p\n"
           "sid = libc.shmget(0x5151, 4096, 0o1666)\naddr = libc.shmat(sid, None, 0)\n"
           "ctypes.memmove(addr, b'leaked', 6)\nprint(sid >= 0)")
    assert box.run(Job(put)).stdout == b"True\n"
    get = "import ctypes\nprint(ctypes.CDLL(None).shmget(0x5151, 0, 0))"
    assert box.run(Job(get)).stdout == b"-1\n"
    assert _shm_segments() == before


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


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_writable_mount_is_capped(backend):
    """Each writable tmpfs the program can reach has a size no larger than file_mb (the
    root and /dev of bwrap read-only once built); the host's are covered on the fallback
    (a covered mount is still listed, but its path leads to the cover)."""
    box = sandbox(backend)
    res = box.run(Job(
        "import os\ntop = {}\nfor line in open('/proc/self/mounts'):\n"
        "    dev, mnt, fs, opts = line.split()[:4]\n    top[mnt] = (fs, opts.split(','))\n"
        "for mnt, (fs, opts) in top.items():  # the last mount on a path is the one seen\n"
        "    if fs == 'tmpfs' and 'rw' in opts and os.path.ismount(mnt):\n"
        "        print(mnt, [o for o in opts if o.startswith('size=')])"))
    assert res.status == "ok"
    cap = box.cfg.file_mb << 10  # in KiB, as mounts print it
    for line in res.stdout.decode().splitlines():
        mnt, size = line.split(" ", 1)
        assert "size=" in size, f"{mnt}: writable without a size cap"
        kib = int(size.split("size=")[1].split("k")[0])
        assert kib <= cap, f"{mnt}: {kib} KiB > {cap} KiB"


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
