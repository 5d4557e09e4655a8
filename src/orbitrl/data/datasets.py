"""Prompt datasets: JSONL, Parquet or a local Hugging Face dataset directory, and the
built-in tasks. Bad rows are one-line errors naming the file and row."""

from __future__ import annotations

import json
from pathlib import Path

from orbitrl.data.arith import arith_rows
from orbitrl.data.code_tasks import code_rows
from orbitrl.data.tool_arith import tool_rows
from orbitrl.errors import OrbitError

# the reward each built-in task is scored with when none is given (orbitrl eval)
TASK_REWARDS = {"arith": "exact_match", "code": "code", "tool_arith": "exact_match"}
TASKS = tuple(TASK_REWARDS)


def task_rows(name: str, split: str, limit: int | None = None) -> list[dict]:
    """Rows of a built-in task's split (``sft``, ``rl``, ``heldout``): ``arith``
    (two-digit addition), ``code`` (small Python problems with tests) or ``tool_arith``
    (products with a calculator tool; multi-turn, see data/tool_arith.py)."""
    if name == "arith":
        return arith_rows(split, limit)
    if name == "code":
        return code_rows(split, limit)
    if name == "tool_arith":
        return tool_rows(split, limit)
    raise OrbitError(f"data.task {name!r}: no such built-in task (have: {', '.join(TASKS)})")


def load_rows(path: str | Path, required: list[str] = ()) -> list[dict]:
    """Rows from a .jsonl / .parquet file or a saved HF dataset directory; every row must
    hold the ``required`` fields."""
    p = Path(path)
    if not p.exists():
        raise OrbitError(f"{p}: data file not found")
    if p.is_dir():
        rows = _hf_dir(p)
    elif p.suffix == ".parquet":
        rows = _parquet(p)
    else:
        rows = _jsonl(p)
    if not rows:
        raise OrbitError(f"{p}: dataset is empty")
    for i, r in enumerate(rows):
        for f in required:
            if f not in r:
                raise OrbitError(f"{p}: row {i + 1} has no field {f!r} "
                                 f"(fields: {', '.join(map(str, r)) or 'none'})")
    return rows


def _jsonl(p: Path) -> list[dict]:
    return [row for _, row in jsonl_rows(p)]


def jsonl_rows(p: Path):
    """(line number, object) per non-blank line of a JSONL file; one-line errors name the
    file and the line."""
    with p.open() as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise OrbitError(f"{p}: line {n} is not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise OrbitError(f"{p}: line {n} is not a JSON object")
            yield n, row


def _parquet(p: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq  # optional: pyarrow, only for .parquet
    except ImportError:
        raise OrbitError(f"{p}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    return pq.read_table(p).to_pylist()


def _hf_dir(p: Path) -> list[dict]:
    try:
        from datasets import load_from_disk  # optional: datasets
    except ImportError:
        raise OrbitError(f"{p}: reading a dataset directory needs datasets "
                         "(pip install datasets)") from None
    ds = load_from_disk(str(p))
    if hasattr(ds, "keys"):  # DatasetDict: take 'train'
        ds = ds["train"] if "train" in ds else ds[list(ds.keys())[0]]
    return [dict(r) for r in ds]
