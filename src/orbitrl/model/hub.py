"""Hugging Face Hub ids as model paths: ``org/name`` or ``org/name@revision``.

An id resolves to a snapshot directory of the local Hugging Face cache without touching the
network; when the cache lacks it and the network is allowed (``HF_HUB_OFFLINE`` unset), the
files a model needs are downloaded into that cache through ``huggingface_hub``. The cache is
``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``, read at each call
(so a test, or a user, may point it elsewhere after start-up).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from orbitrl.errors import OrbitError, first_line

# org/name with Hub characters, an optional @revision (branch, tag or commit)
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[\w./-]+))?$")
# what loading, training and export read from a model repository
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken",
               "merges.txt", "vocab.txt"]


def parse_hub_id(s: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision or None)`` if ``s`` reads as a Hub id, else None."""
    m = HUB_ID.match(s)
    return (m["repo"], m["rev"]) if m else None


def cache_dir() -> Path:
    """The Hugging Face hub cache, as huggingface_hub would pick it, read now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_hub_id(s: str, revision: str | None = None) -> Path:
    """The snapshot directory of Hub id ``s`` (``org/name[@rev]``; ``revision`` if the id
    names none): from the cache, else downloaded when the network is allowed; a one-line
    error naming the id when neither works."""
    repo, rev = parse_hub_id(s) or (s, None)
    rev = rev or revision or None
    from huggingface_hub import snapshot_download  # optional: only Hub ids need it

    cache = cache_dir()
    try:
        # the same patterns as a download, so a snapshot this module fetched (which lacks
        # the repository's README and the like) reads as complete
        got = Path(snapshot_download(repo, revision=rev, cache_dir=str(cache),
                                     local_files_only=True, allow_patterns=MODEL_FILES))
        if (got / "config.json").is_file():
            return got
        cached_err = f"the cached snapshot {got} has no config.json"
    except Exception as e:  # huggingface_hub raises several types for a cache miss
        cached_err = first_line(e)
    where = f"{repo}" + (f"@{rev}" if rev else "")
    if offline():
        raise OrbitError(f"model {where!r}: not in the Hugging Face cache {cache} and "
                         f"HF_HUB_OFFLINE is set ({cached_err})")
    try:
        return Path(snapshot_download(repo, revision=rev, cache_dir=str(cache),
                                      allow_patterns=MODEL_FILES))
    except Exception as e:  # network, authentication, a missing repository or revision
        raise OrbitError(f"model {where!r}: not in the Hugging Face cache {cache} and could "
                         f"not be downloaded ({first_line(e)})") from None
