"""Warm-start sweep for the tool task: SFT on tool-call traces, held-out greedy trajectories
evaluated along the way, one line per checkpoint. What RL starts from decides what it can
gain, and copying is learnt abruptly, so look at the whole curve (and at several seeds)
before choosing a step count.

    python scripts/sweep_tool_warmstart.py --steps 500 --lr 3e-3 --every 50 --seeds 0 1 2
    python scripts/sweep_tool_warmstart.py --steps 300 --problems 200 --every 25

Each line: the schedule (steps, lr, problems, seed), the step reached, the SFT loss,
the held-out completion rate (the first ``--heldout`` problems, fp32, as ``orbitrl eval
--task tool_arith`` scores them) and the share of trajectories whose call returned the
answer.
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch

from orbitrl.commands.eval import task_scorer
from orbitrl.data.datasets import task_rows
from orbitrl.model import load_model, load_tokenizer
from orbitrl.model.builtin import resolve_model_path
from orbitrl.train.sft import SFTConfig, encode_pairs, train_sft

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:tiny-arith")
    ap.add_argument("--steps", type=int, nargs="+", default=[500],
                    help="lengths of the lr schedule (one run each)")
    ap.add_argument("--lr", type=float, nargs="+", default=[3e-3])
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--problems", type=int, nargs="+", default=[0],
                    help="sft problems used (0: the whole split; two traces each)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--every", type=int, default=0, help="evaluate every this many steps")
    ap.add_argument("--heldout", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--save", default="", help="save each run's final model under this dir")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    path = resolve_model_path(a.model)
    print("steps lr problems seed | at loss heldout correct_calls | sft_s")
    for steps, lr, probs, seed in itertools.product(a.steps, a.lr, a.problems, a.seeds):
        torch.manual_seed(seed)
        model = load_model(path)
        tok = load_tokenizer(path, model.config.vocab_size)
        pairs = encode_pairs(tok, task_rows("tool_arith", "sft", probs or None))
        score = task_scorer("tool_arith", model, tok, a.heldout, max_tokens=12)
        cfg = SFTConfig(lr=lr, steps=steps, batch_size=a.batch_size, seed=seed)
        marks = set(range(a.every, steps, a.every)) if a.every else set()
        spent = [0.0, time.process_time()]

        def progress(step, loss):  # evaluate along the schedule, optimizer state kept
            if step + 1 in marks or step + 1 == steps:
                spent[0] += time.process_time() - spent[1]
                model.eval()
                acc, tools = score()
                hits = tools["tool_correct_rate"]
                model.train()
                print(f"{steps} {lr:g} {probs or 4000} {seed} | {step + 1} {loss:.4f} "
                      f"{acc:.3f} {hits:.3f} | {spent[0]:.0f}", flush=True)
                spent[1] = time.process_time()

        train_sft(model, pairs, cfg, progress)
        if a.save:
            from orbitrl.model import save_pretrained

            out = f"{a.save}/s{steps}-lr{lr:g}-p{probs}-seed{seed}"
            save_pretrained(model, out, tokenizer=tok)
