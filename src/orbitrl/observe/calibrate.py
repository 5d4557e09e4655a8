"""This host's cost per dispatched op, per phase of orbitrl's own step (the planner's
``op_us``, ``score_op_us`` and ``train_op_us`` under ``orbitrl plan --this-machine``).

A one-layer random decoder with the built-in model's tokenizer and shape trains a few steps
of the built-in task twice, each in its own process with the run's mode: once counting the
ops each phase dispatches (``ORBITRL_COUNT_OPS=1``: counting slows every op, so that run's
times are not used), once timed. Its compute is negligible, so a phase's seconds over its ops
is what this implementation costs the host per op there: Python, the dispatcher, the
engine's and the trainer's bookkeeping between ops. About a minute.

The training phase's decoder layers are timed at the model's own widths instead
(:func:`layer_token_seconds`): their matmuls, fp64 attention over packed rows, and the
activation-sized products, copies and adds between them (on a 2-core CPU those last two were
a third of SmolLM2's training phase, which a FLOP count does not see).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
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


def _layers_dir(out: Path, hf: dict, layers: int) -> Path:
    """``hf``'s architecture with ``layers`` decoder layers of random weights and a 256-token
    vocabulary (the head and embeddings are priced apart)."""
    import torch  # start-up: plan --help stays light
    from transformers import AutoConfig, AutoModelForCausalLM  # start-up: as above
    raw = {k: v for k, v in hf.items() if not k.startswith("_")}
    raw.update(num_hidden_layers=layers, vocab_size=256, tie_word_embeddings=True)
    for key in ("layer_types", "sliding_window_pattern"):  # per-layer lists cut to the depth
        if isinstance(raw.get(key), list):
            raw[key] = raw[key][:layers]
    for key in ("first_k_dense_replace",):
        if key in raw:
            raw[key] = min(raw[key], layers)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(raw))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out)).save_pretrained(out)
    return out


def layer_token_seconds(hf: dict, kind: str, base_dtype: str, rank: int, rows: int, seq: int,
                        workers: int, repeat: int = 3) -> float:
    """Seconds one decoder layer's forward + backward adds per trained token (position),
    timed over micro-batches of ``rows`` sequences of ``seq`` tokens, in training as a run
    of ``kind`` (adapter: LoRA of ``rank`` on every linear over a ``base_dtype`` base; else
    every weight trained) trains it, with ``workers`` micro-batches side by side on one
    intra-op thread each (``train.workers``, ``train.threads`` 1): amortised over the
    micro-batches running beside each other.

    Decoders of one and of four layers at the model's widths (its config.json, random
    weights), each timed ``repeat`` times (the fastest kept); the difference over three
    layers leaves out the embedding, the final norm and the loss."""
    import torch  # start-up: plan --help stays light

    from orbitrl.model.lora import adapter_parameters, apply_lora  # start-up: as above
    from orbitrl.model.quant import cache_dequantized, check_format, finish_frozen, \
        quantizing_hook  # start-up: as above
    from orbitrl.model.weights import load_model  # start-up: as above

    def build(path: Path):
        fmt = {"fp32": None, "bf16": "bf16", "int8": "int8", "nf4mix": "nf4mix",
               "nf4": "nf4"}.get(base_dtype)
        if kind != "adapter" or fmt is None:
            model = load_model(path)
        else:
            check_format(fmt, "cpu", key="--base-dtype")
            model = load_model(path, on_tensor=quantizing_hook(fmt))
            finish_frozen(model, path)
        if kind == "adapter":
            apply_lora(model, rank=rank, alpha=2.0 * rank, targets=["all-linear"])
            cache_dequantized(model, 256 << 20, torch.float32)
            return model, adapter_parameters(model)
        for p in model.parameters():
            p.requires_grad_(True)
        return model, list(model.parameters())

    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 256, (rows, seq), generator=g) for _ in range(workers)]

    def once(model, params, x):
        hidden = model(x, return_hidden=True)
        torch.autograd.grad(hidden.float().square().mean(), params, allow_unused=True)

    def timed(path: Path) -> float:
        model, params = build(path)
        model.train()
        best = float("inf")
        # one intra-op thread per worker, as train.threads' default runs them
        with ThreadPoolExecutor(workers, initializer=torch.set_num_threads,
                                initargs=(1,)) as pool:
            for i in range(repeat + 1):  # the first warms the allocator and caches
                t0 = time.perf_counter()
                list(pool.map(lambda x: once(model, params, x), ids))
                if i:
                    best = min(best, time.perf_counter() - t0)
        return best

    with tempfile.TemporaryDirectory(prefix="orbitrl-layers-") as tmp:
        t1 = timed(_layers_dir(Path(tmp) / "l1", hf, 1))
        t4 = timed(_layers_dir(Path(tmp) / "l4", hf, 4))
    return max(t4 - t1, 0.0) / 3 / workers / (rows * seq)


def host_cost(mode: str, base_dtype: str, reference: bool, steps: int = 12,
              depths: tuple[int, ...] = (1, 2, 4, 8)):
    """This host's :class:`orbitrl.ledger.dispatch.HostCost` for a run in ``mode`` (adapter |
    full) over a ``base_dtype`` base (adapters), with or without a reference pass.

    Ops are counted on toys of one and two layers (they grow exactly linearly with depth);
    each phase's median seconds on toys of ``depths`` layers are fitted by least squares to
    ``fixed + per_layer x depth`` (two depths alone left the split between the two to the
    noise of two medians: per-layer costs 3.5-9 us between calibrations minutes apart);
    each part over its ops is that part's cost per op."""
    from orbitrl.ledger.dispatch import HostCost  # start-up: plan --help stays light
    settings = [f"train.mode={mode}", f"algo.kl_coef={0.01 if reference else 0.0}"]
    if mode == "adapter":
        fmt = base_dtype if base_dtype in ("fp32", "nf4", "nf4mix", "int8") else "fp32"
        settings.append(f"model.base_dtype={fmt}")
    ops, times = {}, {}
    with tempfile.TemporaryDirectory(prefix="orbitrl-calibrate-") as tmp:
        for layers in sorted(set(depths) | {1, 2}):
            model = _toy(Path(tmp) / f"model{layers}", layers)
            if layers in (1, 2):
                counted = _run(model, Path(tmp) / f"counted{layers}", settings, True, 2)[-1]
                ops[layers] = {ph: counted.get(f"ops_{ph}") or 0 for ph in PHASES}
            if layers in depths:
                timed = _run(model, Path(tmp) / f"timed{layers}", settings, False, steps)[1:]
                times[layers] = {ph: statistics.median(r.get(f"time_{ph}_s", 0.0) for r in timed)
                                 for ph in PHASES}
    cost = {}
    xs = sorted(times)
    mx = sum(xs) / len(xs)
    for ph in PHASES:
        per_layer_ops = ops[2][ph] - ops[1][ph]
        fixed_ops = ops[1][ph] - per_layer_ops
        ys = [times[x][ph] for x in xs]
        my = sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        base = my - slope * mx
        # no split (or timings too noisy to split: a fit with a negative per-layer or fixed
        # time, seen on a loaded machine): one cost for every op
        if per_layer_ops <= 0 or fixed_ops <= 0 or slope <= 0 or base <= 0:
            every = my / (fixed_ops + per_layer_ops * mx) if ops[1][ph] else 0.0
            cost[f"{ph}_fixed"] = cost[f"{ph}_layer"] = every * 1e6
            continue
        cost[f"{ph}_fixed"] = base / fixed_ops * 1e6
        cost[f"{ph}_layer"] = slope / per_layer_ops * 1e6
    return HostCost(**cost)
