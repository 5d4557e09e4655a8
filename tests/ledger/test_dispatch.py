"""The planner's host term: the op counts of ledger/dispatch.py recounted on this code, the
per-phase host seconds they add to a plan, and the counting itself (every worker thread's ops,
once)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from orbitrl.ledger import dispatch
from orbitrl.ledger.bandwidth import Links
from orbitrl.ledger.memory import Strategy, Workload
from orbitrl.ledger.models import known
from orbitrl.ledger.plan import Options
from orbitrl.ledger.timing import step_timing
from orbitrl.observe.calibrate import _toy
from orbitrl.observe.metrics import PhaseTimer


def _counted(model: Path, out: Path, mode: str) -> dict:
    cmd = [sys.executable, "-m", "orbitrl", "train", "--out", str(out),
           "--set", f"model.path={model}", "--set", "train.max_steps=2",
           "--set", "data.heldout_size=8", "--set", f"train.mode={mode}",
           "--set", "model.base_dtype=fp32", "--set", "algo.kl_coef=0",
           "--set", "train.micro_batch_tokens=100000", "--set", "train.workers=1"]
    subprocess.run(cmd, check=True, capture_output=True,
                   env={**os.environ, "ORBITRL_COUNT_OPS": "1"})
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][-1]


@pytest.mark.parametrize("mode", ["adapter", "full"])
def test_op_counts_hold_for_this_code(mode, tmp_path):
    """Counted ops of a one- and a three-layer decoder (one micro-batch, one worker) within a
    quarter of the table's, phase by phase."""
    kind = "adapter" if mode == "adapter" else "stateless"
    for layers in (1, 3):
        row = _counted(_toy(tmp_path / f"m{layers}", layers), tmp_path / f"r{layers}", mode)
        steps = row["completion_len_max"]  # one engine step per token of the longest reply
        want = {"rollout": steps * sum(dispatch.rollout_ops(kind, False, layers)),
                "train": sum(dispatch.train_ops(kind, layers, 1)),
                "score": sum(dispatch.score_ops(layers, 1, 0))}
        for phase, n in want.items():
            assert row[f"ops_{phase}"] == pytest.approx(n, rel=0.25), (layers, phase)


def test_a_phase_counts_every_worker_threads_ops_once(monkeypatch):
    from orbitrl.rl.parallel import Workers

    x = torch.ones(4)

    def three_ops(_):
        return (x + 1) * 2 - 1

    monkeypatch.setenv("ORBITRL_COUNT_OPS", "1")
    timer, workers = PhaseTimer("cpu"), Workers(2)
    with timer.phase("train"):
        workers.map(three_ops, [0, 1, 2, 3])
    workers.close()
    assert timer.ops == {"train": 12}
    monkeypatch.setenv("ORBITRL_COUNT_OPS", "0")
    assert PhaseTimer("cpu").ops is None


def test_host_cost_lengthens_each_phase_by_its_ops():
    shape = known("llama3-8b")
    work = Workload(prompt_len=64, completion_len=32, samples_per_step=16, rollout_seqs=16,
                    micro_batch=4)
    strat = Strategy("adapter", "nf4")
    opts = Options()
    base = step_timing(shape, strat, work, Links(), opts, 1, 1)["breakdown"]
    cost = dispatch.HostCost(10.0, 2.0, 0.0, 0.0, 5.0, 1.0)
    t = step_timing(shape, strat, work, Links(host=cost), opts, 1, 1)
    micro = t["micro_steps_per_rank"]
    roll, train = dispatch.rollout_ops("adapter", True, 32), dispatch.train_ops("adapter", 32, micro)
    assert micro > 1 and t["max_completion"] == 32
    assert t["breakdown"]["rollout_s"] - base["rollout_s"] == pytest.approx(
        32 * (roll[0] * 10 + roll[1] * 2) * 1e-6)
    assert t["breakdown"]["train_s"] - base["train_s"] == pytest.approx(
        (train[0] * 5 + train[1] * 1) * 1e-6)
    assert t["breakdown"]["score_s"] == base["score_s"]  # its cost is zero here
    uniform = step_timing(shape, strat, work, Links(op_us=3.0), opts, 1, 1)["breakdown"]
    assert uniform["train_s"] - base["train_s"] == pytest.approx(sum(train) * 3e-6)
    with pytest.raises(ValueError, match="op_us"):
        Links(op_us=-1)
