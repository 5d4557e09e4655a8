"""GSM8K-format data: parsing, errors, the math-verify scorer against hand-made
completions, and the task end to end on the built-in model."""

import json

import pytest

from orbitrl.cli import main
from orbitrl.data.gsm8k import final_answer, load_gsm8k
from orbitrl.errors import OrbitError

pytest.importorskip("math_verify")


def test_final_answer():
    assert final_answer("3 + 4 = 7\n#### 7") == "7"
    assert final_answer("#### 1,250") == "1250"
    assert final_answer("a #### 2 then #### -5 ") == "-5"
    assert final_answer("no marker") is None


@pytest.mark.parametrize("line, match", [
    ("not json", ":1: not valid JSON"),
    ('["a"]', ":1: not a JSON object"),
    ('{"question": "q"}', ":1: field 'answer'"),
    ('{"question": "q", "answer": "7"}', ":1: field 'answer' has no final '#### N'"),
])
def test_bad_rows_are_one_line_errors_naming_file_and_line(tmp_path, line, match):
    p = tmp_path / "m.jsonl"
    p.write_text(line + "\n")
    with pytest.raises(OrbitError, match=match) as e:
        load_gsm8k(p)
    assert str(e.value).startswith(str(p)) and "\n" not in str(e.value)


def test_the_scorer_on_hand_made_completions():
    from orbitrl.evals.tasks import gsm8k_task

    task = gsm8k_task()
    ids = [r["id"] for r in task.rows]
    assert len(ids) == 18 and task.rows[0]["prompt"].startswith("Question: ")
    cases = [(0, " 14 + 9 = 23. The answer is 23.", True),
             (0, " The answer is 24.", False),
             (13, " 1250 + 750 = 2000", True),        # gold '2,000' -> 2000
             (15, " It fell to \\boxed{-5}", True),
             (15, " 5", False),
             (16, " 150.0 kilometers", True),
             (1, "", False)]
    v = task.score([c[0] for c in cases], [c[1] for c in cases], lambda n: None)
    assert [x.passed for x in v] == [c[2] for c in cases]


def test_gsm8k_end_to_end_on_the_builtin_model(tmp_path, capsys):
    out = tmp_path / "g.json"
    assert main(["eval", "--task", "gsm8k", "--n", "2", "--k", "1,2", "--max-tokens", "8",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["task"] == "gsm8k" and res["problems"] == 18 and len(res["rows"]) == 18
    assert res["truncated_prompts"] == 18  # a 64-token model: questions cut from the left
    g = res["greedy"]
    assert g["pass@1"] == g["passed"] / 18
    for row in res["rows"]:
        assert row["samples"]["n"] == 2 and len(row["samples"]["completions"]) == 2
        assert row["samples"]["pass@1"] == row["samples"]["correct"] / 2
    assert "gsm8k: 18 problems; pass@1 (greedy)" in capsys.readouterr().out


def test_cli_errors_exit_2_with_one_line(tmp_path, capsys):
    assert main(["eval", "--task", "gsm8k", "--n", "2", "--k", "5"]) == 2
    assert "--k 5: each k must be in [1, n]" in capsys.readouterr().err
    assert main(["eval", "--task", f"gsm8k:{tmp_path}/missing.jsonl"]) == 2
    assert "missing.jsonl: GSM8K-format file not found" in capsys.readouterr().err
