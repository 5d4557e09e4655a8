"""benchmarks/bench_engine.py's turn-taking (``interleaved``): each system's process loads
once, then the systems' timed runs go round by round, one process at a time; a system that
fails is reported and the others go on."""

import importlib
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_systems_take_turns_one_process_at_a_time(tmp_path, monkeypatch, capsys):
    # a job the spawned processes can import: it logs each run's start and end
    (tmp_path / "turn_job.py").write_text(textwrap.dedent('''
        import os, time

        def job(name, log, fail=False, repeat=1, gate=None):
            runs = []
            for i in range(repeat):
                gate()
                t0 = time.time()
                if fail and i == 1:
                    raise ValueError("second run")
                time.sleep(0.15)
                with open(log, "a") as f:
                    f.write(f"{name} {i} {t0} {time.time()} {os.getpid()}\\n")
                runs.append(time.time() - t0)
            return dict(runs=runs, seconds=min(runs))
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # the spawned processes import both
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    turn_job = importlib.import_module("turn_job")
    b = importlib.import_module("bench_engine")
    log = tmp_path / "log.txt"
    res = b.interleaved([("a", turn_job.job, ("a", str(log)), {}),
                         ("b", turn_job.job, ("b", str(log)), dict(fail=True)),
                         ("c", turn_job.job, ("c", str(log)), {})], repeat=3)
    rows = [line.split() for line in log.read_text().splitlines()]
    assert [(r[0], int(r[1])) for r in rows] == [
        ("a", 0), ("b", 0), ("c", 0), ("a", 1), ("c", 1), ("a", 2), ("c", 2)]
    spans = [(float(r[2]), float(r[3])) for r in rows]
    assert all(e0 <= s1 for (_, e0), (s1, _) in zip(spans, spans[1:]))  # never two at once
    assert len({r[4] for r in rows if r[0] == "a"}) == 1  # one process per system
    assert list(res) == ["a", "b", "c"]
    assert len(res["a"]["runs"]) == 3 and len(res["c"]["runs"]) == 3
    assert res["b"] == dict(error="ValueError: second run")
    out = capsys.readouterr().out
    assert "run 3/3 c:" in out and "run 2/3 b:" in out and "run 3/3 b:" not in out
