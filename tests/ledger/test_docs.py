"""docs/planner.md's predict_peak example runs as written."""

import pathlib
import re

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "planner.md"


def test_predict_peak_example_runs():
    text = DOC.read_text()
    section = text.split("## The Python API the runtime calls", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    exec(compile(code, str(DOC), "exec"), scope)  # noqa: S102 - our own docs
    pred, metrics = scope["pred"], scope["metrics"]
    assert pred["train"] > 0 and pred["rollout"] > 0
    assert pred["terms"]["train"]["actor:weights"] > 0
    assert metrics["memory/train_predicted_bytes"] == pred["train"]


def test_measured_split_example_runs():
    text = DOC.read_text()
    section = text.split("### Proposing a split from measured rates", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    exec(compile(code, str(DOC), "exec"), scope)  # noqa: S102 - our own docs
    assert scope["measured_split"](4, 1000, 10.0, 100.0) == (2, 2)
