"""Separate pools on this machine's CPUs: the planner's predicted step time against the
measured one per shape on a long-tailed workload, and the built-in task learned in every
separated shape.

    python benchmarks/bench_pools.py                  # all three tables
    python benchmarks/bench_pools.py --only tail      # the step-time table only
    python benchmarks/bench_pools.py --only learn     # the learning check only
    python benchmarks/bench_pools.py --only sync      # weight-sync bytes only (fast)

``tail``: a long-tailed workload built here, not shipped. A model of the built-in model's
shape (Qwen2, 4 layers, hidden 128) over the built-in tokenizer's 90 tokens, randomly
initialised from a config and saved to a temporary directory, so its next-token
distribution is nearly uniform; six of the 90 tokens end a completion (``eos_token_id`` is a
list), so completion lengths are about geometric with mean 90/6 = 15 tokens, and at
``rollout.max_tokens=64`` about 1.4% of samples reach the cap: half the steps' 64 samples
include one (the others' longest is 38-60 tokens), and a synchronous rollout waits on it
alone. The reward is a
verifier on the first token (1 when the completion starts with a digit, about 11% of samples
at the start), so GRPO groups carry a signal and the update is real work. Each shape runs
``orbitrl train`` for 16 steps: colocated on one process and on 2 ranks (FSDP2), separated,
one_step and async on 2 ranks (1 rollout + 1 training, gloo). The table gives the mean
measured step time (``time_step_s``) against the mean of the planner's prediction for the
same steps (``time_step_predicted_s``, ``observe/schedule.py``), skipping the first 3 steps.

``learn``: the built-in model and task on 2 ranks, separated, one_step, and async with
partial rollouts continued and cut, ``rollout.queue_size=2`` and ``schedule.max_staleness=2``:
held-out accuracy before -> after (asserted +0.30 or more) and the largest staleness any
step logged (asserted within the bound, from metrics.jsonl).

``sync``: the weight sync's bytes against a full copy of the same tensors, summed over a
short separated run on 2 ranks (the built-in model and task, ``--sync-steps`` steps,
``schedule.sync_bucket_mb=0.25`` so the full model is several buckets), in adapter and full
mode, with ``schedule.sync_delta`` off and on (asserted: never more than a full copy), from
the ``sync_bytes`` and ``sync_full_bytes`` columns of metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
HERE = Path(__file__).resolve().parent
STOP_TOKENS = [1, 85, 86, 87, 88, 89]  # <eos>, '#', '%', '&', '_', '\n' of the built-in vocab
BOUND = 2  # schedule.max_staleness (and rollout.queue_size) of every run here


def first_digit(prompt: str, completion: str, **fields) -> float:
    """The tail workload's reward: the completion starts with a digit."""
    return 1.0 if completion[:1].isdigit() else 0.0


def build_tail_model(out: Path) -> Path:
    """A random model of the built-in's shape whose completions are about geometric."""
    sys.path.insert(0, str(SRC))
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from orbitrl.model.builtin import resolve_model_path

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=90, hidden_size=128, intermediate_size=384,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, tie_word_embeddings=True,
                      eos_token_id=STOP_TOKENS, pad_token_id=0, bos_token_id=None)
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    src = resolve_model_path("builtin:tiny-arith")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(src / f, out / f)
    return out


def workloads(tmp: Path) -> dict:
    tail = build_tail_model(tmp / "tail-model")
    return {
        "tail": ([("colocated", 1), ("colocated", 2), ("separated", 2), ("one_step", 2),
                  ("async", 2)],
                 ["train.max_steps=16", f"model.path={tail}", "rollout.max_tokens=64",
                  "reward.name=bench_pools:first_digit", "train.lr=1e-3",
                  "data.heldout_size=8"]),
        "learn": ([("separated", 2), ("one_step", 2), ("async", 2), ("async-cut", 2)],
                  ["train.max_steps=20", "data.heldout_size=40"]),
    }


def launch(shape: str, world: int, sets: list[str], out: Path) -> float:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), str(HERE)]),
               OMP_NUM_THREADS="1")
    partial = "cut" if shape.endswith("-cut") else "continue"
    args = ["train", "--out", str(out), "--set", "log.progress=false",
            "--set", f"schedule.shape={shape.removesuffix('-cut')}",
            "--set", f"schedule.partial={partial}", "--set", f"rollout.queue_size={BOUND}",
            "--set", f"schedule.max_staleness={BOUND}"]
    for s in sets:
        args += ["--set", s]
    cmd = [sys.executable, "-m", "orbitrl", *args] if world == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={world}", "-m", "orbitrl", *args]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"{shape} x{world} failed:\n{r.stderr[-3000:]}")
    return time.perf_counter() - t0


def summarize(out: Path, shape: str, world: int, wall: float) -> dict:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    s = json.loads((out / "summary.json").read_text())
    tail = [r for r in rows[3:] if "time_step_s" in r] or rows
    meas = sum(r["time_step_s"] for r in tail) / len(tail)
    pred = sum(r.get("time_step_predicted_s", 0.0) for r in tail) / len(tail)
    stale = max(r.get("staleness_max", 0) for r in rows)
    assert stale <= BOUND, f"{shape}: staleness {stale} past the bound {BOUND}"
    mean = lambda k: sum(r.get(k, 0) for r in tail) / len(tail)  # noqa: E731
    return {"steps": len(rows), "before": s["heldout_accuracy_before"],
            "after": s["heldout_accuracy_after"], "wall_s": wall, "step_s": meas,
            "pred_s": pred, "err": pred / meas - 1, "stale_max": stale,
            "len_mean": mean("completion_len_mean"), "len_max": max(
                r.get("completion_len_max", 0) for r in tail),
            "trunc": mean("truncated_frac"), "reward": (s["reward_first_20"],
                                                        s["reward_last_20"])}


SYNC_RUNS = [("adapter", False), ("adapter", True), ("full", False), ("full", True)]


def sync_table(tmp: Path, steps: int):
    """Bytes each mode's syncs moved against full copies, summed over the run's syncs."""
    print("| mode | sync_delta | syncs | bytes sent | full copy | sent / full | "
          "buckets sent whole | elements sent |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, delta in SYNC_RUNS:
        out = tmp / f"sync-{mode}-{int(delta)}"
        launch("separated", 2, [f"train.max_steps={steps}", f"train.mode={mode}",
                                "model.base_dtype=fp32", "schedule.sync_bucket_mb=0.25",
                                f"schedule.sync_delta={str(delta).lower()}",
                                "data.heldout_size=4"], out)
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "sync_full_bytes" in r]
        sent = sum(r["sync_bytes"] for r in rows)
        full = sum(r["sync_full_bytes"] for r in rows)
        assert all(r["sync_bytes"] <= r["sync_full_bytes"] for r in rows), mode
        whole = sum(r["sync_buckets_full"] for r in rows)
        print(f"| {mode} | {str(delta).lower()} | {len(rows)} | {sent:,} | {full:,} | "
              f"{sent / full:.3f} | {whole} / {sum(r['sync_buckets'] for r in rows)} | "
              f"{sum(r['sync_elements'] for r in rows):,} |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["tail", "learn", "sync"])
    ap.add_argument("--keep", type=Path, help="keep the run directories here")
    ap.add_argument("--sync-steps", type=int, default=4, help="steps of each sync run")
    args = ap.parse_args()
    if args.only == "sync":
        with tempfile.TemporaryDirectory() as tmp:
            sync_table(args.keep or Path(tmp), args.sync_steps)
        return
    print("| workload | shape | ranks | steps | held-out before -> after | wall s | "
          "step s measured | step s predicted | predicted/measured - 1 | staleness max | "
          "completion len mean / max, truncated |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for wl, (runs, sets) in workloads(Path(tmp)).items():
            if args.only and wl != args.only:
                continue
            for shape, world in runs:
                out = (args.keep or Path(tmp)) / f"{wl}-{shape}-{world}"
                wall = launch(shape, world, sets, out)
                r = summarize(out, shape, world, wall)
                print(f"| {wl} | {shape} | {world} | {r['steps']} | {r['before']:.3f} -> "
                      f"{r['after']:.3f} | {wall:.0f} | {r['step_s']:.3f} | "
                      f"{r['pred_s']:.3f} | {r['err']:+.0%} | {r['stale_max']} | "
                      f"{r['len_mean']:.1f} / {r['len_max']}, {r['trunc']:.1%} |", flush=True)
                if wl == "learn":
                    assert r["after"] - r["before"] >= 0.30, f"{shape}: learned too little"
        if not args.only:
            print()
            sync_table(args.keep or Path(tmp), args.sync_steps)


if __name__ == "__main__":
    main()
