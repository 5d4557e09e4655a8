"""Where a model's files live: ``builtin:NAME`` -> the package's builtin/NAME directory, a
local directory as given, a Hugging Face Hub id (``org/name[@revision]``) -> its snapshot in
the local cache (model/hub.py)."""

from __future__ import annotations

import re
from pathlib import Path

from orbitrl.errors import OrbitError
from orbitrl.model.hub import parse_hub_id, resolve_hub_id

BUILTIN_DIR = Path(__file__).resolve().parents[1] / "builtin"


def is_hub_id(s: str) -> bool:
    """Whether a model path reads as a Hub id: ``org/name[@rev]`` that is not a directory
    here, not spelled as a path (``./``, ``/``, ``~``) and whose first part is no local
    folder (``runs/out``, ``checkpoints/final``: a missing directory, never a download)."""
    return not s.startswith(("builtin:", ".", "/", "~")) and parse_hub_id(s) is not None \
        and not Path(s).exists() and not Path(s.split("/", 1)[0]).exists()


def resolve_model_path(path: str | Path, revision: str | None = None) -> Path:
    """Model directory for a path, a ``builtin:NAME`` reference or a Hub id (``revision``
    applies to an id that names none); checks it exists. An existing directory wins over a
    Hub id of the same spelling."""
    s = str(path)
    if s.startswith("builtin:"):
        p = BUILTIN_DIR / s.split(":", 1)[1]
        if not p.is_dir():
            known = ", ".join(sorted(d.name for d in BUILTIN_DIR.iterdir() if d.is_dir()))
            raise OrbitError(f"model.path {s!r}: no such built-in model (have: {known})")
        return p
    p = Path(s).expanduser()
    if is_hub_id(s):
        try:
            return resolve_hub_id(s, revision)
        except OrbitError as e:  # name both readings: a missing directory, a Hub id
            raise OrbitError(f"{p}: no such model directory; as a Hub id, {e}") from None
    if not p.exists():
        raise OrbitError(f"{p}: model directory not found")
    if not p.is_dir():
        raise OrbitError(f"{p}: not a directory (a model is a directory with config.json)")
    return p


def pinned_revision(path: str, revision: str = "") -> str:
    """The commit a Hub id in ``path`` resolves to now (its snapshot's name), so a run's
    saved config and its resumes read the same weights whatever ``main`` becomes; the given
    ``revision`` for anything else (a directory, ``builtin:NAME``). Errors as
    :func:`resolve_model_path`."""
    s = str(path)
    if not is_hub_id(s):
        return revision
    snap = resolve_model_path(s, revision or None)
    return snap.name if re.fullmatch(r"[0-9a-f]{40}", snap.name) else revision
