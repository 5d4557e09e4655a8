"""``FileTokenizer`` (tokenizer.json and the chat template read without transformers) gives
transformers' answers, and directories whose tokenizer transformers changes go to
transformers."""

import json
import pickle
import subprocess
import sys

import pytest

from orbitrl.model.builtin import resolve_model_path
from orbitrl.model.file_tokenizer import FileTokenizer
from orbitrl.model.tokenizer import encode_prompt, load_tokenizer

CHATML = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if tools %}{{ '<|im_start|>tools\\n' + (tools | tojson) + '<|im_end|>\\n' }}{% endif %}"
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.n = ns.n + 1 %}{% endif %}{% if loop.index > 50 %}{% break %}{% endif %}"
    "{% endfor %}{% if ns.n > 9 %}{{ raise_exception('too many turns') }}{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}")
TEXTS = ["What is 12+34? Answer with the number only.", "héllo  wörld\n\n\ttabs 日本語 🙂",
         "", " 1  2 3 ", "<|im_start|>user\nhi<|im_end|>", "x" * 300]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+3?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "hello", "reasoning_content": "greet back"},
     {"role": "user", "content": "2+2? 🙂"}],
]


def chatml_dir(d, **config):
    """A byte-level BPE tokenizer (as SmolLM2's and Llama 3's are) trained here on a few
    lines, with ChatML special tokens and ``CHATML`` as its template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tk.train_from_iterator(TEXTS * 4 + ["the quick brown fox jumps over the lazy dog"] * 4,
                           trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                               initial_alphabet=pre_tokenizers.ByteLevel
                                               .alphabet()))
    d.mkdir(parents=True)
    tk.save(str(d / "tokenizer.json"))
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
            "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
            "unk_token": "<|endoftext|>", "model_max_length": 2048, **config}
    (d / "tokenizer_config.json").write_text(json.dumps(conf))
    (d / "chat_template.jinja").write_text(CHATML)
    return d


def reference(d):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(d), local_files_only=True)


@pytest.fixture(scope="module", params=["chatml", "builtin"])
def pair(request, tmp_path_factory):
    d = (chatml_dir(tmp_path_factory.mktemp("tok") / "chatml") if request.param == "chatml"
         else resolve_model_path("builtin:tiny-arith"))
    tok = load_tokenizer(d)
    assert isinstance(tok, FileTokenizer)
    return tok, reference(d)


def test_encoding_decoding_and_special_tokens_match_transformers(pair):
    tok, ref = pair
    for text in TEXTS:
        for special in (True, False):
            assert tok(text, add_special_tokens=special)["input_ids"] == \
                ref(text, add_special_tokens=special)["input_ids"]
            assert tok.encode(text, add_special_tokens=special) == \
                ref.encode(text, add_special_tokens=special)
        ids = ref(text)["input_ids"] + [ref.eos_token_id]
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == \
                ref.decode(ids, skip_special_tokens=skip)
    assert tok(TEXTS)["input_ids"] == ref(TEXTS)["input_ids"]
    assert len(tok) == len(ref) and tok.vocab_size == ref.vocab_size
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(tok, name) == getattr(ref, name)
        assert getattr(tok, name + "_id") == getattr(ref, name + "_id")
    assert tok.special_tokens_map == ref.special_tokens_map
    assert tok.all_special_ids == ref.all_special_ids
    assert tok.convert_ids_to_tokens([3, 4]) == ref.convert_ids_to_tokens([3, 4])
    assert tok._hf_tok is None  # none of it needed transformers


def test_chat_template_matches_transformers(pair):
    tok, ref = pair
    if "im_start" not in tok.chat_template:
        pytest.skip("the built-in template only joins the contents")
    tools = [{"type": "function", "function": {"name": "calc", "description": "ünïcode",
                                               "parameters": {"type": "object"}}}]
    for conv in CONVERSATIONS:
        for gen in (True, False):
            for extra in ({}, {"tools": tools}, {"enable_thinking": False}):
                text = tok.apply_chat_template(conv, add_generation_prompt=gen,
                                               tokenize=False, **extra)
                assert text == ref.apply_chat_template(conv, add_generation_prompt=gen,
                                                       tokenize=False, **extra)
                assert tok.apply_chat_template(conv, add_generation_prompt=gen, **extra)[
                    "input_ids"] == ref.apply_chat_template(
                        conv, add_generation_prompt=gen, **extra)["input_ids"]
    assert encode_prompt(tok, "2+2?", chat_template=True, system="s", thinking=False) == \
        encode_prompt(ref, "2+2?", chat_template=True, system="s", thinking=False)
    with pytest.raises(Exception, match="too many turns"):
        tok.apply_chat_template([{"role": "user", "content": "x"}] * 10, tokenize=False)
    assert tok._hf_tok is None


def test_what_it_does_not_implement_goes_to_transformers(pair):
    tok, ref = pair
    assert tok.model_max_length == ref.model_max_length  # an attribute it lacks
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "1 2"}]
    if "im_start" in tok.chat_template:  # an option it lacks
        assert tok.apply_chat_template(conv, continue_final_message=True, tokenize=False) \
            == ref.apply_chat_template(conv, continue_final_message=True, tokenize=False)
    got = tok("1 2", return_tensors="pt")["input_ids"]  # so is a tensor
    assert got.tolist() == ref("1 2", return_tensors="pt")["input_ids"].tolist()
    copy = pickle.loads(pickle.dumps(tok))
    assert copy("12+34")["input_ids"] == tok("12+34")["input_ids"]


@pytest.mark.parametrize("config", [{"add_bos_token": True},
                                    {"clean_up_tokenization_spaces": True},
                                    {"sep_token": "<sep>"},  # not in the vocabulary
                                    {"tokenizer_class": "Qwen2Tokenizer"}])
def test_directories_transformers_would_change_go_to_transformers(tmp_path, config):
    d = chatml_dir(tmp_path / "t", **config)
    tok = load_tokenizer(d)
    assert not isinstance(tok, FileTokenizer)


def test_loading_and_saving_the_builtin_tokenizer_does_not_import_transformers(tmp_path):
    code = ("import sys, orbitrl; from orbitrl.model.tokenizer import save_tokenizer; "
            "tok = orbitrl.load_tokenizer(sys.argv[1]); "
            "tok.apply_chat_template([{'role': 'user', 'content': '1+2'}]); "
            "save_tokenizer(tok, sys.argv[2]); "
            "print(type(tok).__name__, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code,
                          str(resolve_model_path("builtin:tiny-arith")), str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["FileTokenizer", "False"]


def test_saved_files_load_back_as_the_same_tokenizer(pair, tmp_path):
    """``save_pretrained`` copies the tokenizer's files as they are: transformers and orbitrl
    read the copy back as the same tokenizer."""
    from pathlib import Path

    from orbitrl.model.tokenizer import save_tokenizer

    tok, ref = pair
    save_tokenizer(tok, tmp_path / "out")
    src = Path(tok.name_or_path)
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (tmp_path / "out" / name).read_bytes() == (src / name).read_bytes()
    again, hf = load_tokenizer(tmp_path / "out"), reference(tmp_path / "out")
    assert isinstance(again, FileTokenizer)
    conv = CONVERSATIONS[1]
    for t in (again, hf):
        assert t(TEXTS[1])["input_ids"] == ref(TEXTS[1])["input_ids"]
        assert t.apply_chat_template(conv, tokenize=False) == \
            ref.apply_chat_template(conv, tokenize=False)
        assert (t.eos_token_id, t.pad_token_id, len(t)) == \
            (ref.eos_token_id, ref.pad_token_id, len(ref))


def test_positional_options_go_to_transformers(pair):
    """transformers' second positional argument is a text pair (and, for the chat
    template, tools then documents): never mistaken for a flag here."""
    tok, ref = pair
    assert tok("12", "34")["input_ids"] == ref("12", "34")["input_ids"]
    assert tok.encode("12", "34") == ref.encode("12", "34")
