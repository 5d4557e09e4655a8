"""Tokenizer and chat template: a generic fast tokenizer's files read directly
(``file_tokenizer.FileTokenizer``), anything else through transformers' AutoTokenizer
(local files only)."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Callable

from orbitrl.errors import OrbitError, first_line
from orbitrl.model.file_tokenizer import open_file_tokenizer


GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _generic_class(path: Path) -> bool:
    """Whether the directory's tokenizer is a generic fast one over its own tokenizer.json."""
    conf = path / "tokenizer_config.json"
    if not (path / "tokenizer.json").is_file() or not conf.is_file():
        return False
    try:
        return json.loads(conf.read_text()).get("tokenizer_class") in GENERIC_CLASSES
    except (OSError, ValueError):
        return False  # AutoTokenizer reports a broken directory in its own words


def load_tokenizer(path: str | Path, vocab_size: int | None = None):
    """AutoTokenizer from a model directory; checks that every token id has an embedding row.

    Args:
        path: model directory holding tokenizer files.
        vocab_size: rows of the model's embedding; a tokenizer with more tokens is an error.
    """
    tok = open_file_tokenizer(Path(path), GENERIC_CLASSES)  # without importing transformers
    if tok is None:
        tok = _transformers_tokenizer(Path(path))
    if vocab_size is not None and len(tok) > vocab_size:
        raise OrbitError(f"{path}: tokenizer has {len(tok)} tokens but the model's embedding "
                         f"has only {vocab_size} rows (vocab_size in config.json)")
    return tok


def _transformers_tokenizer(path: Path):
    try:
        if _generic_class(path):
            # transformers 5 swaps a generic fast tokenizer for the model type's own class
            # (Qwen2Tokenizer for a qwen2 config), which rebuilds a byte-level BPE from the
            # vocabulary and drops every character outside it: tokenizer.json as written
            from transformers import PreTrainedTokenizerFast  # start-up: transformers ~1 s

            return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
        from transformers import AutoTokenizer  # start-up: transformers takes seconds

        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types for a bad directory
        raise OrbitError(f"{path}: cannot load a tokenizer ({first_line(e)})") from None


def save_tokenizer(tok, out: str | Path) -> None:
    """``tok.save_pretrained(out)``, with a generic fast tokenizer recorded under the class
    name transformers 4.x knows too (5.x writes ``TokenizersBackend``, which 4.x lacks; both
    read ``PreTrainedTokenizerFast`` over tokenizer.json as written, see load_tokenizer)."""
    tok.save_pretrained(str(out))
    conf = Path(out) / "tokenizer_config.json"
    if conf.is_file():
        c = json.loads(conf.read_text())
        if c.get("tokenizer_class") == "TokenizersBackend":
            c["tokenizer_class"] = "PreTrainedTokenizerFast"
            conf.write_text(json.dumps(c, indent=2) + "\n")


def prompt_encoder(tok, data) -> Callable[[str], list[int]]:
    """``text -> ids`` as a run's ``data`` section says: ``chat_template``, ``system_prompt``
    and ``enable_thinking`` (auto: the template's default; on / off: passed to the template
    as ``enable_thinking``, which Qwen3's reads and other templates ignore)."""
    system = getattr(data, "system_prompt", "")
    thinking = {"on": True, "off": False}.get(getattr(data, "enable_thinking", "auto"))
    return partial(encode_prompt, tok, chat_template=data.chat_template, system=system,
                   thinking=thinking)


def opens_thinking(tok, encode: Callable[[str], list[int]]) -> bool:
    """Whether prompts encoded by ``encode`` end inside an open ``<think>`` block (a chat
    template whose generation prompt opens it, as DeepSeek-R1's distilled models' do; Qwen3's
    with thinking switched off ends with an empty closed block instead)."""
    ids = encode("Hi")
    return tok.decode(ids[-8:]).rstrip().endswith("<think>")


def encode_prompt(tok, text: str, chat_template: bool = False, system: str = "",
                  thinking: bool | None = None) -> list[int]:
    """Token ids of one prompt: the raw text, or (``chat_template``) one user turn under the
    tokenizer's chat template followed by the assistant's generation prompt; ``system``
    (if any) as a system turn before it, ``thinking`` (if not None) as the template's
    ``enable_thinking`` variable.

    Every path that turns a prompt into ids (training, ``orbitrl eval``, ``orbitrl
    generate``) goes through here, so a model sees its prompts the same way in all of them.
    ``apply_chat_template(..., tokenize=True)`` returns a list on transformers 4.x and a
    BatchEncoding on 5.x; both are reduced to a flat list of ints here.
    """
    if not chat_template:
        return list(tok(text, add_special_tokens=False)["input_ids"])
    where = getattr(tok, "name_or_path", "") or type(tok).__name__
    if not getattr(tok, "chat_template", None):
        raise OrbitError(f"{where}: the tokenizer has no chat template (data.chat_template "
                         "needs chat_template.jinja or tokenizer_config.json's chat_template)")
    messages = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": text}]
    extra = {} if thinking is None else {"enable_thinking": thinking}
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
    if hasattr(out, "keys") and "input_ids" in out:  # BatchEncoding or dict (transformers 5)
        out = out["input_ids"]
    if hasattr(out, "tolist"):  # a tensor or array, if a tokenizer defaults to tensors
        out = out.tolist()
    if out and isinstance(out[0], (list, tuple)):  # a batch of one conversation
        out = out[0] if len(out) == 1 else out
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in out):
        raise OrbitError(f"{where}: apply_chat_template returned {type(out).__name__}, "
                         "not a list of token ids")
    return list(out)
