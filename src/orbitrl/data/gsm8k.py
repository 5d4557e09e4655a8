"""GSM8K-format math data: JSONL rows ``{"question": str, "answer": str}`` whose answer ends
with ``#### N`` (the worked solution before it is ignored). The gold answer is N with
thousands separators removed. Bad rows are one-line errors naming the file and line."""

from __future__ import annotations

import json
import re
from pathlib import Path

from orbitrl.errors import OrbitError

_FINAL = re.compile(r"####\s*(.+?)\s*$", re.S)


def final_answer(answer: str) -> str | None:
    """The text after the last ``####`` ("1,234" -> "1234"), or None without one."""
    at = answer.rfind("####")
    if at < 0:
        return None
    m = _FINAL.match(answer[at:])
    return m.group(1).replace(",", "") if m else None


def load_gsm8k(path: str | Path) -> list[dict]:
    """Rows ``{"id", "question", "answer"}`` (answer: the final number as text).

    Raises:
        OrbitError: a missing file, a line that is not a JSON object, a missing field, or an
            answer without ``#### N``, each naming the file and line.
    """
    p = Path(path)
    if not p.is_file():
        raise OrbitError(f"{p}: GSM8K-format file not found")
    rows = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise OrbitError(f"{p}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise OrbitError(f"{p}:{n}: not a JSON object")
        for key in ("question", "answer"):
            if not isinstance(row.get(key), str) or not row[key].strip():
                raise OrbitError(f"{p}:{n}: field {key!r} missing or not a non-empty string")
        gold = final_answer(row["answer"])
        if not gold:
            raise OrbitError(f"{p}:{n}: field 'answer' has no final '#### N'")
        rows.append({"id": f"{p.name}:{n}", "question": row["question"], "answer": gold})
    if not rows:
        raise OrbitError(f"{p}: no rows")
    return rows
