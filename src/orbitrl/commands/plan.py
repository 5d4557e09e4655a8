"""`orbitrl plan`: predict memory, bytes moved and step time for a model and a cluster.

Answers: does it fit, how many devices do I need, what is my per-device peak, where does the
step's time go, and (when nothing fits) which knob to turn. ``--json`` prints every term.
All arithmetic lives in :mod:`orbitrl.ledger`; this module parses, validates and prints.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from orbitrl.errors import OrbitError

GB = 1e9
CHOICES = {
    "--strategy": ("adamw", "stateless", "adapter"),
    "--base-dtype": ("bf16", "fp32", "fp8", "int8", "int4", "nf4mix", "nf4"),
    "--weight-dtype": ("bf16", "fp16", "fp8", "fp32"),
    "--grad-dtype": ("bf16", "fp16", "fp8", "fp32"),
    "--kv-dtype": ("bf16", "fp16", "fp8", "fp32"),
    "--ref-dtype": ("bf16", "int8", "int4", "nf4", "fp8"),
    "--reward-dtype": ("bf16", "int8", "int4", "nf4", "fp8"),
    "--reference": ("host", "device", "none"),
    "--reward-tier": ("device", "host"),
    "--offload": ("none", "optimizer", "weights"),
    "--sync": ("auto", "full", "adapter", "changed"),
    "--recompute": ("on", "off"),
    "--base-layout": ("auto", "replicated", "sharded"),
    "--schedule": ("colocated", "separated", "one_step", "async", "fastest"),
}
# adapter bases orbitrl loads (model.base_dtype); fp8 and int4 are planned only on paper
RUN_BASE_DTYPES = ("bf16", "fp32", "int8", "nf4mix", "nf4")


def add_arguments(parser):
    a = parser.add_argument
    g = parser.add_argument_group("model (one of)")
    g.add_argument("--params", help="parameter count: 1e12, 1.6T, 70B")
    g.add_argument("--model", help="checkpoint directory (config.json), builtin:NAME or a known "
                                   "name, e.g. llama3-8b")
    g.add_argument("--moe-experts", default="0", help="with --params: routed experts (0: dense)")
    g.add_argument("--moe-active", default="8", help="with --params: experts per token")
    c = parser.add_argument_group("cluster")
    c.add_argument("--devices", required=True, help="accelerators in the pool")
    c.add_argument("--device-memory-gb", required=True, help="memory per device, GB (1e9 bytes)")
    c.add_argument("--host-memory-gb", default="0", help="host RAM per node, GB (0: 2x the node's device memory)")
    c.add_argument("--devices-per-node", default="8")
    c.add_argument("--max-util", default="0.9", help="share of device memory the plan may use")
    s = parser.add_argument_group("strategy")
    s.add_argument("--strategy", default="stateless", help="adamw | stateless | adapter")
    s.add_argument("--base-dtype", default="bf16", help="frozen base of adapter: bf16 | fp32 | fp8 | int8 | int4 | nf4")
    s.add_argument("--adapter-rank", default="16")
    s.add_argument("--int4-group", default="128",
                   help="values per bf16 scale of an int4 base (128: GPTQ/AWQ/torchao layout)")
    s.add_argument("--weight-dtype", default="bf16")
    s.add_argument("--grad-dtype", default="bf16")
    s.add_argument("--offload", default="none", help="none | optimizer | weights (to host)")
    w = parser.add_argument_group("workload")
    w.add_argument("--prompt-len", default="512")
    w.add_argument("--completion-len", default="1536", help="completion cap, tokens")
    w.add_argument("--rollout-seqs", default="auto",
                   help="concurrent sequences the run needs in the cluster (their KV must fit); "
                        "auto: elastic KV pool from the memory left (default)")
    w.add_argument("--min-rollout-seqs", default="8",
                   help="elastic KV: max-length sequences per device that must fit")
    w.add_argument("--micro-batch", default="auto",
                   help="sequences per tp group per micro step (packed); auto: fewest whose "
                        "compute hides the layer gathers, lowered to fit memory")
    w.add_argument("--samples-per-step", default="512")
    w.add_argument("--reply-len", default="0",
                   help="the typical completion, tokens, for the step time (memory stays "
                        "priced at the cap); 0: spread below the cap by --long-tail-fraction")
    w.add_argument("--group-size", default="1",
                   help="samples per prompt (rollout.n): a group that fits one packed row "
                        "trains on one copy of its prompt")
    w.add_argument("--kv-dtype", default="bf16")
    w.add_argument("--recompute", default="on", help="on | off")
    w.add_argument("--logit-chunk", default="1024", help="tokens per chunked-logprob slice")
    r = parser.add_argument_group("roles")
    r.add_argument("--reference", default="host", help="host | device | none")
    r.add_argument("--ref-dtype", default="int8")
    r.add_argument("--reward-params", default="0", help="reward model size; 0: rule-based")
    r.add_argument("--reward-dtype", default="bf16")
    r.add_argument("--reward-tier", default="device")
    r.add_argument("--critic", action="store_true", help="PPO value model (policy-sized)")
    l_ = parser.add_argument_group("layout, links and schedule")
    l_.add_argument("--tp", default="0", help="tensor parallel degree (0: the planner picks)")
    l_.add_argument("--base-layout", default="auto",
                    help="adapter's frozen base: replicated per tp group (no gathers) | sharded | "
                         "auto (replicated when it fits)")
    l_.add_argument("--prefetch-depth", default="2", help="layers gathered ahead")
    l_.add_argument("--interconnect-gbps", default="50")
    l_.add_argument("--host-gbps", default="25")
    l_.add_argument("--sync-gbps", default="25")
    l_.add_argument("--device-tflops", default="400", help="sustained, not peak")
    l_.add_argument("--hbm-gbps", default="3000")
    l_.add_argument("--op-us", default="0",
                    help="host microseconds per dispatched op (0: hidden behind the device's "
                         "work, as with graph-captured decode)")
    l_.add_argument("--this-machine", action="store_true",
                    help="measure this host's fp32 matmul rate, copy bandwidth and per-op cost "
                         "(about a minute) and plan with them instead of --device-tflops, "
                         "--hbm-gbps and --op-us: a CPU run of orbitrl train")
    l_.add_argument("--long-tail-fraction", default="0.5",
                    help="share of a synchronous rollout spent waiting on the longest completions")
    l_.add_argument("--staleness", default="2", help="async: max policy versions a sample spans")
    l_.add_argument("--sync", default="auto", help="weight sync to a separate pool: full | adapter | changed")
    l_.add_argument("--changed-fraction", default=None,
                    help="share of weights a step changes (default: 0.03 dense, 5e-4 MoE)")
    l_.add_argument("--schedule", default="colocated",
                    help="schedule shape a plan file runs (--out): colocated | separated | "
                         "one_step | async | fastest (the simulator's quickest)")
    a("--json", action="store_true", help="print the whole bill as JSON")
    a("--out", metavar="PLAN.json",
      help="also write the plan as a file `orbitrl train --plan` runs (docs/planner.md)")


def _num(args, flag: str, kind=float, positive=True, lo=None, hi=None):
    from orbitrl.ledger.models import parse_count  # start-up: kept off --help
    raw = getattr(args, flag.lstrip("-").replace("-", "_"))
    try:
        v = parse_count(raw) if kind is int and positive else float(raw)
    except ValueError:
        raise OrbitError(f"{flag}: expected a positive number, got {raw!r}") from None
    if kind is int and float(v) != int(float(v)):
        raise OrbitError(f"{flag}: expected a whole number, got {raw!r}")
    v = kind(v)
    if (positive and v <= 0) or (not positive and v < 0):
        raise OrbitError(f"{flag}: must be {'positive' if positive else 'zero or more'}, got {raw!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise OrbitError(f"{flag}: must be in [{lo}, {hi}], got {raw!r}")
    return v


def _choice(args, flag: str) -> str:
    v = getattr(args, flag.lstrip("-").replace("-", "_"))
    if v not in CHOICES[flag]:
        raise OrbitError(f"{flag}: unknown {v!r}; one of {', '.join(CHOICES[flag])}")
    return v


def _shape(args):
    from orbitrl.ledger import models  # start-up: kept off --help
    if bool(args.params) == bool(args.model):
        raise OrbitError("give one of --params N or --model DIR")
    if args.params:
        try:
            n = models.parse_count(args.params)
        except ValueError as e:
            raise OrbitError(f"--params: {e}") from None
        experts = _num(args, "--moe-experts", int, positive=False)
        return models.from_params(n, experts, _num(args, "--moe-active", int))
    if args.model.startswith("builtin:"):
        from orbitrl.model.builtin import resolve_model_path  # start-up: kept off --help
        try:
            return models.load_model_dir(str(resolve_model_path(args.model)))
        except (OSError, ValueError, json.JSONDecodeError) as e:
            raise OrbitError(f"--model: cannot read {args.model}'s config.json: {e}") from None
    if os.path.isdir(args.model) or args.model.endswith(".json"):
        try:
            return models.load_model_dir(args.model)
        except (OSError, ValueError, json.JSONDecodeError) as e:
            raise OrbitError(f"--model: cannot read a config.json in {args.model}: {e}") from None
    try:
        return models.known(args.model)
    except ValueError as e:
        raise OrbitError(f"--model: not a directory, and {e}") from None


def _layer_probe(args, kind: str, strat, work) -> tuple[float, int]:
    """(seconds per decoder layer per trained token, workers) timed on this host at the
    model's widths (``observe/calibrate.py`` layer_token_seconds), as ``orbitrl train`` on
    this CPU cuts and runs the batch: adapters on ``min(2, cores)`` workers (its
    ``train.workers`` auto), full mode on one; (0, 1) without a config.json to build the
    layers from (``--params``, a named shape)."""
    from orbitrl.observe.calibrate import layer_token_seconds  # start-up: kept off --help
    hf = _hf_config(args)
    if hf is None:
        return 0.0, 1
    workers = max(1, min(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                         else (os.cpu_count() or 1))) if kind == "adapter" else 1
    seq = work.prompt_len + (work.reply_len or work.completion_len)
    rows = work.micro or max(1, min(math.ceil(work.samples_per_step / workers), 4096 // seq))
    try:
        return layer_token_seconds(hf, kind, strat.base_dtype, strat.adapter_rank, rows, seq,
                                   workers), workers
    except (ValueError, KeyError, OSError) as e:
        raise OrbitError(f"--this-machine: cannot build {args.model}'s layers to time them: "
                         f"{e}") from None


def _hf_config(args) -> dict | None:
    """The model's config.json as a dict (a directory or ``builtin:``), else None."""
    if not args.model or not (args.model.startswith("builtin:") or os.path.isdir(args.model)):
        return None
    from orbitrl.model.builtin import resolve_model_path  # start-up: kept off --help
    path = resolve_model_path(args.model) if args.model.startswith("builtin:") \
        else Path(args.model)
    return json.loads((Path(path) / "config.json").read_text())


def build(args):
    """Parse and validate the flags into ledger objects; OrbitError names the bad flag."""
    from orbitrl.ledger.bandwidth import Links  # start-up: kept off --help
    from orbitrl.ledger.bill import RoleOptions  # start-up: kept off --help
    from orbitrl.ledger.memory import Strategy, Workload  # start-up: kept off --help
    from orbitrl.ledger.plan import Cluster, Options  # start-up: kept off --help
    shape = _shape(args)
    strat = Strategy(_choice(args, "--strategy"), _choice(args, "--base-dtype"),
                     _num(args, "--adapter-rank", int), _choice(args, "--weight-dtype"),
                     _choice(args, "--grad-dtype"), int4_group=_num(args, "--int4-group", int))
    mem = _num(args, "--device-memory-gb") * GB
    wd = strat.stored_dtype
    layer = shape.layer_params * strat.bytes_per_param()
    if mem < layer:
        raise OrbitError(f"--device-memory-gb: {mem / GB:g} GB is smaller than one layer of the "
                         f"model ({layer / GB:.2f} GB in {wd})")
    auto = ("auto", "0", "")
    work = Workload(prompt_len=_num(args, "--prompt-len", int),
                    completion_len=_num(args, "--completion-len", int),
                    rollout_seqs=None if args.rollout_seqs in auto else _num(args, "--rollout-seqs", int),
                    micro_batch=0 if args.micro_batch in auto else _num(args, "--micro-batch", int),
                    samples_per_step=_num(args, "--samples-per-step", int),
                    kv_dtype=_choice(args, "--kv-dtype"),
                    recompute=_choice(args, "--recompute") == "on",
                    logit_chunk=_num(args, "--logit-chunk", int),
                    min_rollout_seqs=_num(args, "--min-rollout-seqs", int),
                    reply_len=_num(args, "--reply-len", int, positive=False),
                    group_size=_num(args, "--group-size", int))
    reward = 0 if args.reward_params in ("0", "") else _num(args, "--reward-params", int)
    roles = RoleOptions(_choice(args, "--reference"), _choice(args, "--ref-dtype"), reward,
                        _choice(args, "--reward-dtype"), _choice(args, "--reward-tier"),
                        bool(args.critic), CHOICES["--offload"].index(_choice(args, "--offload")))
    rates = [_num(args, f) for f in ("--device-tflops", "--hbm-gbps")]
    rates.append(_num(args, "--op-us", positive=False))
    host = None
    if args.this_machine:
        from orbitrl.observe.calibrate import host_cost  # start-up: kept off --help
        from orbitrl.observe.flops import measure_machine  # start-up: kept off --help
        print("measuring this machine (about a minute) ...", file=sys.stderr, flush=True)
        args.machine = measure_machine(shape.hidden, shape.intermediate or 4 * shape.hidden)
        rates = [args.machine["device_tflops"], args.machine["hbm_gbps"], 0.0]
        kind = "adapter" if strat.kind == "adapter" else "full"
        host = host_cost(kind, strat.base_dtype, roles.reference != "none")
        args.machine["host_us"] = dict(host.__dict__)
        layer_s, workers = _layer_probe(args, kind, strat, work)
        args.machine.update(train_layer_token_s=layer_s, train_workers=workers)
    machine = getattr(args, "machine", None) or {}
    links = Links(*(_num(args, f) for f in ("--interconnect-gbps", "--host-gbps", "--sync-gbps")),
                  device_tflops=rates[0], hbm_gbps=rates[1], op_us=rates[2], host=host,
                  train_layer_token_s=machine.get("train_layer_token_s", 0.0),
                  train_workers=machine.get("train_workers", 1))
    cluster = Cluster(_num(args, "--devices", int), mem, _num(args, "--host-memory-gb", positive=False) * GB,
                      _num(args, "--devices-per-node", int), _num(args, "--max-util", lo=0.05, hi=1.0),
                      links)
    tp = _num(args, "--tp", int, positive=False)
    if tp and cluster.devices % tp:
        raise OrbitError(f"--tp: {tp} does not divide --devices {cluster.devices}")
    opts = Options(roles, tp or None, _num(args, "--prefetch-depth", int, positive=False),
                   _num(args, "--long-tail-fraction", positive=False, lo=0.0, hi=0.95),
                   _num(args, "--staleness", int), _choice(args, "--sync"),
                   None if args.changed_fraction is None
                   else _num(args, "--changed-fraction", lo=0.0, hi=1.0),
                   _choice(args, "--base-layout"))
    return shape, strat, work, cluster, opts


def flags(knob) -> str:
    """A planner knob as the flags that set it (``devices=8`` -> ``--devices 8``)."""
    return " ".join(f"--{name.replace('_', '-')} {value}" for name, value in knob.settings)


def proposal_doc(pr) -> dict | None:
    """The ``proposal`` of the --json document (and the report's line) from the planner's."""
    if pr is None:
        return None
    if pr.knob is None:
        return {"knob": None, "per_device_bytes": None, "fits": False,
                "message": "nothing fits: the per-device terms that do not shrink with more "
                           "devices (gathered layers, activations, logits) exceed the device; "
                           "lower --micro-batch/--seq lengths, raise --tp or use bigger devices"}
    flag = flags(pr.knob)
    if pr.per_device_bytes is None:  # more devices
        n = dict(pr.knob.settings)["devices"]
        return {"knob": flag, "per_device_bytes": None, "fits": True,
                "message": f"no single knob fits {pr.devices} devices; {n} devices fit as given"}
    return {"knob": flag, "per_device_bytes": pr.per_device_bytes, "fits": True,
            "message": f"turn {flag}: peak {pr.per_device_bytes / GB:.1f} GB per device"}


def run(args) -> int:
    from orbitrl.ledger.plan import plan  # start-up: kept off --help
    from orbitrl.ledger.report import render  # start-up: kept off --help
    p = plan(*build(args))
    doc = p.to_dict()
    doc["proposal"] = proposal_doc(p.proposal)
    if getattr(args, "machine", None):
        doc["machine"] = args.machine
    if args.out:
        from orbitrl.ledger.plan_file import write_plan  # start-up: kept off --help
        write_plan(args.out, plan_document(args, p, doc))
    text = json.dumps(doc, indent=2) if args.json else render(doc)
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `orbitrl plan ... | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def run_settings(args, shape_name: str, rollout_ranks: int | None) -> dict:
    """The orbitrl config keys the plan's choices fix (the ``settings`` of a plan file)."""
    strategy = args.strategy
    out: dict = {}
    if args.model and (args.model.startswith("builtin:") or os.path.isdir(args.model)):
        out["model.path"] = args.model if args.model.startswith("builtin:") \
            else os.path.abspath(args.model)
    out["train.mode"] = "adapter" if strategy == "adapter" else "full"
    out["train.optimizer"] = "adalomo" if strategy == "stateless" else "adamw"
    if strategy == "adapter":
        if args.base_dtype in RUN_BASE_DTYPES:
            out["model.base_dtype"] = args.base_dtype
        out["lora.rank"] = int(args.adapter_rank)
    out["train.recompute"] = args.recompute == "on"
    out["rollout.max_tokens"] = int(args.completion_len)
    if args.critic:
        out["algo.name"] = "ppo"
        out["critic.kind"] = "model"
    out["schedule.shape"] = shape_name
    if rollout_ranks is not None:
        out["schedule.rollout_ranks"] = rollout_ranks
    return out


def plan_document(args, p, doc: dict) -> dict:
    """The plan file: per-role plan, the settings it fixes and what it predicts."""
    from orbitrl.ledger.plan_file import FORMAT, VERSION  # start-up: kept off --help
    shapes = doc["schedule"].get("shapes", {})
    want = _choice(args, "--schedule")
    if want == "fastest":
        want = min(shapes, key=lambda k: shapes[k]["step_s"]) if shapes else "colocated"
    if want not in shapes:
        raise OrbitError(f"--schedule: {want} needs at least 2 devices (have {p.cluster.devices}); "
                         f"use --schedule colocated")
    chosen = shapes[want]
    rollout_ranks = None if want == "colocated" else int(chosen["rollout_devices"])
    return {
        "format": FORMAT, "version": VERSION,
        "devices": p.cluster.devices,
        "fits": doc["fits"],
        "model": doc["model"]["name"],
        "tp": doc["tp"], "dp": doc["dp"],
        "micro_batch": doc["micro_batch"],
        "schedule": {"shape": want, "rollout_devices": chosen["rollout_devices"],
                     "train_devices": chosen["train_devices"]},
        "roles": doc["execution"],
        "settings": run_settings(args, want, rollout_ranks),
        "predicted": {"peak_bytes_per_device": doc["per_device_bytes"],
                      "role_bytes": {r: v["device"] for r, v in doc["roles"].items()},
                      "step_s": chosen["step_s"]},
    }
