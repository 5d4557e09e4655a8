"""Tool calls through a real chat template: a Qwen2-style template (tools listed in the
system turn, ``<tool_call>{json}</tool_call>`` calls, ``tool`` messages rendered as
``<tool_response>`` in a user turn) on a tokenizer built here. The model's tokens are
scripted (the sampler is replaced), so the test checks the plumbing: the call is parsed
and run, the tool message appended is the template's own rendering and is masked, and the
whole trajectory is token for token what the template renders for the conversation."""

import json

import pytest
import torch
from hf_helpers import make_hf_model

import orbitrl
import orbitrl.engine.engine as engine_mod
from orbitrl.config import Config
from orbitrl.engine import Engine, SamplingParams
from orbitrl.envs.tools import build_tools, tool_schemas
from orbitrl.rewards.verifiers import exact_match
from orbitrl.rl.trajectory import TurnLoop, trajectory_samples

from chat_helpers import ADDED, QWEN2_TEMPLATE, SPECIAL  # noqa: F401,E402
from chat_helpers import chat_tokenizer as _tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    tok = _tokenizer()
    assert len(tok) <= 128
    d = tmp_path_factory.mktemp("qwen2_chat")
    make_hf_model("qwen2", vocab_size=128, max_position_embeddings=1024).save_pretrained(d)
    return orbitrl.load_model(d), tok


def _scripted_sampler(eng, script: list[int]):
    """``engine.sample`` replaced: the one running sequence's next token is the script's
    token at its length (logprob 0)."""
    def sample(logits, params, keys, num_completion, work=None):
        (seq,) = eng.scheduler.running
        t = script[len(seq.token_ids)]
        z = torch.zeros(1)
        return torch.tensor([t]), z, z
    return sample


def test_qwen_style_tool_call_through_the_chat_template(chat_model, monkeypatch):
    model, tok = chat_model
    cfg = Config()
    cfg.data.chat_template = True
    e = cfg.env
    e.name, e.tools, e.tool_call_format, e.tool_results = "tools", ["calculator"], "json", \
        "template"
    e.tool_call_start, e.tool_call_end = "<tool_call>", "</tool_call>"
    e.max_turns, e.turn_max_tokens, e.max_output_chars = 4, 96, 64
    schemas = tool_schemas(build_tools(["calculator"]))
    eng = Engine(model, tok, kv_budget_bytes=8 << 20, block_size=16)
    loop = TurnLoop(eng, tok, None, cfg, schemas)

    call = '<tool_call>\n' + json.dumps({"name": "calculator",
                                         "arguments": {"expression": "347*58"}}) \
        + '\n</tool_call>'
    convo = [{"role": "user", "content": "347*58="}, {"role": "assistant", "content": call},
             {"role": "tool", "content": "20126"}, {"role": "assistant", "content": "20126"}]
    full = tok.apply_chat_template(convo, tools=schemas, tokenize=False)
    script = tok(full, add_special_tokens=False)["input_ids"]
    monkeypatch.setattr(engine_mod, "sample", _scripted_sampler(eng, script))

    params = SamplingParams(n=1, max_tokens=96, temperature=1.0)
    trajs, stats = loop.run([{"prompt": "347*58=", "answer": "20126"}], params, seed=0)
    (t,) = trajs
    assert t.end == "done" and t.turns == 2, (t.end, t.log)
    assert t.info["tool_calls"] == 1 and t.info["answer_hits"] == 1
    assert t.info.get("tool_errors", 0) == 0
    # the prompt is the template's (tools listed), and prompt + trajectory is exactly the
    # template's rendering of the whole conversation, up to the final turn's eos
    prompt_ids = t.info["prompt_ids"]
    assert tok.decode(prompt_ids) == tok.apply_chat_template(
        convo[:1], tools=schemas, add_generation_prompt=True, tokenize=False)
    assert "calculator" in tok.decode(prompt_ids)
    assert prompt_ids + t.tokens == script[:len(prompt_ids) + len(t.tokens)]
    assert len(prompt_ids) + len(t.tokens) == len(script) - 1  # all but the closing "\n"
    # the environment's tokens: the template's tool message (closing the assistant turn,
    # the user turn with the response, opening the next assistant turn), all masked
    env = [tok_id for tok_id, m in zip(t.tokens, t.mask) if m == 0]
    assert tok.decode(env) == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n20126\n"
                               "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    model_text = tok.decode([i for i, m in zip(t.tokens, t.mask) if m == 1])
    assert model_text == call + "20126<|im_end|>"
    first_env = t.mask.index(0)
    assert all(t.mask[:first_env]) and not any(t.mask[first_env:first_env + len(env)])
    assert all(t.mask[first_env + len(env):])
    # the final turn is what the verifier scores
    (s,) = trajectory_samples(trajs, 1, version=0)
    assert s.text == "20126"
    assert exact_match("347*58=", s.text, answer="20126") == 1.0
    assert s.loss_mask == t.mask and len(s.completion_ids) == len(s.loss_mask)
    assert eng.pool.num_free == eng.pool.num_blocks


def test_a_template_that_ignores_tools_gets_them_in_a_system_message(chat_model):
    """``env.tools_prompt`` auto: a template that renders ``tools`` lists them itself; one
    that ignores them (SmolLM2's) gets a system message describing each tool and the call
    syntax; ``template`` keeps the template's prompt and warns that the model never sees
    them."""
    model, tok = chat_model
    plain = _tokenizer()
    plain.chat_template = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + "
                           "m.content + '<|im_end|>\\n' }}{%- endfor %}"
                           "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
                           "{%- endif %}")
    cfg = Config()
    cfg.data.chat_template = True
    cfg.env.name, cfg.env.tool_results = "tools", "template"
    schemas = tool_schemas(build_tools(["calculator"]))

    def prompt(t, mode):
        cfg.env.tools_prompt = mode
        loop = TurnLoop(Engine(model, t, kv_budget_bytes=1 << 20), t, None, cfg, schemas)
        ids, messages = loop.fmt.prompt("1+1=", None)
        return t.decode(ids), messages

    with _no_warning():
        text, messages = prompt(plain, "auto")
    assert [m["role"] for m in messages] == ["system", "user"]
    sys = messages[0]["content"]
    assert text.startswith("<|im_start|>system\n" + sys) and "calculator" in sys
    assert '<tool_call>{"name": "calculator", "arguments": {"expression": "..."}}</tool_call>' \
        in sys  # the run's call syntax, as the turn parser reads it
    with _no_warning():  # a template that renders tools: no system message of ours
        text, messages = prompt(tok, "auto")
    assert [m["role"] for m in messages] == ["user"] and "calculator" in text
    with pytest.warns(UserWarning, match="ignores `tools`"):
        text, messages = prompt(plain, "template")
    assert [m["role"] for m in messages] == ["user"] and "calculator" not in text


@pytest.mark.parametrize("template", ["qwen", "ignores_tools"])
def test_chat_warm_start_traces_are_the_rollouts_tokens(chat_model, monkeypatch, template):
    """`orbitrl sft --task tool_arith --chat-template` trains on ``chat_tool_pairs``: a model
    that writes its two turns token for token produces, through the rollout's TurnLoop, the
    second pair's prompt and answer exactly (the call parsed and run, the tool message
    appended); the first pair is the prompt and the call turn, ending where the turn stops."""
    from orbitrl.config import load_config
    from orbitrl.rl.trajectory import chat_tool_pairs

    model, tok = chat_model
    if template == "ignores_tools":
        tok = _tokenizer()
        tok.chat_template = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + "
                             "m.content + '<|im_end|>\\n' }}{%- endfor %}"
                             "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
                             "{%- endif %}")
    cfg = load_config(None, ["env.name=tools", "data.chat_template=true", "env.max_turns=4",
                             "env.turn_max_tokens=96"])
    row = {"prompt": "347*58=", "answer": "20126"}
    (p1, call), (p2, answer) = chat_tool_pairs(tok, cfg, [row])
    assert p2[:len(p1) + len(call)] == p1 + call
    assert tok.decode(call).endswith("</tool_call>") and answer[-1] == tok.eos_token_id
    assert ("You can use these tools" in tok.decode(p1)) == (template == "ignores_tools")
    eng = Engine(model, tok, kv_budget_bytes=8 << 20, block_size=16)
    schemas = tool_schemas(build_tools(["calculator"]))
    loop = TurnLoop(eng, tok, None, cfg, schemas)
    monkeypatch.setattr(engine_mod, "sample", _scripted_sampler(eng, p2 + answer))
    trajs, _ = loop.run([row], SamplingParams(n=1, max_tokens=96, temperature=1.0), seed=0)
    (t,) = trajs
    assert t.end == "done" and t.info["tool_calls"] == 1 and t.info["answer_hits"] == 1
    assert t.info["prompt_ids"] == p1
    assert p1 + t.tokens == p2 + answer


class _no_warning:
    def __enter__(self):
        import warnings

        self.ctx = warnings.catch_warnings()
        self.ctx.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        self.ctx.__exit__(*exc)
