"""`orbitrl eval --model DIR [--adapter DIR] [--task NAME | --data FILE] [--out FILE.json]`
or `orbitrl eval --run RUN_DIR`: greedy accuracy through the path training evaluates with,
judged by a strict grader (``--grader``, rewards/graders.py; for a data file, its final
answer against the answer field; for the built-in code task, the tests in the sandbox; for
a run, the run's own grader, prompt encoding and frozen-base format on its held-out rows),
with the training reward's mean on the same completions beside it. ``--task humaneval`` and ``--task
gsm8k[:FILE]`` (pass@1 greedy, pass@k from --n samples) run in orbitrl.evals."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from orbitrl.commands._common import add_packed_arg, packed_bytes
from orbitrl.errors import OrbitError
from orbitrl.evals import cli as suite


def add_arguments(parser):
    parser.add_argument("--model", default="builtin:tiny-arith", help="HF model directory")
    parser.add_argument("--run", metavar="RUN_DIR",
                        help="a finished `orbitrl train` run: its final policy on its held-out "
                        "rows, with the run's prompt encoding (chat template), reward and "
                        "max tokens (the other flags except --limit and --out are ignored)")
    parser.add_argument("--adapter", help="PEFT adapter directory to apply")
    parser.add_argument("--base-dtype", choices=("auto", "fp32", "bf16", "int8", "nf4mix", "nf4"),
                        default="auto", help="the frozen base's format under --adapter; auto: "
                        "the one the adapters were trained over (their orbitrl_base.json), "
                        "else fp32")
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--task", help="built-in task (default: arith held-out split)")
    src.add_argument("--data", help="JSONL/Parquet file or HF dataset directory")
    parser.add_argument("--prompt-field", default="prompt")
    parser.add_argument("--answer-field", default="answer")
    parser.add_argument("--reward", help="registered reward name (default: the task's own, "
                        "code for --task code, else exact_match)")
    parser.add_argument("--grader", choices=("auto", "exact", "answer", "reward"),
                        default="auto", help="how accuracy is judged (the training reward's "
                        "mean is printed beside it): exact (the stripped completion is the "
                        "answer), answer (the final answer, extracted strictly, equals it), "
                        "reward (the reward); auto: exact for the built-in arithmetic tasks, "
                        "reward for code, else answer (docs/eval.md); --run: the run's "
                        "eval.grader")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="completion cap (default 8; humaneval 384, gsm8k 256)")
    parser.add_argument("--chat-template", action="store_true",
                        help="wrap each prompt in the model's chat template, as training does "
                        "with data.chat_template: true")
    parser.add_argument("--limit", type=int, default=0, help="evaluate the first N rows only")
    parser.add_argument("--out", help="write accuracy and per-row results as JSON")
    add_packed_arg(parser)

    suite.add_arguments(parser)


def run(args) -> int:
    packed_bytes(args)  # checked before either path loads a model
    if (code := suite.run(args)) is not None:  # --task humaneval | gsm8k[:FILE]
        return code
    import torch  # start-up: kept off --help

    from orbitrl.data.datasets import (  # start-up: kept off --help
        TASK_REWARDS, load_rows, task_rows)
    from orbitrl.rewards import RewardRunner  # start-up: kept off --help
    from orbitrl.rewards.graders import choose_grader  # start-up: kept off --help

    torch.set_num_threads(1)
    if args.run:
        return _run_of(args)
    args.max_tokens = args.max_tokens or 8
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
    fields = SimpleNamespace(prompt_field=args.prompt_field, answer_field=args.answer_field,
                             chat_template=args.chat_template)
    model, tok, path = _load(args.model, args.adapter, args.base_dtype)
    grader = choose_grader(args.grader, name, None if args.data else task)
    return _evaluate(args, model, tok, path, args.adapter,
                     rows[:args.limit] if args.limit else rows, runner, fields, args.max_tokens,
                     source, _task_env(None if args.data else task, args), grader, name)


def _run_of(args) -> int:
    """``--run RUN_DIR``: the run's final policy on its held-out rows, encoded, capped and
    scored as the run's config says (its chat template included), as training evaluated."""
    import torch  # start-up: kept off --help

    from orbitrl.config import load_config  # start-up: kept off --help
    from orbitrl.rewards import RewardRunner  # start-up: kept off --help
    from orbitrl.rl.run import load_data  # start-up: kept off --help
    from orbitrl.rewards.graders import run_grader  # start-up: kept off --help
    from orbitrl.rl.score import reward_sources  # start-up: kept off --help

    run = Path(args.run)
    final = run / "checkpoints" / "final"
    if not (run / "config.yaml").exists() or not final.is_dir():
        raise OrbitError(f"{run}: not a finished run directory (config.yaml and "
                         "checkpoints/final)")
    cfg = load_config(run / "config.yaml")
    held = load_data(cfg)[1]
    runner = RewardRunner(reward_sources(cfg.reward), timeout_s=cfg.reward.timeout_s,
                          strip_thinking=cfg.reward.strip_thinking)
    if cfg.train.mode == "adapter":  # the frozen base in the format the run trained over
        from orbitrl.model.adapters import load_adapters  # start-up: kept off --help
        from orbitrl.rl.policy import build_policy  # start-up: kept off --help

        policy = build_policy(cfg, torch.device("cpu"))
        load_adapters(policy.model, final)
        model, tok, path, adapter = policy.model, policy.tokenizer, policy.path, final
    else:
        model, tok, path = _load(final, None)
        adapter = None
    return _evaluate(args, model, tok, path, adapter,
                     held[:args.limit] if args.limit else held, runner, cfg.data,
                     cfg.rollout.max_tokens, f"run {run} (held-out rows)",
                     cfg if cfg.env.name else None, run_grader(cfg), cfg.reward.name,
                     cfg.eval.warn_gap)


def _load(model_path, adapter, base_dtype: str = "auto"):
    """(model, tokenizer, resolved path) of a model directory plus PEFT adapters, the frozen
    base in ``base_dtype`` (auto: the format the adapters were trained over, else fp32)."""
    from orbitrl.model import load_tokenizer  # start-up: kept off --help
    from orbitrl.model.adapters import trained_base  # start-up: kept off --help
    from orbitrl.model.builtin import resolve_model_path  # start-up: kept off --help
    from orbitrl.rl.policy import load_checked  # start-up: kept off --help

    path = resolve_model_path(model_path)
    fmt = base_dtype
    if adapter and fmt == "auto":
        fmt = trained_base(adapter) or "fp32"
        if fmt != "fp32":
            print(f"adapters {adapter} were trained over a {fmt} base: evaluating over the "
                  f"same (--base-dtype fp32 for the full-precision weights)")
    fmt = "fp32" if fmt == "auto" else fmt
    model = load_checked(path, fmt, adapter, "evaluated")
    return model, load_tokenizer(path, model.config.vocab_size), path


def task_scorer(task: str, model, tok, limit: int, max_tokens: int = 8):
    """``score() -> (accuracy, tool summary or None)``: greedy ``model`` (as it is at each
    call: one engine runs its modules, and starts each batch without the cached prefixes of
    earlier weights) on the first ``limit`` held-out rows of built-in ``task``, encoded,
    capped and scored as ``orbitrl eval --task`` does (a multi-turn task's rows as
    trajectories)."""
    from orbitrl.data.datasets import TASK_REWARDS, task_rows  # start-up: kept off --help
    from orbitrl.rewards import RewardRunner  # start-up: kept off --help
    from orbitrl.rl.evaluate import tool_summary  # start-up: kept off --help

    rows = task_rows(task, "heldout", limit or None)
    runner = RewardRunner([TASK_REWARDS.get(task, "exact_match")], timeout_s=None)
    data = SimpleNamespace(prompt_field="prompt", answer_field="answer", chat_template=False)
    # made once: a new engine zeroes a KV pool of hundreds of MB
    evaluator = _evaluator(model, tok, data, max_tokens,
                           _task_env(task, SimpleNamespace(max_tokens=max_tokens)))

    def score():
        acc, records = evaluator.run(rows, runner)
        return acc, tool_summary(records)

    return score


def _task_env(task, args):
    """A multi-turn built-in task's run config (its ``env`` section), else None."""
    if task != "tool_arith":
        return None
    from orbitrl.config import Config  # start-up: kept off --help
    from orbitrl.data.tool_arith import TOOL_ENV  # start-up: kept off --help

    cfg = Config()
    for k, v in TOOL_ENV.items():
        setattr(cfg.env, k, v)
    cfg.rollout.max_tokens = args.max_tokens
    return cfg


def _evaluator(model, tok, data, max_tokens, env_cfg=None, packed_mb: int | None = None):
    """The shared evaluation path (``rl/evaluate.py``) over one engine running ``model``:
    prompts encoded as ``data`` says; ``env_cfg``, a run config whose ``env`` makes each
    row a multi-turn trajectory; ``packed_mb``: ``--packed-mb`` (None: the engine's
    default)."""
    from orbitrl.engine.hf_generate import engine_for  # start-up: kept off --help
    from orbitrl.model.tokenizer import prompt_encoder  # start-up: kept off --help
    from orbitrl.rl.evaluate import Evaluator  # start-up: kept off --help

    engine = engine_for(model, tok, **({} if packed_mb is None else
                                       {"packed_bytes": packed_mb << 20}))
    encode = prompt_encoder(tok, data)
    turns = None
    if env_cfg is not None:
        from orbitrl.rl.trajectory import trajectories_fn  # start-up: kept off --help

        turns = trajectories_fn(engine, tok, encode, env_cfg)
    return Evaluator(engine, encode, data, max_tokens, trajectories=turns)


def _evaluate(args, model, tok, path, adapter, rows, runner, data, max_tokens, source,
              env_cfg=None, grader=("reward", None), reward_name="reward",
              warn_gap: float | None = None) -> int:
    """Score ``rows`` through the shared evaluation path (``rl/evaluate.py``); print the
    accuracy (``grader``: (name, function) from rewards/graders.py) with the reward's mean
    beside it, and write ``--out``. ``env_cfg``: a run config whose ``env`` makes each row a
    multi-turn trajectory (the accuracy is then the task's completion rate)."""
    from orbitrl.config import EvalSection  # start-up: kept off --help
    from orbitrl.rewards.graders import reward_gap_warning  # start-up: kept off --help
    from orbitrl.model.tokenizer import opens_thinking, prompt_encoder  # start-up: off --help
    from orbitrl.rl.evaluate import tool_summary  # start-up: kept off --help

    # a template that opens <think> itself: a reply that never closes it has no answer
    runner.opened = opens_thinking(tok, prompt_encoder(tok, data))
    j = _evaluator(model, tok, data, max_tokens, env_cfg,
                   args.packed_mb).judge(rows, runner, grader[1])
    acc, records = j.accuracy, j.records
    for r in records:  # a failing verifier is an error for that row, scored 0
        if "error" in r:
            r["completion"] += f"  [reward error: {r.pop('error')}]"
    total = sum(r["correct"] for r in records)
    print(f"accuracy {acc:.4f} ({int(total)}/{len(rows)}) on {source}, model {path}"
          + (f" + adapter {adapter}" if adapter else "")
          + f"; grader {grader[0]}, reward {reward_name!r} mean {j.reward:.4f}")
    gap = EvalSection.warn_gap if warn_gap is None else warn_gap
    if (warn := reward_gap_warning(reward_name, acc, j.reward, gap)):
        print(warn)
    tools = tool_summary(records)
    if tools is not None:  # multi-turn: the accuracy is the completion rate
        print(f"tools: called in {tools['tool_use_rate']:.1%} of trajectories, correctly "
              f"(returned the answer) in {tools['tool_correct_rate']:.1%}; solved with a "
              f"tool {tools['tool_solved_rate']:.1%}, without {tools['solved_without_tool']:.1%}"
              f"; {tools['tool_errors']} tool errors, {tools['turns_mean']:.2f} turns")
    if args.out:
        Path(args.out).write_text(json.dumps({"accuracy": acc, "grader": grader[0],
                                              "reward_mean": j.reward, "n": len(rows),
                                              **(tools or {}),
                                              "rows": records}, indent=1))
    return 0
