"""`orbitrl plan` through the CLI entry point: tables, --json, and one-line errors (exit 2)."""

import json

import pytest

from orbitrl.cli import main

BASE = ["plan", "--devices", "100", "--device-memory-gb", "80"]


def run_json(capsys, *extra):
    assert main(BASE + list(extra) + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_contract(capsys):
    doc = run_json(capsys, "--params", "1e12", "--strategy", "stateless")
    assert doc["fits"] is True
    assert isinstance(doc["per_device_bytes"], int) and doc["per_device_bytes"] <= 80e9
    assert isinstance(doc["min_devices"], int) and doc["min_devices"] <= 100
    for role in ("actor", "reference", "rollout_kv", "activations", "comm_buffers"):
        assert set(doc["roles"][role]) == {"device", "host", "disk"}
    assert doc["phases"]["train"]["terms"]["actor:weights"] == 20e9
    assert {e["role"] for e in doc["execution"]} >= {"actor", "reference", "reward"}
    assert set(doc["schedule"]["shapes"]) == {"colocated", "separated", "one_step", "async"}


def test_json_adamw_does_not_fit(capsys):
    doc = run_json(capsys, "--params", "1e12", "--strategy", "adamw")
    assert doc["fits"] is False and doc["min_devices"] > 200
    assert doc["state_bytes"]["total"] == 16e12
    assert doc["proposal"]["knob"]


def test_adapter_4bit_node(capsys):
    argv = ["plan", "--params", "1.6T", "--devices", "8", "--device-memory-gb", "192",
            "--strategy", "adapter", "--base-dtype", "nf4", "--rollout-seqs", "16",
            "--kv-dtype", "fp8", "--max-util", "0.6", "--json"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits"] and doc["per_device_bytes"] <= 0.6 * 192e9


def test_known_model_and_dir(capsys, tmp_path):
    doc = run_json(capsys, "--model", "llama3-8b", "--strategy", "adapter")
    assert doc["fits"] and doc["model"]["layers"] == 32
    cfg = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
           "intermediate_size": 512, "vocab_size": 1000}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    doc = run_json(capsys, "--model", str(tmp_path))
    assert doc["model"]["layers"] == 4


def test_human_tables(capsys):
    assert main(BASE + ["--params", "1e12", "--strategy", "stateless"]) == 0
    out = capsys.readouterr().out
    for text in ("FITS", "memory by phase", "execution plan", "bytes moved", "step time"):
        assert text in out


@pytest.mark.parametrize("argv, flag", [
    (["plan", "--params", "-5", "--devices", "8", "--device-memory-gb", "80"], "--params"),
    (["plan", "--params", "1e9", "--devices", "0", "--device-memory-gb", "80"], "--devices"),
    (["plan", "--params", "1e9", "--devices", "8", "--device-memory-gb", "-1"], "--device-memory-gb"),
    (["plan", "--params", "1e12", "--devices", "8", "--device-memory-gb", "4"], "--device-memory-gb"),
    (["plan", "--params", "1e9", "--devices", "8", "--device-memory-gb", "80", "--strategy", "sgd"],
     "--strategy"),
    (["plan", "--params", "1e9", "--devices", "8", "--device-memory-gb", "80", "--base-dtype", "int3"],
     "--base-dtype"),
    (["plan", "--devices", "8", "--device-memory-gb", "80"], "--params"),
    (["plan", "--model", "no-such-model", "--devices", "8", "--device-memory-gb", "80"], "--model"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, flag):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and flag in err and "Traceback" not in err
