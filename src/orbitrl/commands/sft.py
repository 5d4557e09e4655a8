"""`orbitrl sft --model DIR (--task NAME | --data FILE.jsonl) --out DIR`: supervised warm-up."""

from __future__ import annotations

import sys

from orbitrl.commands.eval import task_scorer
from orbitrl.errors import OrbitError


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
    parser.add_argument("--eval-every", type=int, default=0, metavar="N",
                        help="with --task: greedy held-out accuracy every N steps (as "
                        "`orbitrl eval --task` scores it); 0: never")
    parser.add_argument("--stop-at", type=float, default=None, metavar="ACC",
                        help="with --eval-every: end the warm start at the first evaluation "
                        "whose held-out accuracy is at least ACC (a level that leaves RL "
                        "something to learn, whatever the seed or CPU)")
    parser.add_argument("--heldout", type=int, default=200,
                        help="held-out rows each evaluation scores (0: all)")
    parser.add_argument("--chat-template", action="store_true",
                        help="prompts through the model's chat template, as a run with "
                        "data.chat_template: true encodes them; with --task tool_arith the "
                        "traces are the chat rollouts' own turns (tools listed by the "
                        "template or a system message, <tool_call>{json}</tool_call> calls, "
                        "results as tool messages: env.* defaults)")
    parser.add_argument("--out", required=True, help="output model directory")


def run(args) -> int:
    import torch  # start-up: kept off --help
    from tqdm import tqdm  # start-up: kept off --help

    from orbitrl.data.datasets import load_rows, task_rows  # start-up: kept off --help
    from orbitrl.model import load_tokenizer, save_pretrained  # start-up: kept off --help
    from orbitrl.model.hf_fallback import load_any_model  # start-up: kept off --help
    from orbitrl.model.builtin import resolve_model_path  # start-up: kept off --help
    from orbitrl.train.sft import SFTConfig, train_sft  # start-up: kept off --help

    if args.limit < 0:
        raise OrbitError(f"--limit {args.limit}: must be >= 0 (0: every row)")
    if args.eval_every < 0 or args.heldout < 0:
        raise OrbitError("--eval-every and --heldout: must be >= 0")
    if args.eval_every and args.data:
        raise OrbitError("--eval-every: needs --task (the held-out rows of a built-in task)")
    if args.stop_at is not None and not args.eval_every:
        raise OrbitError("--stop-at: needs --eval-every N (when to evaluate)")
    if args.chat_template and args.eval_every:
        raise OrbitError("--eval-every: scores the built-in syntax only; evaluate a "
                         "--chat-template warm start with a short `orbitrl train` run")
    if args.stop_at is not None and not 0 <= args.stop_at <= 1:
        raise OrbitError(f"--stop-at {args.stop_at:g}: an accuracy, between 0 and 1")
    torch.manual_seed(args.seed)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    model = load_any_model(path)  # native, else through transformers
    tok = load_tokenizer(path, model.config.vocab_size)
    if args.data:
        rows = load_rows(args.data, [args.prompt_field, args.answer_field])
        rows = rows[:args.limit] if args.limit else rows
    elif args.chat_template and args.task == "tool_arith":  # the problems: two turns each
        from orbitrl.data.tool_arith import tool_rows  # start-up: kept off --help

        rows = tool_rows("sft", args.limit or None, traces=False)
    else:
        rows = task_rows(args.task or "arith", "sft", args.limit or None)
    pairs = _pairs(args, tok, rows)
    score = None
    if args.eval_every:
        score = task_scorer(args.task or "arith", model, tok, args.heldout)
    bar = tqdm(total=args.steps, desc="sft", unit="step", file=sys.stderr)
    reached = []  # the accuracy that ended the warm start

    def progress(step, loss):
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")
        last = step + 1 == args.steps
        if score is None or (step + 1) % args.eval_every and not last:
            return False
        model.eval()
        acc, tools = score()
        model.train()
        calls = ("" if tools is None else
                 f", tool called correctly {tools['tool_correct_rate']:.1%}")
        bar.write(f"sft step {step + 1}: loss {loss:.4f}, held-out accuracy {acc:.3f}{calls}",
                  file=sys.stderr)
        if args.stop_at is not None and acc >= args.stop_at and not last:
            reached.append(acc)
            return True  # (at the schedule's last step there is nothing left to stop)
        return False

    cfg = SFTConfig(lr=args.lr, steps=args.steps, batch_size=args.batch_size, seed=args.seed)
    losses = train_sft(model, pairs, cfg, progress)
    bar.close()
    save_pretrained(model, args.out, tokenizer=tok)
    stopped = (f" (stopped: held-out accuracy {reached[0]:.3f} >= --stop-at "
               f"{args.stop_at:g})" if reached else "")
    print(f"sft: {len(losses)} steps{stopped}, final loss {losses[-1]:.4f}, wrote {args.out}")
    return 0


def _pairs(args, tok, rows) -> list:
    """(prompt ids, answer ids) per row: plain text, or through the chat template
    (``--chat-template``; the tool task as its chat rollouts' turns)."""
    from orbitrl.train.sft import encode_pairs  # start-up: kept off --help

    if not args.chat_template:
        return encode_pairs(tok, rows, args.prompt_field, args.answer_field)
    if not getattr(tok, "chat_template", None):
        raise OrbitError(f"--chat-template: {args.model} has no chat template")
    if args.task == "tool_arith":
        from orbitrl.config import load_config  # start-up: kept off --help
        from orbitrl.rl.trajectory import chat_tool_pairs  # start-up: kept off --help

        return chat_tool_pairs(tok, load_config(None, ["env.name=tools",
                                                       "data.chat_template=true"]), rows)
    from orbitrl.model.tokenizer import encode_prompt  # start-up: kept off --help

    return [(encode_prompt(tok, str(r[args.prompt_field]), chat_template=True),
             list(tok(str(r[args.answer_field]), add_special_tokens=False)["input_ids"])
             + [tok.eos_token_id]) for r in rows]
