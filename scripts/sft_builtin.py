"""Warm-start the built-in tiny model by supervised training on the arithmetic format.

Runs after scripts/make_builtin_model.py; trains on the task's ``sft`` split only (held-out
and RL prompts are disjoint) to a modest held-out accuracy so RL has room to improve, and
overwrites src/orbitrl/builtin/tiny-arith/.

    python scripts/sft_builtin.py [--steps 600] [--lr 3e-3]
"""

from __future__ import annotations

import argparse
import time

import torch

import orbitrl
from orbitrl.data.arith import arith_rows
from orbitrl.model import load_tokenizer, save_pretrained
from orbitrl.rewards import get_reward
from orbitrl.rl.evaluate import accuracy
from orbitrl.train.sft import SFTConfig, encode_pairs, train_sft

from make_builtin_model import OUT, build

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=100)
    a = ap.parse_args()
    torch.set_num_threads(1)  # tiny matmuls: threads cost more than they give
    torch.manual_seed(a.seed)
    build(OUT, a.seed)
    model, tok = orbitrl.load_model(OUT), load_tokenizer(OUT)
    pairs = encode_pairs(tok, arith_rows("sft"))
    held = arith_rows("heldout")
    reward = get_reward("exact_match")
    t0 = time.time()
    done = 0
    while done < a.steps:
        k = min(a.eval_every, a.steps - done)
        # one cosine schedule over the whole run, evaluated every eval_every steps
        cfg = SFTConfig(lr=a.lr, steps=a.steps, batch_size=64, warmup=20, seed=a.seed + done)
        train_sft(model, pairs, cfg, None, start=done, stop=done + k)
        done += k
        acc, _ = accuracy(model, tok, held, reward, max_tokens=5)
        print(f"step {done}: held-out accuracy {acc:.3f} ({time.time() - t0:.0f}s)", flush=True)
    save_pretrained(model, OUT, tokenizer=tok)
    print(f"wrote {OUT}")
