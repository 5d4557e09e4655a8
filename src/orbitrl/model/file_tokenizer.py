"""A model directory's ``tokenizer.json`` and chat template, read without transformers.

Why: importing transformers to build its generic fast tokenizer costs about a second of
every command's start (its package index scans every model family), the largest fixed cost
of ``orbitrl generate`` after torch itself. The ``tokenizers`` library (transformers' own
backend) and jinja2 load the same files in about 0.15 s.

:class:`FileTokenizer` is used only where it gives transformers' answers (see
:func:`open_file_tokenizer`): a generic fast tokenizer (``PreTrainedTokenizerFast`` /
``TokenizersBackend``) over its ``tokenizer.json`` as written, with none of the
``tokenizer_config.json`` keys that make transformers change the backend or its output
(``add_bos_token``, ``clean_up_tokenization_spaces``, special tokens missing from the
vocabulary, ...). It implements what orbitrl calls (encoding, decoding, the special tokens,
``apply_chat_template`` for one conversation, optionally with tools; ``save_pretrained``
copies the files) the way transformers does; any other attribute, and any call with options it does not implement, goes to
transformers' tokenizer for the same directory, built on first use. tests/model/
test_file_tokenizer.py checks both against transformers on the built-in and real models.
"""

from __future__ import annotations

import json
import shutil
from datetime import datetime
from pathlib import Path

SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
           "mask_token")
# config keys after which transformers' tokenizer is not tokenizer.json as written
CHANGES_BACKEND = ("add_bos_token", "add_eos_token", "add_prefix_space",
                   "split_special_tokens", "legacy", "post_processor", "tokenizer_file",
                   "vocab_file", "merges_file", "extra_special_tokens",
                   "additional_special_tokens", "fix_mistral_regex", "auto_map")
LARGE_VOCAB = 100_000  # above it transformers may patch the pre-tokenizer's regex


def _token(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _config(path: Path) -> dict:
    conf = json.loads((path / "tokenizer_config.json").read_text())
    extra = path / "special_tokens_map.json"
    if extra.is_file():  # older directories keep the named tokens here
        for k, v in json.loads(extra.read_text()).items():
            conf.setdefault(k, v)
    return conf


def _chat_template(path: Path, conf: dict) -> str | None:
    f = path / "chat_template.jinja"
    if f.is_file():
        return f.read_text()
    t = conf.get("chat_template")
    if isinstance(t, list):  # named templates: transformers' default is "default"
        t = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}.get("default")
    return t if isinstance(t, str) else None


def open_file_tokenizer(path: Path, generic_classes: tuple[str, ...]):
    """``path``'s tokenizer as a :class:`FileTokenizer` where transformers would load it as
    ``tokenizer.json`` as written with named special tokens the file already holds; else
    None (transformers loads it, and reports a broken directory in its own words). The
    config is read and the file parsed once, by the ``tokenizers`` library."""
    from tokenizers import Tokenizer  # what transformers' fast tokenizers wrap

    try:
        conf = _config(path)
        if conf.get("tokenizer_class") not in generic_classes or \
                any(k in conf for k in CHANGES_BACKEND) or \
                conf.get("clean_up_tokenization_spaces"):
            return None
        tk = Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception:  # (unreadable, invalid JSON, a file tokenizers refuses)
        return None
    if tk.truncation or tk.padding or tk.post_processor is None or \
            type(tk.model).__name__ not in ("BPE", "WordLevel", "WordPiece") or \
            tk.get_vocab_size(with_added_tokens=True) > LARGE_VOCAB:
        return None
    added = {t.content: t.special for t in tk.get_added_tokens_decoder().values()}
    for key in SPECIAL:
        tok = _token(conf.get(key))
        if conf.get(key) is not None and tok is None:
            return None
        if tok is not None and added.get(tok) is not True:
            return None  # transformers adds (or re-flags) a named token that is not special
    decoder = conf.get("added_tokens_decoder") or {}  # re-added by transformers if it differs
    if not all(isinstance(v, dict) and added.get(v.get("content")) is bool(v.get("special"))
               for v in decoder.values()):
        return None
    return FileTokenizer(path, tk, conf)


class FileTokenizer:
    """``tokenizer.json`` + ``tokenizer_config.json`` + the chat template, as transformers'
    generic fast tokenizer reads them (only for directories :func:`open_file_tokenizer`
    takes)."""

    is_fast = True

    def __init__(self, path: Path, tk, conf: dict):
        """(Made by :func:`open_file_tokenizer`: ``tk`` the parsed file, ``conf`` the
        directory's tokenizer_config.json and special_tokens_map.json.)"""
        self.name_or_path = str(path)
        self._tk = tk
        self._special = {k: _token(conf.get(k)) for k in SPECIAL if _token(conf.get(k))}
        self.chat_template = _chat_template(path, conf)
        self._template = None  # compiled on first use
        self._hf_tok = None

    # transformers' tokenizer for whatever is not implemented here
    def _hf(self):
        if self._hf_tok is None:
            from transformers import PreTrainedTokenizerFast  # start-up: only when needed

            self._hf_tok = PreTrainedTokenizerFast.from_pretrained(self.name_or_path,
                                                                   local_files_only=True)
        return self._hf_tok

    def __getattr__(self, name: str):
        if name.startswith("_"):  # never for the instance's own state (pickling, copies)
            raise AttributeError(name)
        return getattr(self._hf(), name)

    def __len__(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=False)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return dict(self._special)

    def _special_id(self, key: str) -> int | None:
        tok = self._special.get(key)
        return None if tok is None else self._tk.token_to_id(tok)

    bos_token = property(lambda self: self._special.get("bos_token"))
    eos_token = property(lambda self: self._special.get("eos_token"))
    pad_token = property(lambda self: self._special.get("pad_token"))
    unk_token = property(lambda self: self._special.get("unk_token"))
    bos_token_id = property(lambda self: self._special_id("bos_token"))
    eos_token_id = property(lambda self: self._special_id("eos_token"))
    pad_token_id = property(lambda self: self._special_id("pad_token"))
    unk_token_id = property(lambda self: self._special_id("unk_token"))

    @property
    def all_special_ids(self) -> list[int]:
        ids = (self._tk.token_to_id(t) for t in self._special.values())
        return list(dict.fromkeys(i for i in ids if i is not None))  # transformers' order

    def get_vocab(self) -> dict[str, int]:
        return self._tk.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            got = self._tk.token_to_id(tokens)
            return self._special_id("unk_token") if got is None else got
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self._tk.id_to_token(ids)
        return [self._tk.id_to_token(int(i)) for i in ids]

    # encoding and decoding
    def encode(self, text: str, *args, add_special_tokens: bool = True, **kwargs) -> list[int]:
        if args or kwargs or not isinstance(text, str):  # pairs, options: transformers
            return self._hf().encode(text, *args, add_special_tokens=add_special_tokens,
                                     **kwargs)
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text, *args, add_special_tokens: bool = True, **kwargs):
        if args or kwargs or not (isinstance(text, str) or (
                isinstance(text, list) and all(isinstance(t, str) for t in text))):
            return self._hf()(text, *args, add_special_tokens=add_special_tokens, **kwargs)
        if isinstance(text, str):
            ids = self._tk.encode(text, add_special_tokens=add_special_tokens).ids
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}
        encs = self._tk.encode_batch(text, add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in encs],
                "attention_mask": [[1] * len(e.ids) for e in encs]}

    def decode(self, ids, skip_special_tokens: bool = False, **kwargs) -> str:
        if kwargs:
            return self._hf().decode(ids, skip_special_tokens=skip_special_tokens, **kwargs)
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, seqs, skip_special_tokens: bool = False, **kwargs) -> list[str]:
        if hasattr(seqs, "tolist"):
            seqs = seqs.tolist()
        return [self.decode(s, skip_special_tokens=skip_special_tokens, **kwargs) for s in seqs]

    # chat template
    def _compiled(self):
        if self._template is None:
            self._template = compile_template(self.chat_template)
        return self._template

    def apply_chat_template(self, conversation, *args, tools=None,
                            add_generation_prompt=False, tokenize=True, return_dict=True,
                            **kwargs):
        """One conversation (a list of role/content dicts) under the chat template, as
        transformers renders it: the rendered text, or (``tokenize``) ``{"input_ids",
        "attention_mask"}`` (``return_dict=False``: the list of ids), encoded without
        special tokens beyond the template's own. Batches and the options of
        transformers' method not named here go to transformers."""
        plain = (not args and self.chat_template is not None and type(conversation) is list
                 and all(type(m) is dict for m in conversation)
                 and plain_data([conversation, tools, kwargs])
                 and (tools is None or all(type(t) is dict for t in tools))
                 and not any(k in kwargs for k in HF_ONLY_OPTIONS))
        if not plain:
            return self._hf().apply_chat_template(
                conversation, *args, tools=tools, add_generation_prompt=add_generation_prompt,
                tokenize=tokenize, return_dict=return_dict, **kwargs)
        text = self._compiled().render(
            messages=alias_reasoning(conversation), tools=tools, documents=None,
            add_generation_prompt=add_generation_prompt, **self.special_tokens_map, **kwargs)
        if not tokenize:
            return text
        ids = self._tk.encode(text, add_special_tokens=False).ids
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids

    def __getstate__(self):  # the compiled template does not pickle; it is made again
        return {**self.__dict__, "_template": None}

    def __setstate__(self, state):
        self.__dict__.update(state)

    def save_pretrained(self, out, **kwargs):
        """The directory's tokenizer files copied as they are (what transformers' loader
        reads back as this same tokenizer); with options, transformers' own method."""
        if kwargs:
            return self._hf().save_pretrained(out, **kwargs)
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for name in TOKENIZER_FILES:
            src = Path(self.name_or_path) / name
            if src.is_file():
                if not (out / name).exists() or not (out / name).samefile(src):
                    shutil.copyfile(src, out / name)
                written.append(str(out / name))
        return tuple(written)

    def __repr__(self) -> str:
        return f"FileTokenizer({self.name_or_path!r}, {len(self)} tokens)"


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
# apply_chat_template options that only transformers' method implements
HF_ONLY_OPTIONS = ("documents", "continue_final_message", "return_assistant_tokens_mask",
                   "chat_template", "padding", "truncation", "max_length", "return_tensors",
                   "tokenizer_kwargs")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def alias_reasoning(chat: list) -> list:
    """A message's reasoning under every name templates read (as transformers does)."""
    out = []
    for m in chat:
        r = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        out.append(m if r is None else {"thinking": r, **m, "reasoning_content": r})
    return out


def plain_data(value) -> bool:
    """Whether ``value`` is plain JSON data (exact str, int, float, bool, None, and lists,
    tuples and str-keyed dicts of them): what a template may see as it is. transformers
    rebuilds anything else (enum members, numpy scalars, media) first; such input goes to
    it."""
    if value is None or type(value) in (str, int, float, bool):
        return True
    if type(value) is dict:
        return all(type(k) is str and plain_data(v) for k, v in value.items())
    if type(value) in (list, tuple):
        return all(plain_data(v) for v in value)
    return False


def compile_template(source: str):
    """The chat template in transformers' sandboxed jinja environment: blocks trimmed,
    ``loopcontrols``, and its ``tojson``, ``raise_exception``, ``strftime_now``,
    ``dict`` and ``namespace``."""
    import jinja2  # start-up: only when a chat template is rendered
    from jinja2.ext import Extension, loopcontrols  # start-up, as above
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # start-up, as above

    class Generation(Extension):  # {% generation %} blocks render their body
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body) \
                .set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes ({name!r})")

    class Dict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=Dict(), namespace=Namespace)
    return env.from_string(source)
