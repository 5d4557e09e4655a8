"""Rollout on one CUDA device: orbitrl's engine (static decode runner, CUDA graphs) against
transformers' padded ``generate`` and its continuous-batching manager (the path behind
``generate_batch``), in one run. orbitrl and ``generate`` are timed on a repeat run, after
a first run on the same engine/model that compiles kernels and (orbitrl) captures a graph
per batch bucket; both first runs are printed too. The manager fails the row after
CB_DEADLINE_S, or at once if its generation loop stops, instead of waiting forever; the
script exits 1 if orbitrl's engine failed on any row.

Model: Qwen2-0.5B-shaped (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864,
vocabulary 151936, tied head), random weights, bf16. Workload: 64 prompts of 32-256 random
tokens x n = 8 samples, temperature 1, EOS ignored. Rows:
- every sample 128 tokens; every sample 512 tokens;
- long-tailed: each sample stops at a length drawn beforehand (exponential with mean
  cap/6, one in 16 at the cap 128); orbitrl stops it through ``stop_fn``, ``generate``
  through a per-row stopping criterion (finished rows stay in the padded batch, as in real
  use), the continuous-batching manager through each request's own ``max_new_tokens``.
Tokens/s counts the same useful tokens for every system.

orbitrl runs twice: as it is by default (``async_decode``: step k+1 is launched before
the host reads step k's values) and with ``async_decode=False`` (the host reads each
step's values before it launches the next), so the overlap is measured side by side.

Per orbitrl decode step (the steps with every sequence decoding, at the widest batch):
wall time, device time (CUDA events around the runner's launch: the graph replay and the
copy of its values) and host time (the wall time less the time spent waiting for a step's
values: scheduling, appending tokens, stop checks, Python), and the roofline: the bytes a
step must read (every weight once plus each row's KV) over the copy bandwidth measured
here (2 x bytes / time of a 1 GiB device-to-device copy). Peak memory:
``torch.cuda.max_memory_allocated`` during each system's run.

    python benchmarks/bench_engine_gpu.py           # the three rows (several minutes)
    python benchmarks/bench_engine_gpu.py --quick   # 8 prompts, caps 32: a smoke run

``--device cpu --tiny --quick`` runs the same code on a CPU with a tiny model (fp32; the
engine's static decode runner forced on, eager; wall clock in place of CUDA events, no
peak memory): the test suite's smoke run of this script, whose timings mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import tempfile
import time

import torch

DEV = "cuda"  # --device
MODEL = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
             num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
             tie_word_embeddings=True)


TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
            tie_word_embeddings=True)


def _cuda() -> bool:
    return DEV == "cuda"


def _sync():
    if _cuda():
        torch.cuda.synchronize()


def _peak():
    return torch.cuda.max_memory_allocated() if _cuda() else None


def _reset_peak():
    if _cuda():
        torch.cuda.reset_peak_memory_stats()


def _dtype():
    return torch.bfloat16 if _cuda() else torch.float32


class _Mark:
    """A CUDA event's interface (``record``, ``elapsed_time`` in ms) on the host clock."""

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1e3


def _event():
    return torch.cuda.Event(enable_timing=True) if _cuda() else _Mark()


def workload(num_prompts: int, n: int, cap: int, tail: bool, seed: int = 0):
    """Prompts (32-256 random tokens) and per-sample completion lengths."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(MODEL["vocab_size"]) for _ in range(rng.randint(32, 256))]
               for _ in range(num_prompts)]
    if not tail:
        return prompts, [[cap] * n for _ in prompts]
    lengths = [[min(cap, 1 + int(rng.expovariate(1 / (cap / 6)))) for _ in range(n)]
               for _ in prompts]
    for k in rng.sample(range(num_prompts * n), max(1, num_prompts * n // 16)):
        lengths[k // n][k % n] = cap
    return prompts, lengths


def copy_bandwidth() -> float:
    size = 1 << (30 if _cuda() else 26)
    x = torch.empty(size, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    y.copy_(x)
    _sync()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        y.copy_(x)
        _sync()
        best = min(best, time.perf_counter() - t)
    del x, y
    return 2 * size / best


class StepTimer:
    """Per engine step that ran the decode runner: device milliseconds (CUDA events around
    the runner's launch: the graph replay and the copy of its values to the host) and the
    host's milliseconds waiting for values (``fetch``), each keyed by the index of the
    engine's timeline entry of the step it happened in. With ``async_decode`` the engine
    launches step k+1 before it reads step k, so the host's own work (the wall time less
    the wait) overlaps the device's."""

    def __init__(self, eng):
        self.eng, runner = eng, eng.decode_runner
        self._launch, self._fetch = runner.launch, runner.fetch
        runner.launch, runner.fetch = self.launch, self.fetch
        self.clear()

    def clear(self):
        self.events, self.waits = {}, {}

    def launch(self):
        a, b = _event(), _event()
        a.record()
        handle = self._launch()
        b.record()
        self.events[len(self.eng.timeline)] = (a, b)
        return handle

    def fetch(self, handle):
        t = time.perf_counter()
        out = self._fetch(handle)
        i = len(self.eng.timeline)
        self.waits[i] = self.waits.get(i, 0.0) + (time.perf_counter() - t) * 1e3
        return out

    def per_step(self, batch: int):
        """(wall, device, host) ms of the runner's steps at ``batch`` rows."""
        _sync()
        rows = []
        for i, (a, b) in self.events.items():
            n, _, t = self.eng.timeline[i]
            if n == batch:
                wall = t * 1e3
                rows.append((wall, a.elapsed_time(b), wall - self.waits.get(i, 0.0)))
        return rows


def run_orbitrl(path, prompts, lengths, cap, async_decode=True):
    import orbitrl
    from orbitrl.engine import Engine, Request, SamplingParams

    model = orbitrl.load_model(path, dtype="bf16" if _cuda() else "float32", device=DEV)
    n = len(lengths[0])
    reqs = [Request(prompt_ids=p, params=SamplingParams(n=n, max_tokens=cap, seed=i,
                                                        ignore_eos=True))
            for i, p in enumerate(prompts)]
    stop = lambda i, j, c: len(c) >= lengths[i][j]  # noqa: E731
    budget = torch.cuda.mem_get_info()[0] // 3 if _cuda() else 256 << 20
    kw = dict(max_num_seqs=len(prompts) * n, max_num_batched_tokens=16384,
              kv_budget_bytes=budget, async_decode=async_decode, static_decode=True)
    eng = Engine(model, **kw)
    timer = StepTimer(eng)
    # the first run compiles the kernels and captures a graph per batch bucket (they belong
    # to this engine's runner); the repeat run, on the same engine, is the one reported
    t0 = time.perf_counter()
    eng.generate(reqs, stop_fn=stop)
    first = time.perf_counter() - t0
    _reset_peak()
    timer.clear()
    t0 = time.perf_counter()
    outs = eng.generate(reqs, stop_fn=stop)
    dt = time.perf_counter() - t0
    toks = sum(len(s.token_ids) for o in outs for s in o.samples)
    widest = max(eng.timeline[i][0] for i in timer.events)
    wall, dev, host = zip(*timer.per_step(widest))
    return dict(tokens=toks, seconds=dt, first=first, peak=_peak(), batch=widest,
                step_ms=statistics.median(wall), device_ms=statistics.median(dev),
                host_ms=statistics.median(host),
                steps=len(timer.events), params=model.config.num_params)


def run_hf_generate(path, prompts, lengths, cap):
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    model = AutoModelForCausalLM.from_pretrained(path, dtype=_dtype()).to(DEV).eval()
    n, width = len(lengths[0]), max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=DEV)
    mask = (torch.arange(width, device=DEV)[None]
            >= torch.tensor([width - len(p) for p in prompts], device=DEV)[:, None]).long()
    target = torch.tensor([x for row in lengths for x in row], device=DEV)

    class PerRow(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            return (input_ids.shape[1] - width) >= target

    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None,
              pad_token_id=0, num_return_sequences=n, max_new_tokens=cap,
              stopping_criteria=StoppingCriteriaList([PerRow()]))
    times = []
    with torch.no_grad():
        for _ in range(2):  # first run, then the repeat run that is reported
            _reset_peak()
            _sync()
            t0 = time.perf_counter()
            model.generate(ids, attention_mask=mask, **kw)
            _sync()
            times.append(time.perf_counter() - t0)
    return dict(tokens=int(target.sum()), seconds=times[1], first=times[0], peak=_peak())


CB_DEADLINE_S = 300  # a continuous-batching run that has not finished by then failed
# (--quick: 25 s, inside scripts/gpu_check.sh's limit for the whole script)


def run_hf_batch(path, prompts, lengths, cap):
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=_dtype()).to(DEV).eval()
    gen = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                           max_new_tokens=cap, eos_token_id=-1, pad_token_id=0)
    _reset_peak()
    with model.continuous_batching_context_manager(generation_config=gen, block=True,
                                                   timeout=5) as man:
        t0 = time.perf_counter()
        rids = [man.add_request(p, max_new_tokens=L) for p, row in zip(prompts, lengths)
                for L in row]
        if None in rids:
            raise RuntimeError(f"continuous batching refused {rids.count(None)} requests")
        done, toks = set(), 0
        deadline = t0 + CB_DEADLINE_S
        while len(done) < len(rids):
            r = man.get_result(timeout=1)
            if r is None and (not man.is_running() or time.perf_counter() > deadline):
                why = "its generation loop stopped" if not man.is_running() else \
                    f"{CB_DEADLINE_S} s passed"
                raise RuntimeError(f"continuous batching: {why} with {len(done)} of "
                                   f"{len(rids)} requests finished")
            if r is not None and r.is_finished():
                if r.error is not None:
                    raise RuntimeError(r.error)
                done.add(r.request_id)
                toks += len(r.generated_tokens)
        dt = time.perf_counter() - t0
    return dict(tokens=toks, seconds=dt, peak=_peak())


def step_floor_ms(res, prompts, lengths, bw) -> float:
    """Milliseconds a decode step at the widest batch must spend reading: every weight
    once (bf16; fp32 on a CPU) plus each running row's KV (prompt + about half its completion)."""
    c = MODEL
    hd = c["hidden_size"] // c["num_attention_heads"]
    size = _dtype().itemsize
    per_token = c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * hd * size
    ctx = statistics.mean(len(prompts[i]) + L / 2 for i, row in enumerate(lengths)
                          for L in row)
    return (res["params"] * size + res["batch"] * ctx * per_token) / bw * 1e3


def run_row(name, path, prompts, lengths, cap, bw, with_batch=True):
    flat = [x for row in lengths for x in row]
    print(f"\n{name}: {len(prompts)} prompts x n={len(lengths[0])}, cap {cap}, mean length "
          f"{statistics.mean(flat):.1f}, {sum(flat)} tokens", flush=True)
    res = {}
    sync = lambda *a: run_orbitrl(*a, async_decode=False)  # noqa: E731
    systems = [("orbitrl", run_orbitrl), ("orbitrl, async_decode off", sync),
               ("transformers generate (repeat run)", run_hf_generate)]
    if with_batch:
        systems.append(("transformers generate_batch", run_hf_batch))
    for label, fn in systems:
        try:
            res[label] = fn(path, prompts, lengths, cap)
        except Exception as e:  # report and go on with the other systems
            res[label] = dict(error=f"{type(e).__name__}: {e}")
        # (the engine and its step timer refer to each other: collect them, so the next
        # system's KV budget and peak memory do not count this one's cache)
        gc.collect()
        if _cuda():
            torch.cuda.empty_cache()
    ours = res["orbitrl"]
    print("| system | tokens/s | orbitrl / it | peak memory (GiB) |")
    print("|---|---|---|---|")
    for label, r in res.items():
        if "error" in r:
            print(f"| {label} | failed: {r['error'][:80]} | | |")
            continue
        tps = r["tokens"] / r["seconds"]
        ratio = (ours["tokens"] / ours["seconds"]) / tps if "error" not in ours else float("nan")
        peak = "-" if r["peak"] is None else f"{r['peak'] / 2**30:.2f}"
        print(f"| {label} | {tps:,.0f} | {ratio:.2f}x | {peak} |")
        if "first" in r:
            print(f"|   (its first run) | {r['tokens'] / r['first']:,.0f} | | |")
    if "error" in ours:
        return False
    floor = step_floor_ms(ours, prompts, lengths, bw)
    for label in ("orbitrl", "orbitrl, async_decode off"):
        r = res[label]
        if "error" in r:
            continue
        print(f"{label}: decode at batch {r['batch']}: {r['step_ms']:.2f} ms/step wall, "
              f"{r['device_ms']:.2f} ms device, {r['host_ms']:.2f} ms host (wall less the "
              f"wait for values); read floor {floor:.2f} ms = {floor / r['step_ms']:.0%} of "
              f"the roofline ({r['batch'] / r['step_ms'] * 1e3:,.0f} tokens/s)")
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 prompts, caps 32: a smoke run")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: a smoke run of this script's code (with --tiny), not a "
                         "measurement")
    ap.add_argument("--tiny", action="store_true",
                    help="a 2-layer model with a 512-token vocabulary instead of "
                         "Qwen2-0.5B's shape")
    a = ap.parse_args()
    global CB_DEADLINE_S, DEV, MODEL
    DEV = a.device
    if a.tiny:
        MODEL = TINY
    if _cuda() and not torch.cuda.is_available():
        print("bench_engine_gpu: no CUDA device here; this benchmark needs one (nothing run)")
        return 0
    if a.quick:
        CB_DEADLINE_S = 25
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    path = tempfile.mkdtemp(prefix="bench_engine_gpu_")
    with torch.device(DEV):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **MODEL),
                                              dtype=_dtype())
    hf.save_pretrained(path)
    del hf
    if _cuda():
        torch.cuda.empty_cache()
    bw = copy_bandwidth()
    name = torch.cuda.get_device_name(0) if _cuda() else "CPU (a smoke run: no measurement)"
    print(f"device {name}; torch {torch.__version__}; copy bandwidth {bw / 1e12:.2f} TB/s")
    p = 8 if a.quick else a.prompts
    rows = [("every sample 32 tokens", 32, False), ("long-tailed caps", 32, True)] if a.quick \
        else [("every sample 128 tokens", 128, False), ("every sample 512 tokens", 512, False),
              ("long-tailed caps", 128, True)]
    ok = True
    for name, cap, tail in rows:
        prompts, lengths = workload(p, a.n, cap, tail)
        # --quick: the continuous-batching manager (its start-up captures graphs, unbounded
        # by its deadline) on the long-tailed row only
        ok &= run_row(name, path, prompts, lengths, cap, bw, with_batch=tail or not a.quick)
    if not ok:
        print("bench_engine_gpu: FAILED: orbitrl's engine failed on a row (see the tables)")
    return 0 if ok else 1


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # not sys.exit: a continuous-batching manager whose generation thread (not a daemon)
    # outlived its stop would hold the interpreter's exit until scripts/gpu_check.sh's limit
    os._exit(rc)
