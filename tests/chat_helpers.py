"""A tokenizer with a Qwen2-style chat template (tools, tool messages), built here: one
token per character, the control and tool tokens added (imported by tests as
``chat_helpers``)."""

# Qwen2.5's template, cut to the branches the trajectory uses (no system message given,
# assistant calls written as text, consecutive tool messages in one user turn).
QWEN2_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nYou are a helpful assistant.\\n\\n# Tools\\n"
    "<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall a function as <tool_call>\\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

SPECIAL = ["<|im_start|>", "<|im_end|>"]
ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def chat_tokenizer():
    """Characters one token each, the Qwen2 control and tool tokens as added tokens
    (``<tool_call>`` is not special in Qwen2: a turn decoded without special tokens keeps
    it), eos ``<|im_end|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {"<pad>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>",
                                  pad_token="<pad>")
    tok.chat_template = QWEN2_TEMPLATE
    return tok




def builtin_with_template(d, template: str | None):
    """A copy of the built-in model at ``d`` with ``template`` as its chat template (None:
    no template at all); returns ``d``."""
    import shutil
    from pathlib import Path

    from orbitrl.model.builtin import resolve_model_path

    d = Path(d)
    shutil.copytree(resolve_model_path("builtin:tiny-arith"), d)
    if template is None:
        (d / "chat_template.jinja").unlink()
    else:
        (d / "chat_template.jinja").write_text(template)
    return d
