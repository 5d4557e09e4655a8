"""``orbitrl generate``: sample completions for a JSONL file of prompts.

Input rows: ``{"prompt": "text"}`` (tokenised as is, or with ``--chat-template`` as one
user turn under the model's chat template, as training does with ``data.chat_template``) or
``{"prompt_ids": [ints]}``, each with optional ``max_tokens``. Output: one row per
completion, in input order, the samples of one prompt adjacent::

    {"index": i, "sample": j, "completion_ids": [...], "completion": "text",
     "logprobs": [...], "raw_logprobs": [...], "finish_reason": "stop" | "length"}

``logprobs`` are under the distribution each token was drawn from (0.0 under greedy);
``raw_logprobs`` under the model at temperature 1, unfiltered.

A bad row (unparsable, empty prompt, prompt longer than the context, max_tokens <= 0, ...)
prints one line ``orbitrl generate: IN.jsonl:LINE: error: ...`` and gets no output rows; the
other rows are generated and written. The exit status is 0 when every row succeeded, 1 when
some rows failed, and 2 (no output written) when the input holds no valid row at all or the
model, file or options are unusable.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import orbitrl
from orbitrl.commands._common import add_packed_arg, packed_bytes
from orbitrl.errors import OrbitError


def add_arguments(parser):
    parser.add_argument("--model", required=True,
                        help="HF model directory, builtin:NAME or a cached Hub id")
    parser.add_argument("--prompts", required=True, help="input JSONL")
    parser.add_argument("--out", required=True, help="output JSONL")
    parser.add_argument("--n", type=int, default=1, help="samples per prompt (default 1)")
    parser.add_argument("--max-tokens", type=int, default=256,
                        help="completion cap per sample; a row's max_tokens wins (default 256)")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 is greedy (default 1)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0,
                        help="row i samples with seed (seed, i): reruns give the same output")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--kv-dtype", choices=["auto", "fp8"], default="auto")
    parser.add_argument("--kv-budget-mb", type=int, default=None,
                        help="KV pool size in MiB (default: see orbitrl.engine.Engine)")
    add_packed_arg(parser)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--chat-template", action="store_true",
                        help="wrap each text prompt in the model's chat template")
    parser.add_argument("--no-progress", action="store_true")


def _read_rows(path: Path):
    """Yields (line_no, row dict | None, error | None) for each non-blank line."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise OrbitError(f"{path}: cannot read ({e})") from None
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            yield no, None, f"not valid JSON ({e.msg})"
            continue
        if not isinstance(row, dict) or ("prompt" in row) == ("prompt_ids" in row):
            yield no, None, 'a row needs exactly one of "prompt" or "prompt_ids"'
        elif "prompt" in row and not isinstance(row["prompt"], str):
            yield no, None, '"prompt" must be a string'
        elif "prompt_ids" in row and not isinstance(row["prompt_ids"], list):
            yield no, None, '"prompt_ids" must be a list of token ids'
        else:
            yield no, row, None


JOB_KV_CAP = 2 << 30


def job_kv_bytes(model, tok, reqs, kv_dtype, block_size: int = 16) -> int:
    """The KV pool this job can use at most (without ``--kv-budget-mb``): every sample's
    prompt and cap in whole blocks, one more block each for a shared prompt's copy on
    write, at most ``JOB_KV_CAP`` (beyond it the scheduler queues and preempts). The
    engine's own default is sized for any job (``max_num_seqs`` sequences at the full
    context, up to 2 GiB) and a CPU pays the page faults of all of it: zeroing 2 GiB took
    about 4.5 s on SmolLM2's 30 layers, against 100 MiB used by 8 prompts x 8."""
    from orbitrl.engine.engine import kv_block_bytes  # start-up: kept off --help

    blocks = 0
    for r in reqs:
        if r.prompt_ids is not None:
            prompt = len(r.prompt_ids)
        else:
            prompt = len(tok(r.prompt)["input_ids"]) if r.prompt else 0
        max_tokens = max(1, r.params.max_tokens or 1)
        blocks += r.params.n * (-(-(prompt + max_tokens) // block_size) + 1)
    return min(JOB_KV_CAP, blocks * kv_block_bytes(model, kv_dtype, block_size))


def run(args) -> int:
    from orbitrl.engine import Engine, Request, SamplingParams  # start-up: kept off --help
    from orbitrl.engine.hf_generate import engine_for  # start-up: kept off --help
    from orbitrl.model.hf_fallback import HFDecoder, load_any_model  # start-up: kept off --help
    from orbitrl.ledger.runtime import engine_kv_dtype  # start-up: kept off --help
    from orbitrl.model.tokenizer import encode_prompt  # start-up: kept off --help
    from orbitrl.model.builtin import resolve_model_path  # start-up: kept off --help

    src = Path(args.prompts)
    if not src.is_file():
        raise OrbitError(f"{src}: no such file")
    path = resolve_model_path(args.model)  # builtin:NAME and Hub ids for the tokenizer too
    # the head re-laid out column-major only if the engine does not pack it (packed, its
    # GEMMs run over a copy made from the row-major weight): below, once that is known
    model = load_any_model(path, args.dtype, column_major_head=False)
    tok = orbitrl.load_tokenizer(path, vocab_size=model.config.vocab_size)
    failed, reqs, lines = 0, [], []
    for i, (no, row, err) in enumerate(_read_rows(src)):
        if err is None:
            mt = row.get("max_tokens", args.max_tokens)
            p = SamplingParams(n=args.n, max_tokens=mt, temperature=args.temperature,
                               top_p=args.top_p, top_k=args.top_k,
                               seed=args.seed * 1_000_003 + i, stop=list(args.stop))
            ids = row.get("prompt_ids")
            if args.chat_template and "prompt" in row:
                ids = encode_prompt(tok, row["prompt"], chat_template=True)
            reqs.append(Request(prompt=None if ids is not None else row.get("prompt"),
                                prompt_ids=ids, params=p))
        else:
            reqs.append(Request(prompt_ids=[], params=SamplingParams()))
        lines.append((no, err))
    if not reqs:
        raise OrbitError(f"{src}: no prompts")
    if isinstance(model, HFDecoder):  # no native code: transformers' generate, no pool
        engine = engine_for(model, tok)
    else:
        kv_dtype = engine_kv_dtype(args.kv_dtype)
        budget = (job_kv_bytes(model, tok, reqs, kv_dtype) if args.kv_budget_mb is None
                  else args.kv_budget_mb << 20)
        engine = Engine(model, tok, kv_budget_bytes=budget, kv_dtype=kv_dtype,
                        packed_bytes=packed_bytes(args))
        if model.lm_head is not None and \
                not any(model.lm_head in unit for unit in engine.packed.units):
            model.head_column_major()  # what load_model does by default

    t0 = time.perf_counter()
    outs = engine.generate(reqs, progress=not args.no_progress)
    dt = time.perf_counter() - t0
    rows = []
    for (no, err), o in zip(lines, outs):
        if err or o.error:
            failed += 1
            print(f"orbitrl generate: {src}:{no}: error: {err or o.error}", file=sys.stderr)
            continue
        for j, s in enumerate(o.samples):
            rows.append(json.dumps({"index": o.index, "sample": j,
                                    "completion_ids": s.token_ids, "completion": s.text,
                                    "logprobs": s.logprobs, "raw_logprobs": s.raw_logprobs,
                                    "finish_reason": s.finish_reason}))
    if failed == len(reqs):
        raise OrbitError(f"{src}: every row failed; nothing written")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(r + "\n" for r in rows))
    s = engine.summary()
    print(f"generated {s['generated_tokens']} tokens in {len(rows)} completions "
          f"({len(reqs) - failed} prompts, {failed} failed) in {dt:.1f}s: "
          f"{s['generated_tokens'] / max(dt, 1e-9):.1f} tokens/s; KV blocks used "
          f"{s['kv_blocks_peak']}/{s['kv_blocks']} (peak {s['kv_bytes_peak'] / 2**20:.1f} MiB), "
          f"prefix hits {s['prefix_hits']}, copy-on-write {s['cow']}, "
          f"preemptions {s['preemptions']}"
          + (f"; {s['packed_bytes'] / 2**20:.0f} MiB of weights packed for oneDNN "
             f"(packing and checks {s['packed_seconds']:.2f}s)" if s["packed_bytes"] else "")
          + f"; wrote {out}", file=sys.stderr)
    return 1 if failed else 0
