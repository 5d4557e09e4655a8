"""Programs per second through the sandbox against spawning plain ``python`` per program.

Claim: isolation costs a small factor over a bare interpreter start, because Python's
startup dominates and the sandbox's ``python -S`` skips the site import. Every row runs the
same trivial program (read a line, print it back) the same number of times, with the same
parallelism (one worker per core) and the same pipes, measured side by side in one run.

Second table: the built-in code task (every problem's reference solution against its
tests), programs per second with the hardened harness (assert tests judged outside the
program from probe values, the fallback's covered directories, a memory cgroup per slot
where the machine allows one) against the earlier form (asserts appended to the program,
exit status 0 = passed, no cgroup, nothing covered on the fallback), side by side per
backend.

Third table: how long a hostile program (a busy loop, a fork bomb) runs before the
sandbox kills it, against the time limit (1 s here): the bound the tests used to assert.

    PYTHONPATH=src python benchmarks/bench_sandbox.py [--n 100] [--rounds 3] [--workers 0]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from orbitrl.config import SandboxSection
from orbitrl.errors import OrbitError
from orbitrl.rewards.sandbox import Job, Sandbox

PROGRAM = "print(input())"


def plain(python: str, flags: list[str], n: int, workers: int) -> float:
    """Programs/s spawning ``python FLAGS -c PROGRAM`` directly (no isolation, no limits)."""
    def one(_):
        out = subprocess.run([python, *flags, "-c", PROGRAM], input=b"7\n",
                             capture_output=True, check=True)
        assert out.stdout == b"7\n"

    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, range(n)))
    return n / (time.perf_counter() - t0)


def sandboxed(backend: str, n: int, workers: int) -> tuple[float, str] | None:
    try:
        box = Sandbox(SandboxSection(backend=backend, workers=workers))
    except OrbitError as e:
        print(f"(skipping {backend}: {e})", file=sys.stderr)
        return None
    t0 = time.perf_counter()
    res = box.run_many([Job(PROGRAM, b"7\n")] * n)
    rate = n / (time.perf_counter() - t0)
    bad = [r for r in res if r.status != "ok" or r.stdout != b"7\n"]
    assert not bad, bad[0]
    return rate, box.python.executable


def code_task(backend: str, workers: int, form: str, rounds: int) -> float | None:
    """Programs/s over the built-in code task's reference solutions (all must pass)."""
    from orbitrl.data.code_tasks import PROBLEMS
    from orbitrl.rewards.code import parse_tests

    try:
        box = Sandbox(SandboxSection(backend=backend, workers=workers))
    except OrbitError:
        return None
    if form != "hardened":
        box.cgroups = None
    if form == "earlier":
        box.cover = {"tmp": [], "hide": []}
    jobs = []
    for name, (_, tests, solution) in PROBLEMS.items():
        for t, raw in zip(parse_tests(tests, name), tests):
            if t.check is None:
                jobs.append(Job(solution, t.input.encode()))
            elif form == "earlier":  # the old harness: the assert runs inside, exit 0 passes
                jobs.append(Job(f"{solution}\n\n{raw['assert']}\n"))
            else:
                jobs.append(Job(solution, b"", t.check.probes))
    rates = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        res = box.run_many(jobs)
        rates.append(len(jobs) / (time.perf_counter() - t0))
        bad = [r for r in res if r.status != "ok"]
        assert not bad, bad[0]
    return statistics.median(rates)


def code_task_table(backends: list[str], workers: int, rounds: int) -> None:
    print("\n| built-in code task, reference solutions | backend | programs/s | ratio to earlier |")
    print("|---|---|---|---|")
    for backend in backends:
        rates = {form: code_task(backend, workers, form, rounds)
                 for form in ("earlier", "probes, no cgroup", "hardened")}
        for form, r in rates.items():
            print(f"| {form} | {backend} | {r:.1f} | {r / rates['earlier']:.2f} |")


HOSTILE = {"busy loop": "while True:\n    pass",
           "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n"
                        "    except OSError:\n        pass"}


def time_to_kill(backends: list[str], rounds: int) -> None:
    """Seconds from start to verdict of each hostile program, per backend (median)."""
    limit = 1.0
    print(f"\n| hostile program | backend | status | seconds to verdict (limit {limit:.0f} s) |")
    print("|---|---|---|---|")
    for backend in backends:
        box = Sandbox(SandboxSection(backend=backend, time_limit_s=limit, workers=1))
        for name, source in HOSTILE.items():
            res = [box.run_many([Job(source)])[0] for _ in range(rounds)]
            print(f"| {name} | {backend} | {res[0].status} | "
                  f"{statistics.median(r.wall_s for r in res):.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=100, help="programs per row and round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median kept)")
    ap.add_argument("--workers", type=int, default=0, help="parallel programs (0: per core)")
    args = ap.parse_args()
    workers = args.workers or os.cpu_count() or 1
    backends = []
    for backend in ("bwrap", "unshare", "rlimits"):
        got = sandboxed(backend, 4, workers)  # also warms the page cache
        if got:
            backends.append(backend)
            python = got[1]
    if not backends:
        python = sys.executable
    rows: dict[str, list[float]] = {}
    # rounds interleave the rows, so a noisy neighbour on a shared machine hits all of them
    for _ in range(args.rounds):
        rows.setdefault("plain `python -c`", []).append(plain(python, [], args.n, workers))
        rows.setdefault("plain `python -S -s -B -c`", []).append(
            plain(python, ["-S", "-s", "-B"], args.n, workers))
        for backend in backends:
            rows.setdefault(f"sandbox, {backend}", []).append(
                sandboxed(backend, args.n, workers)[0])
    rate = {k: statistics.median(v) for k, v in rows.items()}
    base = rate["plain `python -c`"]
    print(f"{args.n} programs per row and round, median of {args.rounds} interleaved rounds, "
          f"{workers} at a time, {os.cpu_count()} CPU cores, interpreter {python}\n")
    print("| how each program runs | programs/s | ratio to plain python |")
    print("|---|---|---|")
    for name, r in rate.items():
        print(f"| {name} | {r:.1f} | {r / base:.2f} |")
    code_task_table(backends, workers, args.rounds)
    time_to_kill(backends, args.rounds)


if __name__ == "__main__":
    main()
