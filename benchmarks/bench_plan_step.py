"""`orbitrl plan`'s a-priori step time against measured runs of `orbitrl train`, on this CPU.

For each case the plan is written first, from what is known before a run: the model's
config.json, the run's settings (mode, base format, LoRA rank, samples per step and per
prompt, the completion cap, the micro-batch), the prompts' length after the chat template
(the task's rows through the tokenizer; completions spread over half the cap to the cap, the
plan's default) and this machine's rates measured by ``--this-machine`` (fp32 matmul rate,
copy bandwidth, the host's cost per dispatched op calibrated on a toy decoder of one and of
three narrow layers, a decoder layer of the model's own widths timed in training). Then ``orbitrl train --plan`` runs it; the run's summary
holds the plan's step time beside the measured median ``time_step_s``. Cases: the built-in
task at its defaults (LoRA over an NF4 base, KL to the base), and SmolLM2-135M-Instruct with
the settings of ``bench_real_grpo.py`` (LoRA r 16 on all linear layers over an fp32 base, 4
prompts x 8 samples, 16 new tokens, no KL).

    python scripts/fetch_real_model.py --out models/smollm2-135m-instruct   # once
    python benchmarks/bench_plan_step.py --steps 6                          # about 6 minutes

Prints per case the predicted and measured seconds of the step and of each phase, and their
ratio (measured / predicted). Run it alone: a second job on the cores slows the runs, not
the plan.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

SMOL = dict(prompts=4, n=8, max_tokens=16, rank=16, micro_tokens=1024)
BUILTIN = dict(prompts=8, n=8, max_tokens=8, rank=16, micro_tokens=512)


def prompt_len(config: Path | None, overrides: list[str]) -> int:
    """The task's longest prompt in tokens, as the run encodes it (chat template included)."""
    from orbitrl.config import load_config
    from orbitrl.model.tokenizer import prompt_encoder
    from orbitrl.rl.policy import policy_tokenizer
    from orbitrl.rl.run import load_data

    cfg = load_config(config, overrides)
    rows, _ = load_data(cfg)
    enc = prompt_encoder(policy_tokenizer(cfg), cfg.data)
    return max(len(enc(r[cfg.data.prompt_field])) for r in rows[:256])


def orbitrl(*args: str) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "orbitrl", *args], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"orbitrl {args[0]} failed:\n{r.stderr[-2000:]}")
    return r


def case(name: str, model: str, config: Path | None, overrides: list[str], s: dict,
         base: str, reference: str, out: Path, steps: int) -> dict:
    plen = prompt_len(config, overrides)
    seq = plen + s["max_tokens"]
    samples = s["prompts"] * s["n"]
    micro = max(1, s["micro_tokens"] // seq)
    plan_file = out / f"{name}.plan.json"
    flags = ["--model", model, "--devices", "1", "--device-memory-gb", "24", "--this-machine",
             "--strategy", "adapter", "--base-dtype", base, "--adapter-rank", str(s["rank"]),
             "--prompt-len", str(plen), "--completion-len", str(s["max_tokens"]),
             "--samples-per-step", str(samples), "--rollout-seqs", str(samples),
             "--group-size", str(s["n"]),
             "--micro-batch", str(micro), "--reference", reference, "--recompute", "off",
             "--long-tail-fraction", "0"]
    doc = json.loads(orbitrl("plan", *flags, "--json", "--out", str(plan_file)).stdout)
    run_dir = out / name
    train = ["train", *([str(config)] if config else []), "--plan", str(plan_file),
             "--out", str(run_dir)]
    for o in overrides + [f"train.max_steps={steps}",
                          f"train.micro_batch_tokens={micro * seq}"]:
        train += ["--set", o]
    orbitrl(*train)
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    rows = rows[1:] or rows  # the first step warms caches and measures the machine

    def med(key):
        xs = sorted(r.get(key, 0.0) for r in rows)
        return xs[len(xs) // 2]

    br = doc["schedule"]["breakdown"]
    return {"case": name, "prompt_len": plen, "micro_batch": micro,
            "machine": doc.get("machine"),
            "predicted": {"rollout": br["rollout_s"], "score": br["score_s"],
                          "train": br["train_s"], "step": summary["plan"]["step_s"]["predicted"]},
            "measured": {"rollout": med("time_rollout_s"), "score": med("time_score_s"),
                         "train": med("time_train_s"), "step": summary["plan"]["step_s"]["measured"]}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"),
                    help="SmolLM2-135M-Instruct directory (scripts/fetch_real_model.py)")
    ap.add_argument("--steps", type=int, default=6,
                    help="SmolLM2's steps; the built-in model's run takes five times as many")
    ap.add_argument("--out", help="keep the plans and runs here")
    args = ap.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-plan-"))
    out.mkdir(parents=True, exist_ok=True)
    results = [case("builtin", "builtin:tiny-arith", None,
                    [f"rollout.n={BUILTIN['n']}", f"rollout.prompts_per_step={BUILTIN['prompts']}",
                     f"rollout.max_tokens={BUILTIN['max_tokens']}"],
                    BUILTIN, "nf4", "device", out, 5 * args.steps)]
    if os.path.isdir(args.model):
        from bench_real_grpo import make_data
        train, _ = make_data(out, 40)
        s = SMOL
        results.append(case(
            "smollm2", args.model, None,
            [f"model.path={args.model}", "model.base_dtype=fp32", "train.mode=adapter",
             "train.lr=1e-4", f"lora.rank={s['rank']}", "lora.alpha=32", "lora.targets=[all-linear]",
             f"rollout.n={s['n']}", f"rollout.prompts_per_step={s['prompts']}",
             f"rollout.max_tokens={s['max_tokens']}", "algo.kl_coef=0.0",
             f"data.train={train}", "data.chat_template=true", "data.heldout_size=8",
             "reward.name=arithmetic"], s, "fp32", "none", out, args.steps))
    else:
        print(f"(no SmolLM2 at {args.model}: the built-in case only)")
    m = results[0]["machine"]
    print(f"machine: {m['threads']} threads, {m['device_tflops'] * 1e3:.0f} GFLOP/s fp32, "
          f"{m['hbm_gbps']:.1f} GB/s copy; host us per op "
          + ", ".join(f"{k} {v:.1f}" for k, v in m["host_us"].items()))
    for r in results:
        print(f"  {r['case']}: a trained token costs {r['machine']['train_layer_token_s'] * 1e6:.1f} "
              f"us per layer ({r['machine']['train_workers']} workers); prompt "
              f"{r['prompt_len']} tokens")
    print(f"{'case':<10}{'phase':<9}{'predicted s':>13}{'measured s':>12}{'ratio':>8}")
    for r in results:
        for ph in ("rollout", "score", "train", "step"):
            p, q = r["predicted"][ph], r["measured"][ph]
            print(f"{r['case']:<10}{ph:<9}{p:>13.3f}{q:>12.3f}{(q / p if p else float('nan')):>8.2f}")
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"(runs and plans in {out})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
