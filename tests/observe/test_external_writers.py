"""The TensorBoard and wandb writers (``log.tensorboard``, ``log.wandb``) write the run's
metrics: a short `orbitrl train` with each one on, its files read back with the writer's own
format (TensorBoard's event reader, wandb's offline transaction log), and every numeric
value of every metrics.jsonl row found there at its step. No network: wandb runs offline.
Both packages are in the ``test`` extra (pyproject.toml)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from orbitrl.cli import main

FAST = ["--set", "train.max_steps=3", "--set", "rollout.prompts_per_step=2",
        "--set", "rollout.n=4", "--set", "rollout.max_tokens=5", "--set", "data.heldout_size=4",
        "--set", "log.progress=false", "--set", "model.base_dtype=int8",
        "--set", "checkpoint.every=0"]

# metrics every run logs, checked by name so that a writer dropping them cannot pass on the
# others
NAMED = ("reward_mean", "kl", "entropy", "grad_norm", "loss", "time_step_s", "tokens_per_s")


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _numbers(row: dict) -> dict:
    """What the writers log of a metrics row: its finite numbers but the step."""
    return {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)}


def test_tensorboard_event_file_holds_every_metric(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert main(["train", *FAST, "--set", "log.tensorboard=true", "--out", str(tmp_path)]) == 0
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert set(NAMED) <= tags
    got = {t: {e.step: e.value for e in acc.Scalars(t)} for t in tags}
    for r in rows:
        nums = _numbers(r)
        assert set(NAMED) <= set(nums)
        for k, v in nums.items():
            # scalars are stored as float32
            assert got[k][r["step"]] == pytest.approx(v, rel=1e-6, abs=1e-30), (r["step"], k)
    assert got["reward_mean"][2] == pytest.approx(rows[2]["reward_mean"], rel=1e-6)


def _wandb_records(path: Path):
    """The protobuf records of a wandb transaction log (``run-ID.wandb``): a 7-byte header
    (``:W&B``, magic, version), then LevelDB's log format: 32 KiB blocks of chunks, each with
    a 7-byte header (CRC, length, type: full, first, middle, last); a block's tail too short
    for a header is padding."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding to the block's end
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec


def test_wandb_offline_run_holds_every_metric_and_the_config(tmp_path, monkeypatch):
    for k, v in {"WANDB_MODE": "offline", "WANDB_SILENT": "true",
                 "WANDB_CONFIG_DIR": tmp_path / "cfg", "WANDB_CACHE_DIR": tmp_path / "cache",
                 "WANDB_DATA_DIR": tmp_path / "data"}.items():
        monkeypatch.setenv(k, str(v))
    run = tmp_path / "run"
    assert main(["train", *FAST, "--set", "log.wandb=true", "--out", str(run)]) == 0
    rows = _rows(run)
    logs = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 1
    history, config = {}, None
    for rec in _wandb_records(logs[0]):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            h = {i.key or ".".join(i.nested_key): json.loads(i.value_json)
                 for i in rec.history.item}
            history[h["_step"]] = h
        elif kind == "run":
            config = {i.key: json.loads(i.value_json) for i in rec.run.config.update}
    assert sorted(history) == [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        nums = _numbers(r)
        assert set(NAMED) <= set(nums)
        for k, v in nums.items():
            assert history[r["step"]][k] == pytest.approx(v, rel=1e-12), (r["step"], k)
    # the run's resolved config, section by section
    assert config["train"]["max_steps"] == 3 and config["rollout"]["n"] == 4
    assert config["model"]["base_dtype"] == "int8"
