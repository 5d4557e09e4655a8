"""Where the shipped models live: ``builtin:NAME`` -> the package's builtin/NAME directory."""

from __future__ import annotations

from pathlib import Path

from orbitrl.errors import OrbitError

BUILTIN_DIR = Path(__file__).resolve().parents[1] / "builtin"


def resolve_model_path(path: str | Path) -> Path:
    """Model directory for a path or a ``builtin:NAME`` reference; checks it exists."""
    s = str(path)
    if s.startswith("builtin:"):
        p = BUILTIN_DIR / s.split(":", 1)[1]
        if not p.is_dir():
            known = ", ".join(sorted(d.name for d in BUILTIN_DIR.iterdir() if d.is_dir()))
            raise OrbitError(f"model.path {s!r}: no such built-in model (have: {known})")
        return p
    p = Path(s).expanduser()
    if not p.exists():
        raise OrbitError(f"{p}: model directory not found")
    if not p.is_dir():
        raise OrbitError(f"{p}: not a directory (a model is a directory with config.json)")
    return p
