"""How a rank leaves: ``orbitrl``'s entry point exits a process that created a process
group through ``distributed.env.exit_now`` on every path (a return, an error, SystemExit),
with the interpreter's exit status and its non-daemon threads finished first."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dist_helpers import rank_env

RANK = """
import sys, threading, time
import orbitrl.cli as cli
import orbitrl.distributed.env as env

env._JOINED = True  # as after init_distributed in a torchrun launch
real_exit = env.exit_now
env.exit_now = lambda code: (print("exit_now", code, flush=True), real_exit(code))

def write(path):  # a checkpoint write still in flight when the command ends
    time.sleep(0.3)
    open(path, "w").write("written")

threading.Thread(target=write, args=(sys.argv[2],)).start()
if sys.argv[1] == "error":
    cli.main = lambda: 1 / 0
sys.argv = {"usage": ["orbitrl", "plan", "--no-such-flag"], "error": ["orbitrl"],
            "ok": ["orbitrl"]}[sys.argv[1]]
cli.entry()
"""


@pytest.mark.parametrize("case,status,stderr", [("ok", 0, ""), ("usage", 2, "orbitrl plan: error:"),
                                                ("error", 1, "ZeroDivisionError")])
def test_a_rank_exits_through_exit_now(tmp_path, case, status, stderr):
    out = tmp_path / "checkpoint"
    r = subprocess.run([sys.executable, "-c", RANK, case, str(out)], env=rank_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == status, r.stderr[-2000:]
    assert f"exit_now {status}" in r.stdout
    assert stderr in r.stderr
    assert out.read_text() == "written"  # the non-daemon thread finished first
