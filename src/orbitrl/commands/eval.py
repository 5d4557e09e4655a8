"""`orbitrl eval --model DIR [--adapter DIR] [--task NAME | --data FILE] [--out FILE.json]`:
greedy accuracy (for a data file, ``exact_match`` against its answer field; for the built-in
code task, the fraction of tests passed in the sandbox). ``--task humaneval`` and ``--task
gsm8k[:FILE]`` (pass@1 greedy, pass@k from --n samples) run in orbitrl.evals."""

from __future__ import annotations

import json
from pathlib import Path


def add_arguments(parser):
    parser.add_argument("--model", default="builtin:tiny-arith", help="HF model directory")
    parser.add_argument("--adapter", help="PEFT adapter directory to apply")
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--task", help="built-in task (default: arith held-out split)")
    src.add_argument("--data", help="JSONL/Parquet file or HF dataset directory")
    parser.add_argument("--prompt-field", default="prompt")
    parser.add_argument("--answer-field", default="answer")
    parser.add_argument("--reward", help="registered reward name (default: the task's own, "
                        "code for --task code, else exact_match)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="completion cap (default 8; humaneval 384, gsm8k 256)")
    parser.add_argument("--chat-template", action="store_true",
                        help="wrap each prompt in the model's chat template, as training does "
                        "with data.chat_template: true")
    parser.add_argument("--limit", type=int, default=0, help="evaluate the first N rows only")
    parser.add_argument("--out", help="write accuracy and per-row results as JSON")
    from orbitrl.evals import cli as suite  # --task humaneval | gsm8k[:FILE]

    suite.add_arguments(parser)


def run(args) -> int:
    from orbitrl.evals import cli as suite

    if (code := suite.run(args)) is not None:  # --task humaneval | gsm8k[:FILE]
        return code
    import torch

    from orbitrl.data.datasets import TASK_REWARDS, load_rows, task_rows
    from orbitrl.engine import Engine, Request, SamplingParams
    from orbitrl.model import load_model, load_tokenizer
    from orbitrl.model.builtin import resolve_model_path
    from orbitrl.model.tokenizer import encode_prompt
    from orbitrl.rewards import RewardRunner
    from orbitrl.rl.evaluate import reward_fields

    torch.set_num_threads(1)
    args.max_tokens = args.max_tokens or 8
    path = resolve_model_path(args.model)
    task = args.task or "arith"
    name = args.reward or TASK_REWARDS.get(task, "exact_match")
    # one batch through the runner (a batch reward such as ``code`` scores every row in one
    # sandbox pool); an unknown reward fails here, before the model loads
    runner = RewardRunner([name], timeout_s=None)
    if args.data:
        rows = load_rows(args.data, [args.prompt_field, args.answer_field])
        source = args.data
    else:
        rows = task_rows(task, "heldout")
        source = f"task {task} (held-out split)"
    if args.limit:
        rows = rows[:args.limit]
    model = load_model(path)
    tok = load_tokenizer(path, model.config.vocab_size)
    if args.adapter:
        from orbitrl.model.adapters import load_adapters

        load_adapters(model, args.adapter)
    engine = Engine(model, tok)
    prompts = [encode_prompt(tok, r[args.prompt_field], args.chat_template) for r in rows]
    outs = engine.generate([Request(prompt_ids=p) for p in prompts],
                           SamplingParams(n=1, max_tokens=args.max_tokens, temperature=0.0))
    texts = [o.samples[0].text if o.error is None else "" for o in outs]
    # a failing verifier is an error for that row, scored 0
    res = runner(
        [r[args.prompt_field] for r in rows], texts,
        [reward_fields(r, args.prompt_field, args.answer_field) for r in rows])
    failed = {e.index: e.reason for e in res.errors}
    records = [{"prompt": r[args.prompt_field],
                "completion": t + (f"  [reward error: {failed[i]}]" if i in failed else ""),
                "answer": r.get(args.answer_field), "score": s,
                **({"error": o.error} if o.error else {})}
               for i, (r, t, s, o) in enumerate(zip(rows, texts, res.rewards, outs))]
    total = sum(res.rewards)
    acc = total / max(1, len(rows))
    print(f"accuracy {acc:.4f} ({int(total)}/{len(rows)}) on {source}, model {path}"
          + (f" + adapter {args.adapter}" if args.adapter else ""))
    if args.out:
        Path(args.out).write_text(json.dumps({"accuracy": acc, "n": len(rows),
                                              "rows": records}, indent=1))
    return 0
