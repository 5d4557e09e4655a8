"""Tokenizer and chat template through transformers' AutoTokenizer (local files only)."""

from __future__ import annotations

from pathlib import Path

from orbitrl.errors import OrbitError


def load_tokenizer(path: str | Path, vocab_size: int | None = None):
    """AutoTokenizer from a model directory; checks that every token id has an embedding row.

    Args:
        path: model directory holding tokenizer files.
        vocab_size: rows of the model's embedding; a tokenizer with more tokens is an error.
    """
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types for a bad directory
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OrbitError(f"{path}: cannot load a tokenizer ({msg})") from None
    if vocab_size is not None and len(tok) > vocab_size:
        raise OrbitError(f"{path}: tokenizer has {len(tok)} tokens but the model's embedding "
                         f"has only {vocab_size} rows (vocab_size in config.json)")
    return tok
