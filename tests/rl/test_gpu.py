"""Runs on a CUDA device (marked ``gpu``, skipped without one; ``scripts/gpu_check.sh`` runs
them): the default run and full mode through ``orbitrl train``, the full-mode reference
pulled to the device layer by layer, and ``train.tiers`` with pinned host copies and copies
on a side stream."""

import json
import math
import subprocess
import sys

import pytest
import torch

from orbitrl.config import load_config
from orbitrl.rewards import register
from orbitrl.rl.run import load_data
from orbitrl.rl.trainer import RLTrainer

pytestmark = pytest.mark.gpu

SMALL = ["rollout.prompts_per_step=2", "rollout.n=4", "rollout.max_tokens=4",
         "data.heldout_size=8", "reward.name=test_length_gpu", "train.lr=1e-3",
         "model.device=cuda", "algo.check=true"]


@register("test_length_gpu", override=True)
def _length(prompt, completion, **f):
    return float(len(completion))  # varied rewards so gradients are non-zero


def make(*over):
    cfg = load_config(None, SMALL + list(over))
    return RLTrainer(cfg, *load_data(cfg))


def _train_cli(tmp_path, *sets) -> list[dict]:
    """``orbitrl train`` for 3 steps in a fresh process; the metrics rows."""
    args = [sys.executable, "-m", "orbitrl", "train", "--out", str(tmp_path / "run")]
    for s in ("train.max_steps=3", "rollout.prompts_per_step=2", "rollout.n=4",
              "rollout.max_tokens=5", "data.heldout_size=8", "log.progress=false",
              "model.device=cuda", *sets):
        args += ["--set", s]
    p = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(math.isfinite(r["grad_norm"]) and math.isfinite(r["kl"]) for r in rows)
    return rows


def test_default_run_on_cuda(tmp_path):
    rows = _train_cli(tmp_path)
    assert rows[0]["kl"] < 1e-5  # adapters off = the reference at step 0


def test_full_mode_run_on_cuda(tmp_path):
    rows = _train_cli(tmp_path, "train.mode=full", "algo.check=true")
    assert rows[0]["kl"] < 5e-2  # the int8 reference against the fp32 policy


def test_reference_runs_on_cuda_from_its_int8_host_copy():
    tr = make("train.mode=full")
    res = tr.policy.reference_residency
    assert res is not None and res.stream is not None  # copies on a side stream
    seen = []

    def hook(module, args):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        tensors += list(module.parameters()) + list(module.buffers())
        seen.append({t.device.type for t in tensors})
    handles = [m.register_forward_pre_hook(hook) for m in tr.policy.reference.model.layers]
    row = tr.step()
    for h in handles:
        h.remove()
    assert row["step_skipped"] == 0
    assert seen and all(s == {"cuda"} for s in seen)  # every reference layer ran on cuda
    assert res.stats.hits > 0 and res.stats.bytes_from_host == res.stats.host_bytes
    for L in res.layers:  # the storage stays the int8 host copy, pinned
        w = L.host["self_attn.q_proj.weight"]
        assert w.device.type == "cpu" and w.qdata.dtype == torch.int8 and w.qdata.is_pinned()
    assert tr.policy.reference.lm_head.weight.device.type == "cuda"


def test_tiers_on_cuda_match_resident_with_pinned_host_and_prefetch():
    runs = {}
    for tiers in (0, 2):
        tr = make("train.mode=full", f"train.tiers={tiers}")
        runs[tiers] = (tr, [tr.step() for _ in range(2)])
    (tr0, rows0), (tr2, rows2) = runs[0], runs[2]
    for a, b in zip(rows0, rows2):
        for k in ("loss", "grad_norm", "kl"):
            assert a[k] == pytest.approx(b[k], rel=1e-3, abs=1e-5), k
    res = tr2.policy.residency
    assert res.stream is not None
    for L in res.layers:  # at rest: every layer in pinned host memory, none on the device
        assert L.state == "cold"
        assert all(t.device.type == "cpu" and t.is_pinned() for t in L.host.values())
    assert all(p.device.type == "cpu" for p in tr2.model.model.layers.parameters())
    assert tr2.model.lm_head.weight.device.type == "cuda"
    s = res.stats
    assert s.hits > s.misses > 0 and s.bytes_written_back == 2 * s.host_bytes
    assert s.peak_resident_layers <= 2 + 2
    for (n, p), q in zip(tr2.model.named_parameters(), tr0.model.parameters()):
        torch.testing.assert_close(p.cpu(), q.cpu(), atol=1e-4, rtol=1e-3, msg=n)
