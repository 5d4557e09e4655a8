"""Warm-start the built-in tiny model by supervised training on the arithmetic format.

Runs after scripts/make_builtin_model.py; trains on the task's ``sft`` split only (held-out
and RL prompts are disjoint) to a modest held-out accuracy so RL has room to improve, and
overwrites src/orbitrl/builtin/tiny-arith/.

    python scripts/sft_builtin.py [--steps 600] [--lr 3e-3]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import orbitrl
from orbitrl.data.arith import arith_rows, sft_rows
from orbitrl.model import load_tokenizer, save_pretrained
from orbitrl.rewards import get_reward
from orbitrl.rl.evaluate import accuracy
from orbitrl.train.sft import SFTConfig, encode_pairs, train_sft

from make_builtin_model import OUT, build

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000, help="length of the lr schedule")
    ap.add_argument("--stop-at", type=int, default=1000, help="stop after this many steps")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--out", default=None, help="write here instead of the built-in dir")
    ap.add_argument("--save-each", default=None, help="also save a copy at every eval")
    a = ap.parse_args()
    torch.set_num_threads(1)  # tiny matmuls: threads cost more than they give
    torch.manual_seed(a.seed)
    out = Path(a.out) if a.out else OUT
    build(out, a.seed)
    model, tok = orbitrl.load_model(out), load_tokenizer(out)
    pairs = encode_pairs(tok, sft_rows(seed=a.seed))
    held = arith_rows("heldout")
    reward, lenient = get_reward("exact_match"), get_reward("arithmetic")
    t0 = time.time()
    done = 0
    while done < min(a.steps, a.stop_at):
        k = min(a.eval_every, min(a.steps, a.stop_at) - done)
        # one cosine schedule over the whole run, evaluated every eval_every steps
        cfg = SFTConfig(lr=a.lr, steps=a.steps, batch_size=a.batch_size, warmup=20, seed=a.seed + done)
        train_sft(model, pairs, cfg, None, start=done, stop=done + k)
        done += k
        acc, _ = accuracy(model, tok, held, reward, max_tokens=8)
        num, _ = accuracy(model, tok, held, lenient, max_tokens=8)
        print(f"step {done}: held-out exact {acc:.3f}, number right {num:.3f} "
              f"({time.time() - t0:.0f}s)", flush=True)
        if a.save_each:
            save_pretrained(model, f"{a.save_each}/step{done}", tokenizer=tok)
    save_pretrained(model, out, tokenizer=tok)
    print(f"wrote {out}")
