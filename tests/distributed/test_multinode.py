"""Two torchrun *nodes* on this host (2 nodes x 1 process, c10d rendezvous on a free port,
gloo): the multi-node launch path (an agent per node, ranks assigned at the rendezvous,
the process group's address from the agent hosting it), running the adapter parity run of
test_dist_parity.py, against the one-process run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from dist_helpers import STEPS, TIMEOUT_S, final_weights, max_diff, metrics, rank_env, train_args

import launch


def node_argv(node: int, port: int, args: list[str]) -> list[str]:
    """The command one node runs: the same on every node but for ``--node-rank`` (which the
    c10d rendezvous does not need; ranks go by arrival) and, here, the loopback address."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", "1", "--node-rank", str(node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"orbitrl-test-{port}",
            "--local-addr", "127.0.0.1", "-m", "orbitrl", *args]


def run_nodes(args: list[str]) -> list[tuple[int, str]]:
    """Start both nodes, wait for them (killed past TIMEOUT_S); (exit code, stderr) each."""
    port = launch.free_port()
    procs = []
    for node in (0, 1):
        err = tempfile.TemporaryFile(mode="w+")
        p = subprocess.Popen(node_argv(node, port, args), env=rank_env(),
                             stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        procs.append((p, err))
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while any(p.poll() is None for p, _ in procs):
            if time.monotonic() > deadline:
                pytest.fail(f"torchrun nodes still running after {TIMEOUT_S}s")
            time.sleep(0.1)
    finally:
        for p, _ in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    out = []
    for p, err in procs:
        err.seek(0)
        out.append((p.returncode, err.read()))
        err.close()
    return out


def test_two_nodes_match_one_process(one_process_runs, tiny_llama, tmp_path):
    """Adapters, AdamW, 4 steps: the same samples, gradient and trained tensors as one
    process (the tolerances of test_dist_parity.py)."""
    run = tmp_path / "two-nodes"
    res = run_nodes(train_args(tiny_llama, "adapter", STEPS) + ["--out", str(run)])
    for node, (code, err) in enumerate(res):
        assert code == 0, f"node {node}: {err[-3000:]}"
    one, two = metrics(one_process_runs["adapter"]), metrics(run)
    assert [r["step"] for r in two] == list(range(STEPS))
    assert [r["reward_mean"] for r in two] == pytest.approx([r["reward_mean"] for r in one],
                                                            abs=1e-6)
    assert [r["grad_norm"] for r in two] == pytest.approx([r["grad_norm"] for r in one],
                                                          rel=1e-4)
    d = max_diff(final_weights(one_process_runs["adapter"], "adapter"),
                 final_weights(run, "adapter"))
    print(f"adapter: max |1 process - 2 nodes| = {d:.2e} after {STEPS} steps")
    assert d < 1e-5
    assert all(r["step_skipped"] == 0 for r in two)
