"""The code reward: program extraction, test parsing, scoring, determinism, the batch
deadline, and counts by outcome through the RewardRunner's per-source metrics."""

import shutil

import pytest

from orbitrl.config import SandboxSection, load_config
from orbitrl.errors import OrbitError
from orbitrl.rewards import RewardRunner, RewardSource, get_reward
from orbitrl.rewards.code import CodeReward, extract_program, parse_tests
from orbitrl.rewards.sandbox import Job, Sandbox
from sandbox_util import BACKENDS, DEFAULT, LIMITS, sandbox

GCD_TESTS = [{"input": "12 18\n", "output": "6\n"}, {"input": "7 13\n", "output": "1\n"},
             {"input": "100 75\n", "output": "25\n"}]
GCD_OK = "import math\na, b = map(int, input().split())\nprint(math.gcd(a, b))\n"
GCD_WRONG = "input()\nprint(1)\n"  # right on one test of three


def _reward(backend=DEFAULT, **over):
    r = CodeReward(SandboxSection(backend=backend, **{**LIMITS, **over}))
    r._sandbox = sandbox(backend, **over)
    return r


@pytest.mark.parametrize("text,program", [
    ("Here:\n```python\nprint(1)\n```\nthen ```python\nprint(2)\n```", "print(1)\n"),
    ("```\nprint(3)\n```", "print(3)\n"),
    ("```py\nprint(4)\n", "print(4)\n"),  # truncated: no closing fence
    ("print(5)\n```\nexplanation", "print(5)\n"),  # the prompt opened the fence
    ("print(6)", "print(6)"),
    ("```text\nnot code\n```\n```python\nprint(7)\n```", "print(7)\n"),
    ("Code:\n```\nprint(8)\n```\nDone.", "print(8)\n"),
])
def test_extract_program(text, program):
    assert extract_program(text) == program


def test_extract_program_cuts_at_eos():
    assert extract_program("print(1)<eos>garbage", "<eos>") == "print(1)"


@pytest.mark.parametrize("value,needle", [
    ("not json", "not a JSON list"),
    ([], "non-empty list"),
    ({"input": "1"}, "non-empty list"),
    (["x"], "tests[0]: expected an object"),
    ([{"input": "1", "output": "2"}, {"input": "1"}], "tests[1]"),
    ([{"assert": ""}], "tests[0]"),
    ([{"input": 1, "output": "2"}], "tests[0]"),
    ([{"assert": "x = f(1)\nassert x == 2"}], "tests[0]: expected only assert"),
    ([{"assert": "assert 1 == 1"}], "does not call the program"),
    ([{"assert": "assert all(f(x) == 2 * x for x in range(3))"}], "one assert per input"),
    ([{"assert": "assert f(1) ==="}], "tests[0]: not valid Python"),
])
def test_malformed_tests_are_one_line_errors(value, needle):
    with pytest.raises(OrbitError) as e:
        parse_tests(value, "tests")
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_parse_tests_accepts_json_and_both_kinds():
    ts = parse_tests('[{"input": "1\\n", "output": "2"}, {"assert": "assert f() == 1"}]')
    assert (ts[0].input, ts[0].output, ts[1].check.source) == ("1\n", "2", "assert f() == 1")
    assert ts[1].check.probes == ("f()",)  # only the call enters the sandbox, not the 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_correct_passes_wrong_fails_partial_is_a_fraction(backend):
    r = _reward(backend)
    asserts = [{"assert": "assert add(2, 3) == 5"}, {"assert": "assert add(-1, 1) == 0"}]
    out = r.score_batch(
        ["p"] * 5,
        [f"```python\n{GCD_OK}```", GCD_WRONG, "def add(a, b):\n    return a + b\n",
         "def add(a, b):\n    return 5\n", "print(' 6')\n"],
        [{"tests": GCD_TESTS}, {"tests": GCD_TESTS}, {"tests": asserts}, {"tests": asserts},
         {"tests": [{"input": "", "output": "6"}]}])
    # leading spaces matter (the last one); trailing whitespace does not
    assert out.scores == [1.0, pytest.approx(1 / 3), 1.0, 0.5, 0.0]
    assert [d["status"] for d in out.details[1]] == ["wrong", "ok", "wrong"]
    assert out.metrics["tests"] == 11 and out.metrics["passed"] == 7
    assert out.metrics["pass_rate"] == pytest.approx(7 / 11)


def test_trailing_whitespace_is_ignored():
    out = _reward().score_batch(["p"], ["print('6   ')\nprint()\nprint()"],
                                [{"tests": [{"input": "", "output": "6\n"}]}])
    assert out.scores == [1.0]


def test_deterministic_for_deterministic_programs():
    r = _reward()
    progs = ["print(sorted({'b', 'a', 'c'}))", "print(set('abcdef'))", "print(hash('x'))",
             GCD_OK, GCD_WRONG, "import sys; sys.exit(3)"]
    fields = [{"tests": [{"input": "12 18\n", "output": "['a', 'b', 'c']\n"},
                         {"input": "7 13\n", "output": "1\n"}]}] * len(progs)
    a = r.score_batch(["p"] * len(progs), progs, fields)
    b = r.score_batch(["p"] * len(progs), progs, fields)
    assert a.scores == b.scores and a.details == b.details and a.metrics == b.metrics
    # hash seed is fixed: even set order and hash() repeat across runs
    box = sandbox(DEFAULT)
    outs = {box.run(Job("print(set('abcdefgh'), hash('x'))")).stdout for _ in range(3)}
    assert len(outs) == 1


def test_batch_deadline_kills_and_skips():
    """Programs running at the deadline are killed and those not started are never started;
    all score 0 with reason 'deadline' (a 60 s sleep under a 60 s time limit: without the
    deadline they would end as time limits, a minute later)."""
    box = sandbox(DEFAULT, time_limit_s=60.0, deadline_s=1.0)
    res = box.run_many([Job("import time\ntime.sleep(60)")] * 6)
    assert [x.status for x in res] == ["deadline"] * 6
    assert sum("not started" in x.reason for x in res) == 6 - box.workers
    r = _reward(DEFAULT, time_limit_s=60.0, deadline_s=1.0)
    out = r.score_batch(["p"] * 3, ["import time\ntime.sleep(60)"] * 3,
                        [{"tests": GCD_TESTS}] * 3)
    assert out.scores == [0.0] * 3 and out.metrics["deadline_kills"] == 9


def test_runner_reports_counts_by_outcome():
    """The code reward's counts reach the step metrics through the runner's per-source
    metrics (reward_code_*), alongside the per-sample sources."""
    runner = RewardRunner([RewardSource(_reward(), name="code"),
                           RewardSource(lambda p, c, **f: 1.0, name="one", weight=0.5)])
    progs = [GCD_OK, "while True: pass", "x = bytearray(20 * 2**30)", "import nope",
             "print('x' * 10**7)", GCD_WRONG]
    res = runner(["p"] * 6, progs, [{"tests": GCD_TESTS[:1]}] * 6)
    m = res.metrics
    assert res.per_source["code"] == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert res.rewards == [1.5, 0.5, 0.5, 0.5, 0.5, 0.5]
    assert (m["reward_code_passed"], m["reward_code_time_limits"], m["reward_code_memory_kills"],
            m["reward_code_runtime_errors"], m["reward_code_output_limits"],
            m["reward_code_wrong"], m["reward_code_sandbox_errors"]) == (1, 1, 1, 1, 1, 1, 0)
    assert m["reward_code_pass_rate"] == pytest.approx(1 / 6) and m["reward_code_errors"] == 0
    assert [d[0]["status"] for d in res.details["code"]] == [
        "ok", "time_limit", "memory", "runtime_error", "output_limit", "wrong"]


def test_sandbox_failure_is_an_error_not_a_zero():
    """When the sandbox itself fails (here: an interpreter path that does not exist inside),
    the sample is a counted error with the reason, not a silent 0."""
    r = _reward()
    box = r.sandbox
    broken = Sandbox.__new__(Sandbox)
    broken.__dict__.update(box.__dict__)
    broken.python = type(box.python)("/nonexistent/python3", (), ())
    r._sandbox = broken
    runner = RewardRunner([RewardSource(r, name="code")])
    res = runner(["p"], [GCD_OK], [{"tests": GCD_TESTS}])
    assert res.metrics["reward_code_errors"] == 1 and res.metrics["reward_code_sandbox_errors"] == 3
    assert res.errors[0].kind == "sandbox" and "sandbox failed" in res.errors[0].reason


def test_missing_or_bad_tests_field_is_a_row_error():
    runner = RewardRunner([RewardSource(_reward(), name="code")])
    res = runner(["p", "p", "p"], [GCD_OK] * 3,
                 [{}, {"tests": [{"inp": "1"}]}, {"answer": GCD_TESTS}])
    assert [e.index for e in res.errors] == [0, 1]
    assert "'tests'" in res.errors[0].reason and "tests[0]" in res.errors[1].reason
    assert res.per_source["code"][2] == 1.0  # tests in the answer field work too


def test_config_binds_the_reward_and_bad_values_fail():
    cfg = load_config(overrides=["reward.name=code", "reward.sandbox.time_limit_s=0.5",
                                 "reward.sandbox.backend=unshare"])
    try:
        fn = get_reward("code", cfg.reward)
    except OrbitError as e:
        pytest.skip(f"unshare unavailable here: {e}")
    assert fn.sandbox.cfg.time_limit_s == 0.5 and fn.sandbox.backend == "unshare"
    for bad, key in [("reward.sandbox.time_limit_s=-1", "time_limit_s"),
                     ("reward.sandbox.workers=-2", "workers"),
                     ("reward.sandbox.backend=docker", "backend"),
                     ("reward.sandbox.memory_mb=0", "memory_mb"),
                     ("reward.sandbox.uid_base=0", "uid_base")]:
        with pytest.raises(OrbitError, match=f"reward.sandbox.{key}"):
            load_config(overrides=[bad])


def test_missing_backend_is_a_clear_error(monkeypatch):
    import orbitrl.rewards.sandbox as S

    real = shutil.which
    monkeypatch.setattr(S.shutil, "which", lambda name: None if name == "bwrap" else real(name))
    with pytest.raises(OrbitError, match="reward.sandbox.backend.*bwrap not installed"):
        Sandbox(SandboxSection(backend="bwrap"))
    if shutil.which("unshare"):  # auto falls back to unshare when bwrap is missing
        try:
            assert Sandbox(SandboxSection(backend="auto")).backend == "unshare"
        except OrbitError as e:
            assert "unshare" in str(e)
    monkeypatch.setattr(S.shutil, "which", lambda name: None)
    with pytest.raises(OrbitError, match="install bubblewrap"):
        Sandbox(SandboxSection(backend="auto"))


def test_rlimits_backend_still_bounds_time_memory_output():
    """The explicit no-namespace backend: limits and uid only (no network isolation)."""
    box = sandbox("rlimits")
    res = box.run_many([Job("print(42)"), Job("while True: pass"),
                        Job("x = bytearray(20 * 2**30)"), Job("print('x' * 10**7)")])
    assert [x.status for x in res] == ["ok", "time_limit", "memory", "output_limit"]


def test_fallback_gaps_are_a_one_line_warning_once(capsys, monkeypatch):
    """Running on the unshare fallback names its gaps once per process, in one line each."""
    import orbitrl.rewards.sandbox as S

    monkeypatch.setattr(S, "_WARNED", set())
    box = sandbox("unshare")
    S._warn_once(box)
    S._warn_once(box)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == (1 if box.cgroups is not None else 2)
    assert all(x.startswith("orbitrl: warning:") and "docs/sandbox.md" in x for x in lines)
