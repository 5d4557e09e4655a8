"""`orbitrl plan` through the CLI entry point: tables, --json, and one-line errors (exit 2)."""

import json
import math
import os

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
    a = doc["schedule"]["shapes"]["async"]
    assert a["reprefill_s"] > 0 and a["proximal_s"] == 0  # scoring's old-logprob pass is proximal


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
    for text in ("FITS", "memory by phase", "execution plan", "bytes moved", "step time",
                 "async pays: re-prefill"):
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


NODE_INT4 = ["plan", "--params", "1.6e12", "--devices", "8", "--device-memory-gb", "192",
             "--strategy", "adapter", "--base-dtype", "int4"]


def run_argv(capsys, argv):
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_int4_adapters_fit_within_60_percent_of_the_node(capsys):
    """The issue's figure through the contract command as a user runs it (default workload)."""
    doc = run_argv(capsys, NODE_INT4)
    node = 8 * 192e9
    assert doc["fits"] is True and doc["min_devices"] <= 8
    assert doc["cluster_memory_bytes"] == node
    assert doc["static_total_bytes"] == 8 * doc["static_per_device_bytes"] <= 0.6 * node
    # frozen int4 base (bf16 scale per 128 values) + 16 B/param adapters: about 0.85 TB
    assert doc["state_bytes"]["total"] <= 0.86e12
    # the elastic KV pool takes what the rollout phase leaves, and the peak includes it
    kv = doc["kv_pool"]
    assert kv["mode"] == "elastic" and kv["reserve_seqs"] == 8 * 8
    assert kv["reserve_seqs"] <= kv["concurrent_seqs"] <= kv["need_seqs"] == 512
    assert kv["concurrent_seqs"] == kv["blocks"] // kv["blocks_per_seq"]
    rollout = doc["phases"]["rollout"]
    assert rollout["terms"]["rollout_kv:blocks"] == kv["bytes_per_device"]
    assert doc["roles"]["rollout_kv"]["device"] == kv["bytes_per_device"]
    totals = [doc["phases"][p]["total"] for p in ("rollout", "score", "train")]
    assert doc["per_device_bytes"] == max(totals) <= doc["usable_bytes_per_device"]
    assert doc["usable_bytes_per_device"] - rollout["total"] < 1e9  # the pool took the rest
    assert doc["per_device_bytes"] - doc["static_per_device_bytes"] > 0
    # the frozen base fits per tp group: replicated, no gathers, and the plan says so
    assert doc["layout"]["weights"] == "replicated"
    actor = next(e for e in doc["execution"] if e["role"] == "actor")
    assert "replicated" in actor["tier"] and not any("comm_buffers" in k for k in rollout["terms"])
    names = [t["name"] for t in doc["bandwidth"]["transfers"]]
    assert not any("all-gather" in n for n in names) and doc["bandwidth"]["total_bytes"] < 20e9


def test_fixed_rollout_seqs_must_fit(capsys):
    """--rollout-seqs N means N sequences at once: their KV is a fixed term."""
    doc = run_argv(capsys, NODE_INT4 + ["--rollout-seqs", "256"])
    assert doc["fits"] is False and doc["kv_pool"]["mode"] == "fixed"
    assert doc["kv_pool"]["concurrent_seqs"] == 256 and doc["proposal"]["knob"]
    doc = run_argv(capsys, NODE_INT4 + ["--rollout-seqs", "32"])
    assert doc["fits"] is True and doc["kv_pool"]["concurrent_seqs"] == 32
    assert doc["per_device_bytes"] < doc["usable_bytes_per_device"] - 30e9  # nothing grown


def test_min_rollout_seqs_sets_the_reserve(capsys):
    argv = ["plan", "--params", "1.6e12", "--devices", "16", "--device-memory-gb", "80",
            "--strategy", "adapter", "--base-dtype", "int4"]
    doc = run_argv(capsys, argv)
    assert doc["fits"] is False and doc["proposal"]["knob"].startswith("--min-rollout-seqs")
    doc = run_argv(capsys, argv + ["--min-rollout-seqs", "2"])
    assert doc["fits"] is True and doc["kv_pool"]["reserve_seqs"] == 32


def test_int4_group_flag(capsys):
    g128 = run_argv(capsys, NODE_INT4)["state_bytes"]["weights"]
    g32 = run_argv(capsys, NODE_INT4 + ["--int4-group", "32"])["state_bytes"]["weights"]
    assert g32 - g128 == 0.075e12  # 1.6e12 x (2/32 - 2/128)


def test_1e12_figures_through_the_cli(capsys):
    """AdamW: 16 TB and 200 devices of 80 GB for state alone; lean: 2 TB, 20 GB, 60 GB free."""
    doc = run_json(capsys, "--params", "1e12", "--strategy", "adamw")
    st = doc["state_bytes"]
    assert (st["weights"], st["grads"], st["master"], st["optimizer"], st["total"]) == \
        (2e12, 2e12, 4e12, 8e12, 16e12)
    assert math.ceil(st["total"] / doc["device_memory_bytes"]) == 200
    assert doc["fits"] is False and doc["min_devices"] > 200

    doc = run_json(capsys, "--params", "1e12", "--strategy", "stateless")
    st = doc["state_bytes"]
    assert st["weights"] == 2e12 and st["grads"] == st["master"] == st["optimizer"] == 0
    weights = doc["phases"]["train"]["terms"]["actor:weights"]
    assert weights == 20e9 and doc["device_memory_bytes"] - weights == 60e9
    assert doc["fits"] is True and doc["per_device_bytes"] - weights <= 60e9
    assert "actor:grads" not in doc["phases"]["train"]["terms"]
    assert doc["phases"]["host"]["terms"]["reference:weights"] > 0


def test_1e12_gathers_are_per_step_and_hidden(capsys):
    """Sharded training gathers every layer once per micro step's forward and backward; the
    auto micro batch is large enough for compute to hide them."""
    doc = run_json(capsys, "--params", "1e12", "--strategy", "stateless")
    tp, dp, sch = doc["tp"], doc["dp"], doc["schedule"]
    mb = doc["micro_batch"]
    assert mb["auto"] and mb["sequences"] > 1 and mb["tokens"] == mb["sequences"] * 2048
    micro = sch["micro_steps_per_rank"]
    assert micro == math.ceil(sch["tokens_per_step"] / (dp * mb["tokens"]))
    gathered = doc["model"]["layer_params"] * doc["model"]["layers"] * 2  # dense, bf16
    one_pass = gathered / tp * (dp - 1) / dp
    t = {x["name"]: x for x in doc["bandwidth"]["transfers"]}
    assert t["train all-gather"]["bytes"] == pytest.approx(2 * micro * one_pass, rel=1e-9)
    assert t["score all-gather"]["bytes"] == pytest.approx(micro * one_pass, rel=1e-9)
    assert t["train all-gather"]["bytes"] < 5e12  # a few TB per device per step, not 100s
    b = sch["breakdown"]
    assert b["exposed_comm_s"] < 0.05 * b["step_s"]


def test_this_machine_measures_rates_and_host_cost(capsys):
    """--this-machine plans with this host's measured rates and per-phase host cost (the
    calibration's toy runs), printed in the report and the JSON; the host term lengthens the
    step beside the same plan at those rates with no host cost."""
    flags = ["--model", "builtin:tiny-arith", "--devices", "1", "--device-memory-gb", "24",
             "--strategy", "adapter", "--base-dtype", "fp32", "--prompt-len", "8",
             "--completion-len", "8", "--samples-per-step", "16", "--rollout-seqs", "16",
             "--reference", "none"]
    d = run_json(capsys, *flags, "--this-machine")
    m = d["machine"]
    assert m["device_tflops"] > 0 and m["hbm_gbps"] > 0 and m["threads"] >= 1
    assert set(m["host_us"]) == {f"{p}_{k}" for p in ("rollout", "score", "train")
                                 for k in ("fixed", "layer")}
    assert m["host_us"]["rollout_fixed"] > 0 and m["host_us"]["train_layer"] > 0
    # a decoder layer of the model's widths timed in training, two workers side by side
    assert m["train_layer_token_s"] > 0 and m["train_workers"] == min(2, os.cpu_count())
    bare = run_json(capsys, *flags, "--device-tflops", str(m["device_tflops"]),
                    "--hbm-gbps", str(m["hbm_gbps"]))
    assert d["schedule"]["breakdown"]["step_s"] > bare["schedule"]["breakdown"]["step_s"]
    assert main(["plan", *flags, "--this-machine"]) == 0
    assert "this machine (" in capsys.readouterr().out
