"""`orbitrl check-alignment --model DIR [--adapter DIR] [--base-dtype F] [--engine-model DIR]`:
do the rollout engine and the trainer see the same next-token distributions?

The engine samples a short completion per prompt; the trainer recomputes the same tokens;
top-k agreement, the distributions' L1 distance (mean, max) and the sampled-token logprob
gap are printed (observe/alignment.py) and checked against bounds. Exit status 0 when
aligned, 1 past a bound (each broken bound on its own line), 2 on bad input.
``--engine-model`` gives the engine its own copy of the weights from another directory (a
merged export of base + adapter, what a separate rollout pool would serve; loaded in
``--base-dtype``, without ``--adapter``); by default both paths share one model, as
colocated training does.
"""

from __future__ import annotations

import json
from pathlib import Path

from orbitrl.errors import OrbitError

FORMATS = ("fp32", "bf16", "int8", "nf4mix", "nf4")


def add_arguments(parser):
    parser.add_argument("--model", default="builtin:tiny-arith", help="HF model directory")
    parser.add_argument("--adapter", help="PEFT adapter directory applied on both paths")
    parser.add_argument("--base-dtype", default="fp32", choices=FORMATS,
                        help="storage of the frozen base (compute stays fp32)")
    parser.add_argument("--engine-model", help="the engine's own weights, from this "
                        "directory (e.g. a merged export: --base-dtype applies, --adapter "
                        "does not) instead of sharing the trainer's model")
    parser.add_argument("--prompts", help="JSONL file with a 'prompt' field per line "
                        "(default: 8 short built-in prompts)")
    parser.add_argument("--chat-template", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--max-l1", type=float, default=0.1,
                        help="bound on the largest per-position L1 distance")
    parser.add_argument("--min-topk-agreement", type=float, default=0.9)
    parser.add_argument("--max-logprob-gap", type=float, default=0.1)
    parser.add_argument("--json", help="write the figures and the verdict here")


def _load(path, fmt: str, adapter: str | None):
    from orbitrl.model.builtin import resolve_model_path  # start-up: kept off --help
    from orbitrl.rl.policy import load_checked  # start-up: kept off --help

    return load_checked(resolve_model_path(path), fmt, adapter, "checked")


def _prompts(args, tok) -> list[list[int]]:
    from orbitrl.evals.alignment import DEFAULT_PROMPTS  # start-up: kept off --help
    from orbitrl.model.tokenizer import encode_prompt  # start-up: kept off --help

    texts = DEFAULT_PROMPTS
    if args.prompts:
        from orbitrl.data.datasets import load_rows  # start-up: kept off --help

        texts = [str(r["prompt"]) for r in load_rows(args.prompts, ["prompt"])]
    return [encode_prompt(tok, t, args.chat_template) for t in texts]


def run(args) -> int:
    import torch  # start-up: kept off --help

    from orbitrl.evals.alignment import measure  # start-up: kept off --help
    from orbitrl.model import load_tokenizer  # start-up: kept off --help
    from orbitrl.model.builtin import resolve_model_path  # start-up: kept off --help
    from orbitrl.observe.alignment import AlignmentBounds, violations  # start-up: kept off --help

    if args.max_tokens < 1 or args.top_k < 1:
        raise OrbitError("--max-tokens and --top-k must be >= 1")
    torch.set_num_threads(1)
    trainer = _load(args.model, args.base_dtype, args.adapter)
    engine = trainer if not args.engine_model else _load(args.engine_model, args.base_dtype,
                                                         None)
    tok = load_tokenizer(resolve_model_path(args.model), trainer.config.vocab_size)
    bounds = AlignmentBounds(args.max_l1, args.min_topk_agreement, args.max_logprob_gap,
                             args.top_k)
    m = measure(engine, trainer, tok, _prompts(args, tok), args.max_tokens,
                args.temperature, args.seed, args.top_k)
    bad = violations(m, bounds)
    print(f"check-alignment ({args.base_dtype} base, fp32 compute, {int(m['positions'])} "
          f"tokens): top-{args.top_k} agreement {m['topk_agreement']:.4f}, top-1 "
          f"{m['top1_agreement']:.4f}, L1 mean {m['l1_mean']:.2e} max {m['l1_max']:.2e}, "
          f"sampled-token logprob gap mean {m['logprob_gap_mean']:.2e} max "
          f"{m['logprob_gap_max']:.2e}, max |logit diff| {m['logit_max_abs']:.2e}")
    for line in bad:
        print(f"misaligned: {line}")
    print("aligned" if not bad else "NOT aligned: the engine and the trainer disagree "
          "(different weights, adapters or numerics)")
    if args.json:
        Path(args.json).write_text(json.dumps({**m, "aligned": not bad, "violations": bad,
                                               "base_dtype": args.base_dtype}, indent=1))
    return 0 if not bad else 1
