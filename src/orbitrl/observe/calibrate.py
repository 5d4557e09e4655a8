"""This host's cost per dispatched op, per phase of orbitrl's own step (the planner's
``op_us``, ``score_op_us`` and ``train_op_us`` under ``orbitrl plan --this-machine``).

A one-layer random decoder with the built-in model's tokenizer and shape trains a few steps
of the built-in task twice, each in its own process with the run's mode: once counting the
ops each phase dispatches (``ORBITRL_COUNT_OPS=1``: counting slows every op, so that run's
times are not used), once timed. Its compute is negligible, so a phase's seconds over its ops
is what this implementation costs the host per op there: Python, the dispatcher, the
engine's and the trainer's bookkeeping between ops. About a minute.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from orbitrl.errors import OrbitError

PHASES = ("rollout", "score", "train")


def _toy(out: Path, layers: int) -> Path:
    """The built-in model's tokenizer beside ``layers`` narrow layers of random weights."""
    import torch  # start-up: plan --help stays light
    from transformers import AutoConfig, AutoModelForCausalLM  # start-up: as above

    from orbitrl.model.builtin import resolve_model_path  # start-up: as above
    src = resolve_model_path("builtin:tiny-arith")
    shutil.copytree(src, out)
    (out / "model.safetensors").unlink()
    (out / "orbitrl.yaml").unlink(missing_ok=True)
    raw = json.loads((out / "config.json").read_text())
    # narrow enough that its matmuls cost nothing beside the ops' host time (the planner
    # prices compute on its own)
    raw.update(num_hidden_layers=layers, hidden_size=32, intermediate_size=64,
               num_attention_heads=2, num_key_value_heads=1)
    raw.pop("layer_types", None)
    (out / "config.json").write_text(json.dumps(raw))
    cfg = AutoConfig.from_pretrained(out)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


def _run(model: Path, out: Path, settings: list[str], count: bool, steps: int) -> list[dict]:
    env = {**os.environ, "ORBITRL_COUNT_OPS": "1" if count else "0"}
    cmd = [sys.executable, "-m", "orbitrl", "train", "--out", str(out),
           "--set", f"model.path={model}", "--set", f"train.max_steps={steps}",
           "--set", "data.heldout_size=8"]
    for s in settings:
        cmd += ["--set", s]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        raise OrbitError(f"--this-machine: the calibration run failed: {tail[0]}")
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]


def host_cost(mode: str, base_dtype: str, reference: bool, steps: int = 8):
    """This host's :class:`orbitrl.ledger.dispatch.HostCost` for a run in ``mode`` (adapter |
    full) over a ``base_dtype`` base (adapters), with or without a reference pass.

    Toys of one and of three layers: a phase's extra seconds over its extra ops are the
    per-layer ops' cost; the rest of the one-layer toy's seconds, over the ops that do not
    grow with depth, the fixed ops' cost."""
    from orbitrl.ledger.dispatch import HostCost  # start-up: plan --help stays light
    settings = [f"train.mode={mode}", f"algo.kl_coef={0.01 if reference else 0.0}"]
    if mode == "adapter":
        fmt = base_dtype if base_dtype in ("fp32", "nf4", "int8") else "fp32"
        settings.append(f"model.base_dtype={fmt}")
    seen = {}
    with tempfile.TemporaryDirectory(prefix="orbitrl-calibrate-") as tmp:
        for layers in (1, 3):
            model = _toy(Path(tmp) / f"model{layers}", layers)
            counted = _run(model, Path(tmp) / f"counted{layers}", settings, True, 2)[-1]
            timed = _run(model, Path(tmp) / f"timed{layers}", settings, False, steps)[1:]
            seen[layers] = {ph: (counted.get(f"ops_{ph}") or 0,
                                 statistics.median(r.get(f"time_{ph}_s", 0.0) for r in timed))
                            for ph in PHASES}
    cost = {}
    for ph in PHASES:
        (o1, t1), (o3, t3) = seen[1][ph], seen[3][ph]
        per_layer_ops = (o3 - o1) / 2
        layer_s = max(0.0, (t3 - t1) / (o3 - o1)) if o3 > o1 else (t1 / o1 if o1 else 0.0)
        fixed_ops = o1 - per_layer_ops
        fixed_s = max(0.0, t1 - layer_s * per_layer_ops) / fixed_ops if fixed_ops > 0 else layer_s
        cost[f"{ph}_fixed"], cost[f"{ph}_layer"] = fixed_s * 1e6, layer_s * 1e6
    return HostCost(**cost)
