"""``orbitrl eval --task humaneval | gsm8k[:FILE]``: the options this adds to ``orbitrl eval``
and the run (commands/eval.py hands these tasks here)."""

from __future__ import annotations

import json
from pathlib import Path

from orbitrl.errors import OrbitError

SUITE_TASKS = ("humaneval", "gsm8k", "gsm8k:FILE")


def add_arguments(parser) -> None:
    """Sampling options of the suite's tasks (ignored by the built-in training tasks)."""
    g = parser.add_argument_group("humaneval / gsm8k")
    g.add_argument("--n", type=int, default=0,
                   help="samples per problem for pass@k (0: greedy pass@1 only)")
    g.add_argument("--k", default="1,10", help="comma-separated k values for pass@k (<= n)")
    g.add_argument("--temperature", type=float, default=0.8, help="of the sampled pass")
    g.add_argument("--top-p", type=float, default=0.95, help="of the sampled pass")
    g.add_argument("--seed", type=int, default=0, help="of the sampled pass")
    g.add_argument("--batch", type=int, default=64, help="sequences decoded at once")
    g.add_argument("--no-greedy", action="store_true", help="skip the greedy pass")
    g.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: shared cores stall several spinning threads)")


def _options(args):
    from orbitrl.evals.run import EvalOptions  # start-up: kept off --help

    try:
        ks = tuple(int(x) for x in str(args.k).split(",") if x.strip())
    except ValueError:
        raise OrbitError(f"--k {args.k!r}: expected comma-separated integers") from None
    if args.n < 0 or args.batch < 1 or args.threads < 1:
        raise OrbitError("--n must be >= 0, --batch and --threads >= 1")
    if args.n and any(k < 1 or k > args.n for k in ks):
        raise OrbitError(f"--k {args.k}: each k must be in [1, n] (n = {args.n})")
    if args.no_greedy and not args.n:
        raise OrbitError("--no-greedy needs --n N (nothing would run)")
    return EvalOptions(n=args.n, k=ks, temperature=args.temperature, top_p=args.top_p,
                       max_tokens=args.max_tokens or 0, seed=args.seed, batch=args.batch,
                       chat_template=args.chat_template, greedy=not args.no_greedy,
                       packed_mb=args.packed_mb)


def run(args) -> int | None:
    """Run a suite task; None when ``args.task`` is not one (``orbitrl eval`` goes on)."""
    if not args.task or not (args.task == "humaneval" or args.task.split(":")[0] == "gsm8k"):
        return None
    import torch  # start-up: kept off --help

    from orbitrl.evals.run import evaluate  # start-up: kept off --help
    from orbitrl.evals.tasks import make_task  # start-up: kept off --help
    from orbitrl.model import load_tokenizer  # start-up: kept off --help
    from orbitrl.model.hf_fallback import load_any_model  # start-up: kept off --help
    from orbitrl.model.builtin import resolve_model_path  # start-up: kept off --help

    opts = _options(args)
    torch.set_num_threads(args.threads)
    task = make_task(args.task, limit=args.limit, chat=args.chat_template)
    for why in task.errors.values():
        print(f"cannot judge: {why}")
    path = resolve_model_path(args.model)
    model = load_any_model(path)  # native, else through transformers
    tok = load_tokenizer(path, model.config.vocab_size)
    if args.adapter:
        from orbitrl.model.adapters import load_adapters  # start-up: kept off --help

        load_adapters(model, args.adapter)
    name = str(path) + (f" + adapter {args.adapter}" if args.adapter else "")

    def write(res: dict) -> None:  # after every chunk: a stopped run keeps what it finished
        if args.out:
            Path(args.out).write_text(json.dumps({"model": name, **res}, indent=1))

    res = evaluate(task, model, tok, opts, on_chunk=write)
    print(summary_line(res))
    if args.out:
        print(f"wrote {args.out}")
    return 0


def summary_line(res: dict) -> str:
    """One line: greedy pass@1, sampled pass@k, problems that cannot be judged."""
    done, total = res["problems_done"], res["problems"]
    parts = [f"{res['task']}: {done} problems" + (f" of {total}" if done < total else "")]
    if "greedy" in res:
        parts.append(f"pass@1 (greedy) {res['greedy']['pass@1']:.4f}")
    if "sampled" in res:
        s = res["sampled"]
        ks = ", ".join(f"{k} {v:.4f}" for k, v in s.items() if k.startswith("pass@"))
        parts.append(f"n={s['n']} at temperature {s['temperature']:g}: {ks}")
    parts.append(f"{len(res['unjudgeable'])} cannot be judged")
    return "; ".join(parts)
