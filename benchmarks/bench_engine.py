"""Rollout throughput and memory: orbitrl's engine vs transformers' padded ``generate`` and
its continuous-batching ``generate_batch`` path, on GRPO-shaped workloads, in one run.

Workload: P prompts x n = 8 samples, temperature 1, no top-k/top-p. Each sequence's length
is drawn beforehand from a long-tailed distribution (mean at most a third of the cap, a few
at the cap) and every system stops that sequence exactly there:
- orbitrl: ``generate(..., stop_fn=...)``, timed on the engine its warm-up ran on (on a CPU
  the warm-up packs the weights for oneDNN once, ``engine/packed.py``; the time it took is
  printed beside the table, and the small-model row's whole process includes it);
- transformers ``generate``: a per-row StoppingCriteria (finished rows stay in the batch,
  as they do in real use);
- transformers continuous batching (the manager behind ``generate_batch``): one request per
  sequence with its own ``max_new_tokens`` (``generate_batch`` itself takes one cap for all).
EOS is disabled everywhere. Tokens/s counts the same useful tokens for every system.

Repeats: each system runs its timed generation ``--repeat`` times (default 2) in its own
process (orbitrl on the same engine, each ``generate`` starting from an empty prefix cache;
the continuous-batching manager made afresh for each), and the table takes each system's
fastest run; every run's time is printed (orbitrl's per-step trace and counters are its
last run's). The systems' runs take turns (``interleaved``): every process loads and warms
up, then round r runs each system's r-th run, one process at a time, the others waiting.
On a shared machine the same run varies by 10-30% from minute to minute (consecutive
orbitrl runs on the 4 x 8 workload, one process: 3.1 to 4.4 s); with each system's runs
spread over the same minutes, a slow spell falls on every system, not on whichever one ran
then, and the fastest of several runs of each is less at its mercy. The ``--small`` row
runs once: it reports each system's whole process.

Memory: each system runs in its own fresh process; a thread samples the process RSS
(/proc/self/statm) every 2 ms; "peak growth" is the highest RSS seen during generation
(including the continuous-batching manager's start-up, where its cache is allocated)
minus the RSS just before it, after the model is loaded and warmed up (orbitrl: just
before its engine is made, so its growth includes the engine, the packed weights and the
warm-up).

Workloads: ``--prompts 32,16,4`` (default) runs every system on 32 prompts x 8 (256 rollouts,
a common GRPO step), then the three main ones on 16 x 8 and 4 x 8. All three have the same
cap and the same length distribution. The ratios grow with the batch: transformers'
continuous batching slows down as its batch grows. At 4 x 8, every system is bound by the
same matmuls (see the GEMM floor).

GEMM floor: the seconds that the model's weight matmuls alone take on this workload: every
prompt prefilled once (the projections over all prompt tokens, the head over one row per
prompt), then for every decode step the projections and the head at that step's batch (the
sequences still running; each sequence stopped at its drawn length), measured here with
the model's own weights, taking the fastest of three kernels: MKL through ``F.linear`` on
the row-major weights, MKL on transposed weights, and oneDNN over weights prepacked once
(``torch.ops.mkldnn``, what orbitrl's engine uses on a CPU; a sequence's first token comes
from its prompt's prefill row). Attention, sampling and every other op are left out. An
implementation that does these matmuls in fp32 with this build's GEMMs cannot beat it. Reading "x% of the floor" next to each system says how much of its time is spent
outside the matmuls.

Roofline: bytes of weights read per decode step (every parameter once; the embedding table
counted once, as the tied lm_head) divided by this machine's copy bandwidth (measured here,
2 x bytes / time of a 256 MiB tensor copy) is the floor of a decode step's time; we report
that floor / measured step time, at the workload's batch and at batch 1.

Small-model row (``--small``): a 27M-parameter model with a small vocabulary (hidden 512,
8 layers, vocab 8000) on a GRPO tail: 12 prompts x 8, a tenth of the samples at the cap
(128), the rest at a quarter of it or less (uniform in 1..32), against transformers
``generate`` and the continuous-batching manager. Besides the generation time it reports
each system's whole process (spawn, imports, model load, warm-up, generation, exit).

    python benchmarks/bench_engine.py            # about 15 minutes on 2 cores
    python benchmarks/bench_engine.py --quick    # smaller, for a smoke test
    python benchmarks/bench_engine.py --small    # the small-model row only
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import tempfile
import threading
import time

import torch

MODEL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
             tie_word_embeddings=True)
SMALL_MODEL = dict(MODEL, vocab_size=8000)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Highest RSS seen while the block runs, minus RSS on entry. ``wait(gate)`` stops the
    sampling thread while the process waits for its turn (an idle process's thread would
    otherwise wake every 2 ms beside another system's timed run)."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self._stop = False
        self._running = threading.Event()
        self._running.set()
        self._t = threading.Thread(target=self._poll, daemon=True)
        self._t.start()
        return self

    def _poll(self):
        while not self._stop:
            self._running.wait()
            self.peak = max(self.peak, _rss())
            time.sleep(0.002)

    def wait(self, gate):
        if gate is None:
            return
        self._running.clear()
        self.peak = max(self.peak, _rss())
        gate()
        self._running.set()

    def __exit__(self, *exc):
        self._stop = True
        self._running.set()
        self._t.join()
        self.peak = max(self.peak, _rss())
        self.growth = self.peak - self.base


def make_workload(num_prompts: int, n: int, cap: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(MODEL["vocab_size"]) for _ in range(rng.randint(24, 48))]
               for _ in range(num_prompts)]
    lengths = [[min(cap, 1 + int(rng.expovariate(1 / (cap / 6)))) for _ in range(n)]
               for _ in range(num_prompts)]
    for k in rng.sample(range(num_prompts * n), max(2, num_prompts * n // 16)):
        lengths[k // n][k % n] = cap  # the tail
    return prompts, lengths


# ---- the three systems, each run in its own process ------------------------------------
def run_orbitrl(model_dir, prompts, lengths, cap, kv_dtype=None, group=True, trace=False,
                repeat=1, gate=None):
    import orbitrl
    from orbitrl.engine import Engine, Request, SamplingParams

    torch.manual_seed(0)
    model = orbitrl.load_model(model_dir)
    n = len(lengths[0])
    flat = [(i, j) for i in range(len(prompts)) for j in range(n)]
    if group:  # one request per prompt, n samples sharing its blocks
        reqs = [Request(prompt_ids=p, params=SamplingParams(n=n, max_tokens=cap, seed=i,
                                                            ignore_eos=True))
                for i, p in enumerate(prompts)]
        stop = lambda i, j, c: len(c) >= lengths[i][j]  # noqa: E731
    else:  # every sample its own request (what a client without n does)
        reqs = [Request(prompt_ids=prompts[i], params=SamplingParams(
            max_tokens=cap, seed=i * n + j, ignore_eos=True)) for i, j in flat]
        stop = lambda r, j, c: len(c) >= lengths[flat[r][0]][flat[r][1]]  # noqa: E731
    # the same number of blocks for both KV dtypes (enough for this workload, sized with the
    # ledger's formula); the fp8 pool takes fewer bytes
    from orbitrl.ledger.kv import kv_bytes_per_block

    c = model.config
    blocks = (48 << 20) // kv_bytes_per_block(c.num_layers, c.num_kv_heads, c.head_dim, 16,
                                              "float32")
    budget = blocks * kv_bytes_per_block(c.num_layers, c.num_kv_heads, c.head_dim, 16,
                                         "fp8" if kv_dtype else "float32", 4 if kv_dtype else 0)
    kw = dict(kv_budget_bytes=budget, kv_dtype=kv_dtype, max_num_seqs=256,
              max_num_batched_tokens=4096)
    with PeakRSS() as mem:  # the engine, its warm-up and the timed run
        eng = Engine(model, **kw)
        # warm-up on the timed engine: on a CPU it packs the weights for oneDNN once
        # (engine/packed.py); the engine keeps them while the weights do not change, as it
        # would across the batches of a real run; their cost is reported beside the table
        eng.generate([prompts[0]], SamplingParams(max_tokens=4))
        pack = eng.summary()["packed_seconds"]
        runs = []
        for _ in range(repeat):  # each generate starts from an empty prefix cache
            before = eng.summary()  # its counters add up over runs: the last run's below
            mem.wait(gate)
            t0 = time.perf_counter()
            outs = eng.generate(reqs, stop_fn=stop)
            runs.append(time.perf_counter() - t0)
    toks = sum(len(s.token_ids) for o in outs for s in o.samples)
    s = eng.summary()
    raw = [s_.raw_logprobs for o in outs for s_ in o.samples]
    ids = [s_.token_ids for o in outs for s_ in o.samples]
    single, steps = None, []
    if trace:  # pure decode steps (one token per sequence) at the widest batch, and batch 1
        dec = [(n, t) for n, k, t in eng.timeline if n == k]
        widest = max(n for n, _ in dec)
        steps = [(n, t) for n, t in dec if n == widest]
        e1 = Engine(model, kv_budget_bytes=64 << 20)
        e1.generate([prompts[0]], SamplingParams(max_tokens=24, ignore_eos=True, seed=0))
        single = statistics.median(t for n, k, t in e1.timeline[2:])
    return dict(tokens=toks, seconds=min(runs), runs=runs, mem=mem.growth,
                kv_peak=s["kv_bytes_peak"],
                pack_s=pack, packed=s["packed_bytes"],
                preempt=s["preemptions"] - before["preemptions"], raw=raw, ids=ids,
                steps=steps, single=single, params=model.config.num_params,
                cow=s["cow"] - before["cow"], hits=s["prefix_hits"] - before["prefix_hits"])


def run_hf_generate(model_dir, prompts, lengths, cap, repeat=1, gate=None):
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n, width = len(lengths[0]), max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    target = torch.tensor([x for row in lengths for x in row])  # rows: prompt-major

    class PerRow(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            return (input_ids.shape[1] - width) >= target

    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None,
              pad_token_id=0, num_return_sequences=n)
    model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=4, **kw)  # warm-up
    runs = []
    with PeakRSS() as mem, torch.no_grad():
        for _ in range(repeat):
            mem.wait(gate)
            t0 = time.perf_counter()
            model.generate(ids, attention_mask=mask, max_new_tokens=cap,
                           stopping_criteria=StoppingCriteriaList([PerRow()]), **kw)
            runs.append(time.perf_counter() - t0)
    return dict(tokens=int(target.sum()), seconds=min(runs), runs=runs, mem=mem.growth)


def run_hf_batch(model_dir, prompts, lengths, cap, repeat=1, gate=None):
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gc = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                          max_new_tokens=cap, eos_token_id=-1, pad_token_id=0)
    runs = []
    with PeakRSS() as mem:
        for _ in range(repeat):  # a fresh manager (and cache) for every run
            mem.wait(gate)
            with model.continuous_batching_context_manager(generation_config=gc, block=True,
                                                           timeout=5) as man:
                t0 = time.perf_counter()
                rids = [man.add_request(p, max_new_tokens=L)
                        for p, row in zip(prompts, lengths) for L in row]
                done, toks = set(), 0
                while len(done) < len(rids):
                    r = man.get_result(timeout=1)
                    if r is not None and r.is_finished():
                        if r.error is not None:
                            raise RuntimeError(r.error)
                        done.add(r.request_id)
                        toks += len(r.generated_tokens)
                runs.append(time.perf_counter() - t0)
    return dict(tokens=toks, seconds=min(runs), runs=runs, mem=mem.growth)


def gemm_floor(model_dir, prompt_lens, lengths, cap):
    """Seconds of the weight matmuls alone: every prompt prefilled once, then every decode
    step at its batch (see the docstring)."""
    import torch.nn.functional as F

    import orbitrl

    model = orbitrl.load_model(model_dir)
    layers = [(m.weight.detach(), None if m.bias is None else m.bias.detach())
              for name, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and name != "lm_head"]
    head = [(model.lm_head.weight.detach(), None)]
    from orbitrl.engine.packed import PackedLinears, available

    flip = lambda ms: [(w.t().contiguous(), b) for w, b in ms]  # noqa: E731
    pack = lambda ms: [(torch.ops.mkldnn._reorder_linear_weight(  # noqa: E731
        w, PackedLinears.ROWS_HINT), b) for w, b in ms]
    layouts = {"row-major": (layers, head), "transposed": (flip(layers), flip(head))}
    if available():  # oneDNN over prepacked weights, what orbitrl's engine uses on a CPU
        layouts["onednn"] = (pack(layers), pack(head))
    ins = {w.shape[1] for w, _ in layers + head}
    flat = [x for row in lengths for x in row]

    def pass_(m, kind, with_layers=True, with_head=True):
        ls, hd = layouts[kind]
        chosen = (ls if with_layers else []) + (hd if with_head else [])
        xs = {k: torch.randn(m, k) for k in ins}
        t = time.perf_counter()
        for (w, b), (w0, _) in zip(chosen, (layers if with_layers else []) +
                                   (head if with_head else [])):
            x = xs[w0.shape[1]]
            if kind == "transposed":
                y = x @ w
                if b is not None:
                    y += b
            elif kind == "onednn":
                torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [None], "")
            else:
                F.linear(x, w, b)
        return time.perf_counter() - t

    def best(m, **kw):
        return min(min(pass_(m, kind, **kw) for _ in range(3)) for kind in layouts)

    # a sequence's first token comes from the prefill's head row; decode step s >= 1
    # runs every sequence longer than s
    batches = [sum(1 for L in flat if L > s) for s in range(1, cap)]
    cost = {m: best(m) for m in set(batches) - {0} | {1}}
    prefill = best(sum(prompt_lens), with_head=False) + best(len(prompt_lens),
                                                               with_layers=False)
    return dict(seconds=prefill + sum(cost[m] for m in batches if m), prefill=prefill,
                batch1=cost[1])


def _child(fn, args, kw, q, go=None):
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if go is not None:  # before each timed run: say so, then wait for the parent's go
        kw = dict(kw, gate=lambda: (q.put(("idle", None)), go.get()))
    try:
        q.put(("result", fn(*args, **kw)))
    except Exception as e:  # report, do not hang the parent
        q.put(("result", dict(error=f"{type(e).__name__}: {e}")))


def in_process(fn, *args, **kw):
    """Run ``fn(*args, **kw)`` in a fresh spawned process; its result gets ``process_s``, the
    whole process's wall time (spawn, imports, load, warm-up, the run, exit)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    t0 = time.perf_counter()
    p = ctx.Process(target=_child, args=(fn, args, kw, q))
    p.start()
    r = q.get()[1]
    p.join()
    r["process_s"] = time.perf_counter() - t0
    return r


def interleaved(jobs: list[tuple[str, object, tuple, dict]], repeat: int) -> dict:
    """Run each job ``(name, fn, args, kw)`` in its own spawned process, their timed runs
    taking turns: every process loads and warms up (one after another) and then waits;
    round r runs every system's r-th timed run in order, one process at a time. So each
    system's runs are spread over the same minutes as the others' and a slow spell of the
    machine falls on all of them, not on whichever system ran then. ``fn`` gets
    ``repeat`` and ``gate`` (called before each timed run). Returns name -> result."""
    ctx = mp.get_context("spawn")
    procs, res = {}, {}
    for name, fn, args, kw in jobs:
        q, go = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=_child, args=(fn, args, dict(kw, repeat=repeat), q, go))
        p.start()
        kind, r = q.get()  # ready for its first run (or failed before it)
        print(f"  {name}: {'loaded and warmed up' if kind == 'idle' else 'failed'}",
              flush=True)
        if kind == "result":
            res[name] = r
            p.join()
        else:
            procs[name] = (p, q, go)
    for k in range(repeat):
        for name, (p, q, go) in list(procs.items()):
            t0 = time.perf_counter()
            go.put(1)
            kind, r = q.get()  # the run is over: idle before its next one, or its result
            print(f"  run {k + 1}/{repeat} {name}: {time.perf_counter() - t0:.2f} s"
                  f"{' (with its last checks)' if kind == 'result' else ''}", flush=True)
            if kind == "result":  # after the last run (or an error)
                res[name] = r
                p.join()
                del procs[name]
    return {name: res[name] for name, *_ in jobs}


def tail_workload(num_prompts: int, n: int, cap: int, vocab: int, seed: int = 0):
    """A GRPO tail: a tenth of the samples at ``cap``, the rest uniform in 1..cap/4."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(24, 48))]
               for _ in range(num_prompts)]
    flat = [rng.randint(1, cap // 4) for _ in range(num_prompts * n)]
    for k in rng.sample(range(len(flat)), max(1, len(flat) // 10)):
        flat[k] = cap
    return prompts, [flat[i * n:(i + 1) * n] for i in range(num_prompts)]


def run_small(d, a):
    """The small-model row: generation and whole-process ratios against transformers."""
    prompts, lengths = tail_workload(12, a.n, a.cap, SMALL_MODEL["vocab_size"])
    flat = [x for r in lengths for x in r]
    print(f"\nsmall model, vocab {SMALL_MODEL['vocab_size']}: 12 prompts x n={a.n}, cap "
          f"{a.cap}, {flat.count(a.cap)} samples at the cap, the rest <= {a.cap // 4}; mean "
          f"{statistics.mean(flat):.1f}, {sum(flat)} tokens", flush=True)
    res = {}
    for name, fn in [("orbitrl", run_orbitrl), ("transformers generate", run_hf_generate),
                     ("transformers generate_batch", run_hf_batch)]:
        res[name] = r = in_process(fn, d, prompts, lengths, a.cap)
        if "error" in r:
            print(f"{name}: FAILED {r['error']}")
    ours = res["orbitrl"]
    print("| system | tokens/s | orbitrl / it | whole process (s) | orbitrl / it, whole "
          "process |")
    print("|---|---|---|---|---|")
    for name, r in res.items():
        if "error" in r:
            print(f"| {name} | failed | | | |")
            continue
        tps = r["tokens"] / r["seconds"]
        print(f"| {name} | {tps:.1f} | {ours['tokens'] / ours['seconds'] / tps:.2f}x | "
              f"{r['process_s']:.1f} | {r['process_s'] / ours['process_s']:.2f}x |")
    if "pack_s" in ours:
        print(f"orbitrl packed {ours['packed'] / 1e6:.0f} MB of weights for oneDNN in its "
              f"warm-up, {ours['pack_s']:.2f} s (in its whole process, not in tokens/s)")


def copy_bandwidth() -> float:
    x = torch.empty(256 << 20, dtype=torch.uint8)
    y = torch.empty_like(x)
    y.copy_(x)
    best = min(_timed(lambda: y.copy_(x)) for _ in range(5))
    return 2 * x.numel() / best


def _timed(f):
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def run_workload(d, num_prompts, a, bw, full: bool):
    prompts, lengths = make_workload(num_prompts, a.n, a.cap)
    flat = [x for r in lengths for x in r]
    print(f"\nworkload: {num_prompts} prompts x n={a.n}, cap {a.cap}, completion lengths mean "
          f"{statistics.mean(flat):.1f} (cap/{a.cap / statistics.mean(flat):.1f}), "
          f"{flat.count(a.cap)} at the cap; {sum(flat)} tokens in all", flush=True)
    systems = [("orbitrl", run_orbitrl, dict(trace=True))]
    if full:
        systems += [("orbitrl fp8 KV", run_orbitrl, dict(kv_dtype="fp8")),
                    ("orbitrl, no group sharing", run_orbitrl, dict(group=False))]
    systems += [("transformers generate", run_hf_generate, {}),
                ("transformers generate_batch", run_hf_batch, {})]
    jobs = []
    for name, fn, extra in systems:
        args = (d, prompts, lengths, a.cap)
        if fn is run_orbitrl:
            args += (extra.get("kv_dtype"), extra.get("group", True), extra.get("trace", False))
        jobs.append((name, fn, args, {}))
    res = interleaved(jobs, a.repeat)
    for name, r in res.items():
        if "error" in r:
            print(f"{name}: FAILED {r['error']}")
            continue
        print(f"{name}: {r['tokens']} tokens in {r['seconds']:.2f}s (best of "
              f"{', '.join(f'{x:.2f}' for x in r['runs'])})", flush=True)
    floor = in_process(gemm_floor, d, [len(p) for p in prompts], lengths, a.cap)
    if "error" in floor:
        raise SystemExit(f"GEMM floor: {floor['error']}")

    ours = res["orbitrl"]
    mib = 2 ** 20
    print()
    print(f"GEMM floor of this workload: {floor['seconds']:.2f} s = "
          f"{sum(flat) / floor['seconds']:.0f} tokens/s (weight matmuls alone, prefill "
          f"{floor['prefill']:.2f} s of it; see the docstring)")
    print()
    print("| system | tokens/s | orbitrl / it | % of GEMM floor | peak RSS growth (MiB) | "
          "it / orbitrl | KV peak (MiB) |")
    print("|---|---|---|---|---|---|---|")
    for name, r in res.items():
        if "error" in r:
            print(f"| {name} | failed | | | | | |")
            continue
        tps = r["tokens"] / r["seconds"]
        ratio = (ours["tokens"] / ours["seconds"]) / tps
        kv = f"{r['kv_peak'] / mib:.1f}" if "kv_peak" in r else "-"
        print(f"| {name} | {tps:.1f} | {ratio:.2f}x | {floor['seconds'] / r['seconds']:.0%} | "
              f"{r['mem'] / mib:.0f} | {r['mem'] / max(ours['mem'], 1):.2f}x | {kv} |")
    for name in ("transformers generate", "transformers generate_batch"):
        r = res.get(name, {})
        if "seconds" in r:
            need = r["seconds"] / 3
            print(f"3x {name}: {r['tokens'] / need:.0f} tokens/s, "
                  f"{floor['seconds'] / need:.0%} of the GEMM floor "
                  f"({'reached' if ours['seconds'] <= need else 'not reached'})")
    if ours.get("packed"):
        print(f"orbitrl: {ours['packed'] / 1e6:.0f} MB of weights packed for oneDNN in its "
              f"warm-up, {ours['pack_s']:.2f} s (once per model, not in the timed run)")
    w = ours["params"] * 4
    step_floor = w / bw
    print()
    print(f"copy bandwidth {bw / 1e9:.2f} GB/s; weights {w / 1e6:.0f} MB; decode-step floor "
          f"{step_floor * 1e3:.1f} ms")
    if ours["steps"]:
        b, t = ours["steps"][0][0], statistics.median(x[1] for x in ours["steps"])
        print(f"decode at batch {b}: {t * 1e3:.1f} ms/step = {step_floor / t:.0%} of the "
              f"bandwidth roofline ({b / t:.0f} tokens/s vs {b / step_floor:.0f})")
    print(f"decode at batch 1: {ours['single'] * 1e3:.1f} ms/step = "
          f"{step_floor / ours['single']:.0%} of the bandwidth roofline; its GEMMs alone "
          f"{floor['batch1'] * 1e3:.1f} ms")
    fp8 = res.get("orbitrl fp8 KV", {})
    if "raw" in fp8:  # same seeds: compare raw logprobs up to each sequence's first divergence
        diffs = []
        for a_, b_, ia, ib in zip(ours["raw"], fp8["raw"], ours["ids"], fp8["ids"]):
            k = next((i for i, (u, v) in enumerate(zip(ia, ib)) if u != v), len(ia))
            diffs += [abs(u - v) for u, v in zip(a_[:k], b_[:k])]  # same context, same token
        print(f"fp8 KV: sampled-token raw logprob change mean {statistics.mean(diffs):.2e}, "
              f"max {max(diffs):.2e} over {len(diffs)} tokens; KV peak "
              f"{fp8['kv_peak'] / mib:.1f} vs {ours['kv_peak'] / mib:.1f} MiB")
    ng = res.get("orbitrl, no group sharing", {})
    if "kv_peak" in ng:
        print(f"group sharing: KV peak {ours['kv_peak'] / mib:.1f} MiB with n samples sharing "
              f"prompt blocks vs {ng['kv_peak'] / mib:.1f} MiB as separate requests "
              f"({ours['cow']} copy-on-write blocks)")


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="32,16,4",
                    help="prompts per workload, comma-separated; the first gets every system")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--cap", type=int, default=128)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--small", action="store_true",
                    help="only the small-model row (vocab 8000, 12 prompts x 8, a tail)")
    ap.add_argument("--repeat", type=_positive, default=2,
                    help="timed runs per system, the systems taking turns (round r runs "
                         "every system's r-th run); the table takes each system's fastest "
                         "run (not the --small row, whose whole-process time counts one "
                         "run)")
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads for every system (also OMP_NUM_THREADS, so the "
                         "continuous-batching manager's thread gets it). Default 1: on 2 "
                         "shared cores every 2-thread GEMM with M > 1 paid a ~23 ms OpenMP "
                         "wake-up, for ours and transformers' alike")
    a = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # inherited by the spawned children
    torch.set_num_threads(a.threads)
    if a.quick:
        a.prompts, a.cap = "2", 32
    from transformers import AutoConfig, AutoModelForCausalLM

    d = tempfile.mkdtemp(prefix="bench_engine_")
    torch.manual_seed(0)
    if a.small:
        AutoModelForCausalLM.from_config(AutoConfig.for_model(
            "qwen2", **SMALL_MODEL)).save_pretrained(d)
        run_small(d, a)
        return
    AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **MODEL)).save_pretrained(d)
    bw = copy_bandwidth()
    for k, p in enumerate(int(x) for x in a.prompts.split(",")):
        run_workload(d, p, a, bw, full=k == 0)


if __name__ == "__main__":
    main()
