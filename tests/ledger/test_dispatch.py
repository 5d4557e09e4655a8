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
from orbitrl.ledger.timing import _lengths, step_timing
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


def test_timed_layers_price_training_per_token():
    """With a layer timed at the model's widths (``Links.train_layer_token_s``) the training
    phase is tokens x layers x that cost, the head over the completions at the matmul rate
    and copy bandwidth, and the host cost of the ops outside the layers only."""
    shape = known("llama3-8b")
    work = Workload(prompt_len=64, completion_len=32, samples_per_step=16, rollout_seqs=16,
                    micro_batch=4, recompute=False)
    strat, opts = Strategy("adapter", "nf4"), Options(tail_fraction=0.0)
    cost = dispatch.HostCost(10.0, 2.0, 0.0, 0.0, 5.0, 1.0)
    links = Links(device_tflops=0.1, hbm_gbps=20.0, host=cost, train_layer_token_s=2e-5,
                  train_workers=2)
    t = step_timing(shape, strat, work, links, opts, 1, 1)
    lengths = _lengths(work, opts)  # no tail: spread over [16, 32]
    tokens = sum(64 + x for x in lengths)
    assert t["tokens_per_step"] == tokens
    micro = t["micro_steps_per_rank"]
    head = (6 * shape.vocab * shape.hidden * sum(lengths) / 0.1e12
            + 6 * 4 * sum(lengths) * shape.vocab / 20e9)
    fixed, layer = dispatch.train_ops_outside_layers("adapter", shape.num_layers, micro)
    want = tokens * shape.num_layers * 2e-5 + head + (fixed * 5 + layer * 1) * 1e-6
    assert t["breakdown"]["train_s"] == pytest.approx(want)
    # the layers' own ops are in the timed layer, not priced again
    assert layer == dispatch.OPTIMIZER_LAYER["adapter"] * shape.num_layers


def test_plan_tokens_follow_the_trainers_packing():
    """A GRPO group whose prompt and completions fit one row, or whose attention costs no
    more than its samples' own rows, trains on one copy of its prompt (rl/batch.py); the
    plan counts the positions so, within the trainer's padding."""
    from orbitrl.ledger.timing import packed_tokens
    from orbitrl.rl.batch import positions
    from orbitrl.rl.types import Sample

    for prompt, reply in ((6, 3), (47, 16), (8, 40)):
        work = Workload(prompt_len=prompt, completion_len=reply, samples_per_step=16,
                        group_size=8)
        lengths = (reply,) * 16
        samples = [Sample(group=i // 8, prompt_ids=list(range(prompt)),
                          completion_ids=[1] * reply, rollout_logprobs=[0.0] * reply,
                          finish_reason="length", text="") for i in range(16)]
        planned, packed = packed_tokens(work, lengths), positions(samples)
        assert planned <= packed <= 1.15 * planned
    assert packed_tokens(Workload(prompt_len=6, group_size=8), (3,) * 16) == 2 * (6 + 24)
    # a long prompt: the group widens its row (attention 175^2 <= 8 x 63^2)
    assert packed_tokens(Workload(prompt_len=47, group_size=8), (16,) * 16) == 2 * (47 + 128)
    # long completions: a group's row would cost more attention than its samples' own
    assert packed_tokens(Workload(prompt_len=8, group_size=8), (40,) * 16) == 16 * 48
    assert packed_tokens(Workload(prompt_len=6, group_size=1), (3,) * 16) == 16 * 9


def test_reply_len_sets_the_step_tokens_not_the_memory():
    shape = known("llama3-8b")
    opts = Options(tail_fraction=0.0)
    kw = dict(prompt_len=64, completion_len=32, samples_per_step=16, rollout_seqs=16,
              micro_batch=4)
    short = step_timing(shape, Strategy("adapter", "nf4"), Workload(reply_len=5, **kw),
                        Links(), opts, 1, 1)
    assert short["max_completion"] == 5 and short["tokens_per_step"] == 16 * (64 + 5)
