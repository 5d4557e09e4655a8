"""`orbitrl sft --model DIR (--task NAME | --data FILE.jsonl) --out DIR`: supervised warm-up."""

from __future__ import annotations

import sys


def add_arguments(parser):
    parser.add_argument("--model", default="builtin:tiny-arith", help="HF model directory")
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--task", default=None, help="built-in task (arith)")
    src.add_argument("--data", default=None, help="JSONL file of prompt/answer rows")
    parser.add_argument("--prompt-field", default="prompt")
    parser.add_argument("--answer-field", default="answer")
    parser.add_argument("--limit", type=int, default=0,
                        help="use the first N rows of --data or of the task's sft split "
                        "(tool_arith: N problems, two traces each); 0: all")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (0: torch's default; one is fastest for small "
                        "models on a shared machine)")
    parser.add_argument("--out", required=True, help="output model directory")


def run(args) -> int:
    import torch
    from tqdm import tqdm

    from orbitrl.data.datasets import load_rows, task_rows
    from orbitrl.errors import OrbitError
    from orbitrl.model import load_model, load_tokenizer, save_pretrained
    from orbitrl.model.builtin import resolve_model_path
    from orbitrl.train.sft import SFTConfig, encode_pairs, train_sft

    if args.limit < 0:
        raise OrbitError(f"--limit {args.limit}: must be >= 0 (0: every row)")
    torch.manual_seed(args.seed)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    model = load_model(path)
    tok = load_tokenizer(path, model.config.vocab_size)
    if args.data:
        rows = load_rows(args.data, [args.prompt_field, args.answer_field])
        rows = rows[:args.limit] if args.limit else rows
    else:
        rows = task_rows(args.task or "arith", "sft", args.limit or None)
    pairs = encode_pairs(tok, rows, args.prompt_field, args.answer_field)
    bar = tqdm(total=args.steps, desc="sft", unit="step", file=sys.stderr)

    def progress(step, loss):
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")

    cfg = SFTConfig(lr=args.lr, steps=args.steps, batch_size=args.batch_size, seed=args.seed)
    losses = train_sft(model, pairs, cfg, progress)
    bar.close()
    save_pretrained(model, args.out, tokenizer=tok)
    print(f"sft: {args.steps} steps, final loss {losses[-1]:.4f}, wrote {args.out}")
    return 0
