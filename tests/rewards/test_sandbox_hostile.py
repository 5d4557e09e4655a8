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

from orbitrl.rewards.code import CodeReward
from orbitrl.rewards.sandbox import Job
from sandbox_util import BACKENDS, LIMITS, sandbox

SECRET = "orbitrl-secret-7f3a9c"
TEST = [{"input": "", "output": "42\n"}]


@pytest.fixture(scope="module")
def planted():
    """A secret file only root can read, and a directory only root can write."""
    d = tempfile.mkdtemp(prefix="orbitrl-host-")
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
         "write_10gb", "print_1gb", "kill_parent", "missing_module"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", NAMES)
def test_hostile_program(backend, name, planted, listener):
    box = sandbox(backend)
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
    d = tempfile.mkdtemp(prefix="orbitrl-open-")
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
