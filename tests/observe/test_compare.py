"""`orbitrl report RUN_A RUN_B --out DIR`: several runs' curves on one plot."""

import json

import pytest

from orbitrl.cli import main


def _run(d, rewards, summary):
    d.mkdir()
    rows = [{"step": i, "reward_mean": r, "kl": 0.01 * i, "time_step_s": 0.5}
            for i, r in enumerate(rewards)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "summary.json").write_text(json.dumps(summary))


def _is_png(p):
    return p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("x", ["step", "time"])
def test_overlay_of_two_runs(tmp_path, x, capsys):
    _run(tmp_path / "one_process", [0.1, 0.3, 0.6], {"heldout_after": 0.9})
    _run(tmp_path / "two_ranks", [0.1, 0.2, 0.5, 0.7], {"heldout_after": 0.8})
    out = tmp_path / "cmp"
    assert main(["report", str(tmp_path / "one_process"), str(tmp_path / "two_ranks"),
                 "--out", str(out), "--labels", "1 process,2 ranks", "--x", x]) == 0
    assert _is_png(out / "compare_reward_mean.png") and _is_png(out / "compare_kl.png")
    assert not (out / "compare_entropy.png").exists()  # no run logged it
    page = (out / "compare.html").read_text()
    assert "1 process" in page and "2 ranks" in page and "heldout_after" in page
    assert "0.9" in page and "0.8" in page
    assert "compare.html" in capsys.readouterr().out


def test_overlay_errors_are_one_line(tmp_path, capsys):
    _run(tmp_path / "a", [0.1], {})
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "missing"),
                 "--out", str(tmp_path / "o")]) == 2
    assert "missing: not a run directory" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "a")]) == 2
    assert "give --out DIR" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "a"), "--out",
                 str(tmp_path / "o"), "--labels", "x"]) == 2
    assert "1 labels for 2 runs" in capsys.readouterr().err
