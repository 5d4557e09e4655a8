"""Wall time per RL step: overlapped (one step off-policy) against sequential, same run.

    python benchmarks/bench_overlap.py            # ~6 min on 2 idle CPU cores
    python benchmarks/bench_overlap.py --quick    # fewer steps, built-in model only

Method. Each configuration is one ``orbitrl train`` process on the same config and seed
(GRPO, LoRA r16 on an NF4 base, 8 prompts x 8 samples), differing only in
``rollout.overlap`` and ``train.threads``. Per-step wall time is the mean of
``time_step_s`` in metrics.jsonl over the steps after the first three (warm-up); the
overlapped mode's step time runs from the end of one step to the end of the next, so the
rollout hidden behind training costs nothing and the part training waited for is counted
(``time_wait_rollout_s``). Two models: the built-in 0.8M-parameter model (every op is tiny:
the interpreter, i.e. the GIL, is the bottleneck) and a 25M-parameter model of the same
shape family with the built-in tokenizer (random weights: rewards are meaningless there,
the timing is what is measured). Configurations run one after another on shared cores:
compare within one run only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def _wide_model(root: Path) -> Path:
    """The built-in model's tokenizer with a 25M-parameter Qwen2 body (random init)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from orbitrl.model.builtin import resolve_model_path

    src = resolve_model_path("builtin:tiny-arith")
    out = root / "wide"
    out.mkdir()
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, out / f.name)
    d = json.loads((src / "config.json").read_text())
    d.update(hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4)
    cfg = AutoConfig.for_model(**{k: v for k, v in d.items() if k != "architectures"})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(out)
    return out


def _run(root: Path, name: str, model: str, steps: int, sets: list[str]) -> dict:
    run = root / name
    cmd = [sys.executable, "-m", "orbitrl", "train", "--out", str(run),
           "--set", f"model.path={model}", "--set", f"train.max_steps={steps}",
           "--set", "log.progress=false", "--set", "checkpoint.every=0",
           "--set", "data.heldout_size=64"]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, capture_output=True, timeout=3600)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][3:]
    summary = json.loads((run / "summary.json").read_text())
    mean = lambda k: sum(r.get(k, 0.0) for r in rows) / len(rows)  # noqa: E731
    return {"step_s": mean("time_step_s"), "rollout_s": mean("time_rollout_s"),
            "train_s": mean("time_score_s") + mean("time_train_s"),
            "wait_s": mean("time_wait_rollout_s"), "stale": mean("staleness_mean"),
            "acc": summary["heldout_accuracy_after"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    cases = [("builtin", "builtin:tiny-arith", 20 if a.quick else 60)]
    if not a.quick:
        cases.append(("25M", None, 12))
    print("| model | mode | threads | s/step | rollout s | score+train s | waited s | "
          "staleness | held-out acc | vs sequential |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for label, model, steps in cases:
            model = model or str(_wide_model(root))
            base = None
            for mode, threads in [("sequential", 1), ("sequential", 2), ("overlapped", 1)]:
                sets = [f"train.threads={threads}",
                        f"rollout.overlap={'true' if mode == 'overlapped' else 'false'}"]
                r = _run(root, f"{label}-{mode}-{threads}", model, steps, sets)
                base = base or r["step_s"]
                print(f"| {label} | {mode} | {threads} | {r['step_s']:.3f} | "
                      f"{r['rollout_s']:.3f} | {r['train_s']:.3f} | "
                      f"{r['wait_s']:.3f} | {r['stale']:.2f} | {r['acc']:.3f} | "
                      f"{base / r['step_s']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
