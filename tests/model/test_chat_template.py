"""Prompts under a chat template: one helper (``encode_prompt``) for training, eval and
generate, whatever type transformers' ``apply_chat_template`` returns."""

import json

import pytest

from orbitrl.errors import OrbitError
from orbitrl.model import load_tokenizer
from orbitrl.model.builtin import resolve_model_path
from orbitrl.model.tokenizer import encode_prompt
from chat_helpers import builtin_with_template

# role markers and a generation prompt, as real chat templates have (the built-in one only
# concatenates the contents, which hides what the template adds)
# (in the built-in vocabulary's characters)
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """The built-in model with a chat template that adds role markers."""
    return builtin_with_template(tmp_path_factory.mktemp("chat") / "model", TEMPLATE)


def test_chat_prompt_is_a_flat_list_of_template_ids(chat_model):
    tok = load_tokenizer(chat_model)
    ids = encode_prompt(tok, "12+34=", chat_template=True)
    assert type(ids) is list and all(type(t) is int for t in ids)
    assert tok.decode(ids) == "<user>12+34=<assistant>"
    assert encode_prompt(tok, "12+34=") == tok("12+34=", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("returns", ["list", "dict", "batch_of_one"])
def test_every_return_type_of_apply_chat_template(returns):
    """transformers 4.x returns a list, 5.x a BatchEncoding (a dict)."""
    class Tok:
        chat_template, name_or_path = "x", "stub"

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            assert add_generation_prompt and tokenize
            ids = [5, 6, 7]
            return {"list": ids, "dict": {"input_ids": ids, "attention_mask": [1, 1, 1]},
                    "batch_of_one": [ids]}[returns]

    assert encode_prompt(Tok(), "hi", chat_template=True) == [5, 6, 7]


def test_tokenizer_without_template_is_one_line_error(tmp_path):
    d = builtin_with_template(tmp_path / "m", None)
    with pytest.raises(OrbitError, match="no chat template"):
        encode_prompt(load_tokenizer(d), "1+1=", chat_template=True)


def test_training_step_with_chat_template(chat_model):
    from orbitrl.config import load_config
    from orbitrl.rl.run import load_data
    from orbitrl.rl.trainer import RLTrainer

    cfg = load_config(None, [f"model.path={chat_model}", "data.chat_template=true",
                             "rollout.prompts_per_step=2", "rollout.n=2",
                             "rollout.max_tokens=3", "data.heldout_size=4",
                             "model.base_dtype=int8"])
    tr = RLTrainer(cfg, *load_data(cfg))
    assert tr.tok.decode(tr.encode("1+2=")) == "<user>1+2=<assistant>"
    tr.step()  # the engine rejected the BatchEncoding: "prompt_ids must be integers"
    assert tr.step_idx == 1


def test_eval_command_applies_the_template_as_training_does(chat_model, tmp_path):
    from orbitrl.cli import main

    out = tmp_path / "eval.json"
    rc = main(["eval", "--model", str(chat_model), "--chat-template", "--limit", "3",
               "--max-tokens", "2", "--out", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 3 and not any("error" in r for r in rows)


def test_generate_command_with_chat_template(chat_model, tmp_path):
    from orbitrl.cli import main

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"prompt": "1+2="}) + "\n")
    rc = main(["generate", "--model", str(chat_model), "--prompts", str(src), "--out", str(out),
               "--chat-template", "--temperature", "0", "--max-tokens", "2", "--no-progress"])
    assert rc == 0 and len(out.read_text().splitlines()) == 1


def test_builtin_tokenizer_keeps_whitespace_and_code_characters():
    """The built-in tokenizer is one token per character over its own tokenizer.json; a
    generic fast tokenizer is loaded as written even where the config's model type (qwen2)
    has a class of its own in transformers, which would drop spaces and newlines."""
    tok = load_tokenizer(resolve_model_path("builtin:tiny-arith"))
    text = "def f(x):\n    return {`x`: x} | 1\n\tok 46"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok.unk_token_id not in ids


def test_generic_tokenizer_under_a_model_type_config(tmp_path):
    """Any directory with a generic tokenizer class and a model type transformers knows."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(["<unk>", " ", "\n", "a", "b"])}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    raw.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>").save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    tok = load_tokenizer(tmp_path)
    assert tok("a b\nb", add_special_tokens=False)["input_ids"] == [3, 1, 4, 2, 4]
