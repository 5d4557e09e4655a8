"""The built-in code task: enough problems, disjoint splits, well-formed tests, and every
reference solution passes its own tests in the sandbox (so the tests are passable)."""

import pytest

from orbitrl.data.code_tasks import PROBLEMS, SHORT, code_rows
from orbitrl.data.datasets import task_rows
from orbitrl.errors import OrbitError
from orbitrl.rewards import RewardRunner
from orbitrl.rewards.code import parse_tests
from orbitrl.rl.evaluate import reward_fields


def test_size_and_splits():
    assert len(PROBLEMS) >= 30
    held, rl = code_rows("heldout"), code_rows("rl")
    names = [r["name"] for r in held], [r["name"] for r in rl]
    assert not set(names[0]) & set(names[1])
    assert len(held) + len(rl) == len(PROBLEMS)
    assert code_rows("rl") == rl  # fixed order
    assert task_rows("code", "heldout", 3) == held[:3]
    with pytest.raises(OrbitError, match="data.task 'nope'"):
        task_rows("nope", "rl")
    assert set(PROBLEMS) == set(SHORT)
    assert all(len(v) <= 40 for v in SHORT.values())  # fits the built-in 64-token model
    kinds = {("assert" in t) for r in held + rl for t in r["tests"]}
    assert kinds == {True, False}  # both stdin/stdout and assert-style problems


def test_every_reference_solution_passes_and_a_wrong_one_fails():
    from orbitrl.config import SandboxSection
    from orbitrl.rewards.sandbox import Sandbox

    try:  # the runner starts its sandbox on first use: probe one here
        Sandbox(SandboxSection())
    except OrbitError as e:
        pytest.skip(f"no sandbox here: {e}")
    runner = RewardRunner(["code"])
    rows = code_rows("heldout") + code_rows("rl")
    for r in rows:
        parse_tests(r["tests"], r["name"])
        assert r["prompt"].endswith("```python\n")
    fields = [reward_fields(r, "prompt", "answer") for r in rows]
    res = runner([r["prompt"] for r in rows], [r["answer"] for r in rows], fields)
    failed = [r["name"] for r, s in zip(rows, res.per_source["code"]) if s != 1.0]
    assert not failed and not res.errors, (failed, res.errors)
    wrong = runner([rows[0]["prompt"]], ["print('nope')\n```"], fields[:1])
    assert wrong.rewards == [0.0] and not wrong.errors
