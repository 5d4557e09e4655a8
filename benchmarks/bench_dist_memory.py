"""Per-rank peak memory of a sharded full-parameter run against one process, predicted
(the planner's sharded terms) and measured, in one run.

Workload: GRPO, full-parameter mode with the stateless fused update (AdaLomo), fp32, on a
random Llama-shaped model built here (wide layers, a small vocabulary, so the decoder
layers that FSDP2 shards dominate the bill), the built-in tokenizer and arithmetic task;
a few steps. The same config runs as 1 process and as 2 ranks (gloo, one thread each).
Each rank measures its phases' peaks with the runtime's own probe (``observe/memory.py``:
resident high-water mark, re-based on the tensors the run holds) and the runtime's own
prediction (``ledger.runtime.runtime_prediction``, ``devices`` = the world size).

Printed: per phase, predicted and measured bytes for 1 process and for the busiest of the
2 ranks, and the drop from 1 to 2 processes, predicted against measured.

    python benchmarks/bench_dist_memory.py            # about two minutes on 2 busy cores
    python benchmarks/bench_dist_memory.py --layers 4 --hidden 256   # a quick smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

PHASES = ("rollout", "score", "train")


def build_model(out: Path, hidden: int, layers: int, intermediate: int, seed: int = 0):
    """A random Llama with the built-in model's tokenizer (vocabulary 128)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from orbitrl.model.builtin import resolve_model_path

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64,
                      num_key_value_heads=hidden // 64, max_position_embeddings=64,
                      tie_word_embeddings=True, eos_token_id=1, pad_token_id=0,
                      bos_token_id=None)
    LlamaForCausalLM(cfg).save_pretrained(out)
    src = resolve_model_path("builtin:tiny-arith")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(src / f, out / f)


def train_args(model: Path, steps: int, prompts: int = 4, micro_batch_tokens: int = 48
               ) -> list[str]:
    sets = [f"model.path={model}", "model.base_dtype=fp32", "train.mode=full",
            f"train.max_steps={steps}", f"rollout.prompts_per_step={prompts}", "rollout.n=2",
            "rollout.max_tokens=4", "rollout.kv_budget_mb=4", "data.heldout_size=4",
            "log.progress=false", "checkpoint.every=0", "train.lr=1e-4",
            # one micro-batch holds 4 samples in both runs (the 2 ranks' 4 each, the one
            # process's 8 in two): activations are the same per micro-batch, so the drop
            # from 1 to 2 processes is the sharded terms' (weights, gathers, gradients)
            f"train.micro_batch_tokens={micro_batch_tokens}"]
    out = ["train"]
    for s in sets:
        out += ["--set", s]
    return out


def run(model: Path, steps: int, world: int, out: Path, timeout: float,
        prompts: int = 4) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "distributed"))
    import launch  # the test suite's rank launcher

    argv = launch.orbitrl_argv(*train_args(model, steps, prompts), "--out", str(out))
    if world == 1:
        # the allocator policy the ranks pin (orbitrl.distributed.env.return_large_blocks), so
        # both sides measure live tensors rather than heap fragmentation
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(32 << 10))
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
        if r.returncode:
            raise SystemExit(r.stderr[-3000:])
    else:
        res = launch.run(argv, world, timeout)
        for x in res:
            if x.returncode:
                raise SystemExit(f"rank {x.rank}: {x.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {"summary": summary, "rows": rows}


def phase_numbers(res: dict, world: int) -> dict:
    """{phase: (predicted per rank, measured on the busiest rank)} over the run's steps."""
    s = res["summary"]
    out = {}
    for ph in PHASES:
        if world == 1:
            meas = s.get(f"measured_{ph}_bytes")
        else:
            meas = max(v for v in s[f"measured_{ph}_bytes_by_rank"] if v is not None)
        out[ph] = (s[f"predicted_{ph}_bytes"], meas)
    out["peak"] = (max(p for p, _ in out.values()), max(m for _, m in out.values()))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", help="also write the numbers here")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        build_model(tmp / "model", a.hidden, a.layers, a.intermediate)
        one = phase_numbers(run(tmp / "model", a.steps, 1, tmp / "w1", a.timeout), 1)
        two = phase_numbers(run(tmp / "model", a.steps, 2, tmp / "w2", a.timeout), 2)
    mib = 2 ** 20
    print(f"full-parameter GRPO, fp32, Llama h={a.hidden} L={a.layers} f={a.intermediate}, "
          f"{a.steps} steps; per-rank bytes (MiB), busiest rank of 2")
    print(f"{'phase':<8} {'1p pred':>9} {'1p meas':>9} {'2p pred':>9} {'2p meas':>9} "
          f"{'drop pred':>10} {'drop meas':>10} {'meas/pred':>9}")
    table = {}
    for ph in (*PHASES, "peak"):
        p1, m1 = one[ph]
        p2, m2 = two[ph]
        dp, dm = p1 - p2, m1 - m2
        ratio = dm / dp if dp else float("nan")
        table[ph] = dict(pred_1=p1, meas_1=m1, pred_2=p2, meas_2=m2, drop_pred=dp,
                         drop_meas=dm, ratio=ratio)
        print(f"{ph:<8} {p1 / mib:9.1f} {m1 / mib:9.1f} {p2 / mib:9.1f} {m2 / mib:9.1f} "
              f"{dp / mib:10.1f} {dm / mib:10.1f} {ratio:9.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(table, indent=2))
    return table


if __name__ == "__main__":
    main()
