"""Rollout speed as a user meets it: whole processes, orbitrl against transformers'
``generate``, alternated, in the same thread environment, the median of several runs.

Two workloads:

- **real**: SmolLM2-135M-Instruct (``scripts/fetch_real_model.py``), 8 chat prompts x 8
  samples, cap 64, temperature 1, real EOS. orbitrl: ``orbitrl generate --chat-template``
  (the CLI: imports, load, packing, generation, writing the JSONL). transformers: a script
  a user would write: ``AutoTokenizer`` / ``AutoModelForCausalLM`` (fp32), the chat
  template, left padding, one padded ``generate(do_sample=True, num_return_sequences=8)``
  over every prompt, the completions decoded and written.
- **tail**: a GRPO-shaped long tail on a 27M-parameter model (random weights, hidden 512,
  8 layers, vocab 8000: ``bench_engine.py``'s small model): 12 prompts x 8, a tenth of the
  samples at the cap of 128, the rest uniform in 1..32, every sample stopped exactly at its
  drawn length (EOS off): orbitrl's engine with a per-sample stop, transformers' padded
  ``generate`` with a per-row StoppingCriteria (``bench_engine.run_orbitrl`` /
  ``run_hf_generate``, each in a fresh spawned process: spawn, imports, load, warm-up,
  generation, exit).

Each round runs every system once, one process at a time, the order alternating from
round to round; the table takes each system's median over the rounds and prints every
run, and each system's generation time (orbitrl's from its summary line, transformers'
around its ``generate`` call).

The limit (real workload): a token costs 2 x the model's weights in FLOPs (the matmuls:
attention over at most 120 positions and the sampler add under 2%), and this machine's
fastest fp32 GEMM (oneDNN over prepacked weights, on one decode step's shapes at 64 rows,
measured here) runs them at the printed rate; the tokens a system generated x FLOPs per
token / that rate is the time those matmuls alone take at it (smaller batches run slower
than 64 rows, so a real run's floor lies above it). transformers' padded ``generate`` also computes the rows that finished (every
row runs until the longest is done), which its useful tokens do not count.

Tokens: the real workload's systems sample different tokens (their own generators), so each
reports the tokens it generated and the ratio is of the whole processes' seconds; on the
tail workload both generate the same lengths.

    python benchmarks/bench_rollout_process.py --model /tmp/smollm2      # about 6 minutes
    python benchmarks/bench_rollout_process.py --model /tmp/smollm2 --rounds 5 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPTS = [
    "What is 17 + 25? Reply with only the final number.",
    "Write a haiku about the sea.",
    "Name three primary colors.",
    "Explain in one sentence what a CPU does.",
    "What is the capital of France?",
    "Give me a short tip for staying focused.",
    "What is 9 times 8?",
    "Describe a cat in a few words.",
]
N, CAP = 8, 64

HF_SCRIPT = r'''
import json, sys, torch
torch.set_num_threads(int(sys.argv[4]))
from transformers import AutoModelForCausalLM, AutoTokenizer
model_dir, prompts, out = sys.argv[1], sys.argv[2], sys.argv[3]
n, cap = int(sys.argv[5]), int(sys.argv[6])
tok = AutoTokenizer.from_pretrained(model_dir)
tok.padding_side = "left"
if tok.pad_token is None:
    tok.pad_token = tok.eos_token
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
rows = [json.loads(x) for x in open(prompts)]
texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                 add_generation_prompt=True) for r in rows]
batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
torch.manual_seed(0)
import time
t0 = time.perf_counter()
with torch.no_grad():
    gen = model.generate(**batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                         max_new_tokens=cap, num_return_sequences=n,
                         pad_token_id=tok.pad_token_id)
gen_s = time.perf_counter() - t0
new = gen[:, batch["input_ids"].shape[1]:]
eos = tok.eos_token_id
tokens = 0
with open(out, "w") as f:
    for i, row in enumerate(new.tolist()):
        ids = row[:row.index(eos) + 1] if eos in row else row
        tokens += len(ids)
        f.write(json.dumps({"index": i // n, "completion": tok.decode(ids,
                            skip_special_tokens=True)}) + "\n")
print(json.dumps({"tokens": tokens, "generate_s": gen_s, "rows": int(new.shape[0]),
                  "steps": int(new.shape[1])}))
'''


def _env(threads: int) -> dict:
    return dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))


def real_runs(model: str, threads: int, work: Path):
    """(name, zero-argument callable -> (seconds, tokens)) for the real workload."""
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    script = work / "hf_generate.py"
    script.write_text(HF_SCRIPT)

    def orbitrl_cli():
        out = work / "orbitrl.jsonl"
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "orbitrl.cli", "generate", "--model", model,
                            "--prompts", str(prompts), "--out", str(out), "--n", str(N),
                            "--max-tokens", str(CAP), "--temperature", "1",
                            "--chat-template", "--no-progress"], check=True,
                           env=_env(threads), capture_output=True, text=True)
        s = time.perf_counter() - t0
        rows = [json.loads(x) for x in out.read_text().splitlines()]
        gen = float(re.search(r" in ([0-9.]+)s: ", p.stderr).group(1))  # its summary line
        return s, sum(len(r["completion_ids"]) for r in rows), gen

    def hf_generate():
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, str(script), model, str(prompts),
                            str(work / "hf.jsonl"), str(threads), str(N), str(CAP)],
                           check=True, env=_env(threads), capture_output=True, text=True)
        s = time.perf_counter() - t0
        r = json.loads(p.stdout.strip().splitlines()[-1])
        return s, r["tokens"], r["generate_s"]

    return [("orbitrl generate (CLI)", orbitrl_cli), ("transformers generate", hf_generate)]


def tail_runs(threads: int, work: Path):
    """The long-tail workload's two systems, each a fresh spawned process."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import bench_engine as be

    os.environ["OMP_NUM_THREADS"] = str(threads)  # the spawned children's thread count
    d = work / "small"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "qwen2", **be.SMALL_MODEL)).save_pretrained(d)
    prompts, lengths = be.tail_workload(12, 8, 128, be.SMALL_MODEL["vocab_size"])

    def system(fn):
        def run():
            r = be.in_process(fn, str(d), prompts, lengths, 128)
            if "error" in r:
                raise RuntimeError(r["error"])
            return r["process_s"], r["tokens"], r["seconds"]
        return run

    return [("orbitrl engine", system(be.run_orbitrl)),
            ("transformers generate", system(be.run_hf_generate))]


def alternate(systems, rounds: int) -> dict:
    """Every system once per round, one at a time, the order reversed every other round;
    name -> list of (whole-process seconds, tokens, generation seconds)."""
    runs = {name: [] for name, _ in systems}
    for k in range(rounds):
        order = systems if k % 2 == 0 else systems[::-1]
        for name, fn in order:
            s, toks, gen = fn()
            runs[name].append((s, toks, gen))
            print(f"  round {k + 1}/{rounds} {name}: {s:.2f} s whole, {gen:.2f} s generating, "
                  f"{toks} tokens", flush=True)
    return runs


def matmul_rate(hidden: int, inter: int, vocab: int, rows: int = 64) -> float:
    """FLOP/s of this machine's fastest fp32 GEMM (oneDNN over a prepacked weight, what
    orbitrl's engine runs; MKL's is slower at these shapes) on one decode step's shapes at
    ``rows`` rows, weighted by their FLOPs: the projections and the head."""
    import torch

    shapes = [(hidden, 3 * hidden), (hidden, hidden), (hidden, 2 * inter), (inter, hidden),
              (hidden, vocab)]
    flops = secs = 0.0
    for k, n in shapes:
        w = torch.randn(n, k)
        x = torch.randn(rows, k)
        pk = torch.ops.mkldnn._reorder_linear_weight(w, 64)
        best = float("inf")
        for _ in range(7):
            t0 = time.perf_counter()
            torch.ops.mkldnn._linear_pointwise(x, pk, None, "none", [None], "")
            best = min(best, time.perf_counter() - t0)
        flops += 2 * rows * k * n
        secs += best
    return flops / secs


def table(title: str, runs: dict, flops_per_token: float | None = None,
          rate: float | None = None):
    names = list(runs)
    med = {n: statistics.median(s for s, _, _ in runs[n]) for n in names}
    ours = med[names[0]]
    print(f"\n{title}")
    head = "| system | whole process, median (s) | runs (s) | generating, median (s) | tokens |"
    head += f" {names[0]} faster, whole process |"
    if flops_per_token:
        head += " limit for its tokens (s) | generating at % of the limit |"
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for n in names:
        gen = statistics.median(g for _, _, g in runs[n])
        toks = statistics.median(t for _, t, _ in runs[n])
        line = (f"| {n} | {med[n]:.2f} | {', '.join(f'{s:.2f}' for s, _, _ in runs[n])} | "
                f"{gen:.2f} | {toks:.0f} | {med[n] / ours:.2f}x |")
        if flops_per_token:
            limit = toks * flops_per_token / rate
            line += f" {limit:.2f} | {100 * limit / gen:.0f}% |"
        print(line)
    return {n: med[n] / ours for n in names}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/tmp/smollm2",
                    help="SmolLM2-135M-Instruct directory (scripts/fetch_real_model.py)")
    ap.add_argument("--rounds", type=int, default=3, help="runs per system (median; >= 3)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads, every system")
    ap.add_argument("--workloads", default="real,tail")
    a = ap.parse_args()
    if a.rounds < 3:
        ap.error("--rounds: the median needs at least 3 runs")
    work = Path(tempfile.mkdtemp(prefix="bench_rollout_"))
    print(f"{a.threads} thread(s) per system, {a.rounds} rounds, alternated", flush=True)
    results = {}
    if "real" in a.workloads:
        if not (Path(a.model) / "config.json").exists():
            sys.exit(f"--model {a.model}: no config.json (run scripts/fetch_real_model.py)")
        print(f"\nreal: {Path(a.model).name}, {len(PROMPTS)} chat prompts x {N}, cap {CAP}, "
              "temperature 1, real EOS", flush=True)
        hf = json.loads((Path(a.model) / "config.json").read_text())
        import torch

        torch.set_num_threads(a.threads)
        rate = matmul_rate(hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"])
        import orbitrl

        params = orbitrl.load_model(a.model).config.num_params
        print(f"matmul rate at 64 rows (oneDNN, prepacked): {rate / 1e9:.1f} GFLOP/s; "
              f"{2 * params / 1e6:.0f} MFLOP per token (2 x {params / 1e6:.1f}M weights)",
              flush=True)
        results["real"] = table("real model, whole processes",
                                alternate(real_runs(a.model, a.threads, work), a.rounds),
                                2 * params, rate)
    if "tail" in a.workloads:
        print("\ntail: 27M-parameter model, 12 prompts x 8, a tenth at cap 128, the rest "
              "1..32", flush=True)
        results["tail"] = table("long tail, whole processes",
                                alternate(tail_runs(a.threads, work), a.rounds))
    (work / "results.json").write_text(json.dumps(results, indent=1))
    print(f"\nresults: {work / 'results.json'}")


if __name__ == "__main__":
    main()
