"""`orbitrl rm --data PAIRS.jsonl --out DIR`: train a reward model on chosen/rejected pairs
(Bradley-Terry) and save it as a transformers sequence classifier (docs/reward_models.md)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from orbitrl.errors import OrbitError

SUMMARY = "rm_summary.json"
DEFAULT_LR = 1e-5  # full fine-tuning of a real model's weights


def add_arguments(parser):
    parser.add_argument("--data", required=True,
                        help='JSONL file of {"prompt", "chosen", "rejected"} rows')
    parser.add_argument("--model", default="builtin:tiny-arith",
                        help="base model: a directory, a Hub id or builtin:NAME (a causal LM "
                        "gets a fresh scalar head; a sequence classifier trains on)")
    parser.add_argument("--eval-data", default=None,
                        help="held-out pairs (default: --held-out of --data)")
    parser.add_argument("--held-out", type=float, default=0.1, metavar="FRACTION",
                        help="share of --data held out for pair accuracy (without --eval-data)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate (default: a built-in model's own train.lr, 1e-3 "
                        f"for the tiny one; {DEFAULT_LR:g} for any other model)")
    parser.add_argument("--batch-size", type=int, default=16, help="pairs per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (0: torch's default)")
    parser.add_argument("--out", required=True,
                        help="output directory: new or empty (nothing in it is overwritten)")


def run(args) -> int:
    import torch  # start-up: kept off --help
    from tqdm import tqdm  # start-up: kept off --help

    from orbitrl.model import load_tokenizer  # start-up: kept off --help
    from orbitrl.model.builtin import resolve_model_path  # start-up: kept off --help
    from orbitrl.train.reward_model import (  # start-up: kept off --help
        new_reward_model, save_reward_model)
    from orbitrl.train.rm import (  # start-up: kept off --help
        RMConfig, encode_pairs, pair_accuracy, read_pairs, split_pairs, train_rm)

    if args.epochs < 1 or args.batch_size < 1:
        raise OrbitError("--epochs and --batch-size: must be >= 1")
    if not args.eval_data and not 0 < args.held_out < 1:
        raise OrbitError(f"--held-out {args.held_out:g}: a fraction between 0 and 1")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise OrbitError(f"{out}: exists and is not an empty directory (orbitrl rm writes a "
                         "new one; choose another --out)")
    rows = read_pairs(args.data)
    held_rows = read_pairs(args.eval_data) if args.eval_data else None
    device = torch.device(args.device if args.device != "auto" else
                          "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise OrbitError(f"--device {args.device}: no CUDA device on this machine")
    torch.manual_seed(args.seed)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    try:
        vocab = json.loads((path / "config.json").read_text()).get("vocab_size")
    except (OSError, json.JSONDecodeError) as e:
        raise OrbitError(f"{path / 'config.json'}: unreadable ({e})") from None
    tok = load_tokenizer(path, vocab)
    rm = new_reward_model(path, tok, device=device, seed=args.seed)
    pairs = encode_pairs(tok, rows)
    train, held = ((pairs, encode_pairs(tok, held_rows)) if held_rows is not None
                   else split_pairs(pairs, args.held_out, args.seed))
    bs = args.batch_size
    before = pair_accuracy(rm, held, bs)
    print(f"rm: {len(train)} training pairs, {len(held)} held out; held-out pair accuracy "
          f"before {before:.3f}", file=sys.stderr)
    lr = args.lr if args.lr is not None else default_lr(args.model)
    cfg = RMConfig(lr=lr, epochs=args.epochs, batch_size=bs, seed=args.seed)
    bar = tqdm(total=cfg.epochs * -(-len(train) // bs), desc="rm", unit="step", file=sys.stderr)

    def progress(step, loss):
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")

    losses = train_rm(rm, train, cfg, progress)
    bar.close()
    after = pair_accuracy(rm, held, bs)
    summary = {"base": str(args.model), "data": str(args.data), "pairs_train": len(train),
               "pairs_heldout": len(held), "lr": lr, "epochs": args.epochs,
               "steps": len(losses), "final_loss": losses[-1],
               "heldout_accuracy_before": before, "heldout_accuracy_after": after}
    # written whole beside the target, then renamed: an interrupted run leaves no half
    # checkpoint under --out
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    save_reward_model(rm, tmp, tok)
    (tmp / SUMMARY).write_text(json.dumps(summary, indent=2))
    if out.exists():
        out.rmdir()  # (checked empty above)
    os.replace(tmp, out)
    print(f"rm: {len(losses)} steps, final loss {losses[-1]:.4f}, held-out pair accuracy "
          f"{before:.3f} -> {after:.3f}, wrote {out}")
    return 0


def default_lr(model: str) -> float:
    """A built-in model's tuned ``train.lr`` (its orbitrl.yaml), else ``DEFAULT_LR``."""
    import yaml  # start-up: kept off --help

    from orbitrl.config import builtin_run_settings  # start-up: kept off --help

    f = builtin_run_settings(model)
    lr = (yaml.safe_load(f.read_text()) or {}).get("train", {}).get("lr") if f else None
    return float(lr) if lr is not None else DEFAULT_LR
