"""Reasoning models: rewards score the reply after the thoughts (``reward.strip_thinking``),
the format rewards see the whole completion, and the chat template gets a system turn and
the ``enable_thinking`` switch (``data.system_prompt``, ``data.enable_thinking``)."""

from types import SimpleNamespace

import pytest

from orbitrl.config import load_config
from orbitrl.model import load_tokenizer
from orbitrl.model.tokenizer import prompt_encoder
from orbitrl.rewards import RewardRunner, RewardSource
from orbitrl.rewards.runner import reply_after_thinking
from chat_helpers import builtin_with_template


@pytest.mark.parametrize("text,reply", [
    ("<think>23+45 is 68</think>68", "68"),
    ("<think>a</think>b<think>c</think> 68", " 68"),  # the last close ends the thoughts
    ("<think>68, surely 68", ""),  # cut off while thinking: no reply
    ("  <think>68", ""),
    ("68", "68"),  # no thoughts: the completion
    ("the tag </think> appears 68", " appears 68"),
])
def test_reply_after_thinking(text, reply):
    assert reply_after_thinking(text) == reply


def _score(completions, answer="68", strip=True, sources=("exact_match",)):
    runner = RewardRunner([RewardSource(s, kwargs=k) for s, k in sources] if
                          isinstance(sources[0], tuple) else list(sources),
                          timeout_s=None, strip_thinking=strip)
    res = runner(["23+45="] * len(completions), completions,
                 [{"answer": answer}] * len(completions))
    return res


def test_rewards_judge_the_reply_not_the_thoughts():
    got = _score(["<think>maybe 67</think>68", "<think>it is 68</think>67",
                  "<think>68", "<think>68</think>", "68"]).rewards
    # the right answer only inside the thoughts, or a thought never closed, scores 0
    assert got == [1.0, 0.0, 0.0, 0.0, 1.0]
    for name in ("arithmetic", "math"):
        r = _score(["<think>68</think>The answer is 67.", "<think>no</think>68"],
                   sources=(name,)).rewards
        assert r == [0.0, 1.0], name


def test_format_rewards_read_the_whole_completion():
    src = (("format", {"format_pattern": "think_answer"}),)
    ok = "<think>add</think><answer>68</answer>"
    assert _score([ok, "<answer>68</answer>"], sources=src).rewards == [1.0, 0.0]


def test_strip_thinking_off_scores_the_whole_completion():
    assert _score(["<think>x</think>68"], strip=False).rewards == [0.0]
    assert load_config(None, []).reward.strip_thinking is True


TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and "
            "not enable_thinking %}<think></think>{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(builtin_with_template(tmp_path_factory.mktemp("think") / "model",
                                                TEMPLATE))


@pytest.mark.parametrize("system,thinking,want", [
    ("", "auto", "<user>12+34=<assistant>"),
    ("Be brief.", "auto", "<system>Be brief.<user>12+34=<assistant>"),
    ("", "off", "<user>12+34=<assistant><think></think>"),
    ("", "on", "<user>12+34=<assistant>"),
])
def test_system_prompt_and_thinking_switch(tok, system, thinking, want):
    cfg = load_config(None, ["data.chat_template=true", f"data.enable_thinking={thinking}"]
                      + ([f"data.system_prompt={system}"] if system else []))
    assert tok.decode(prompt_encoder(tok, cfg.data)("12+34=")) == want
    raw = SimpleNamespace(chat_template=False)  # no template: the text alone
    assert tok.decode(prompt_encoder(tok, raw)("12+34=")) == "12+34="


@pytest.mark.parametrize("sets,key", [
    (["data.system_prompt=Be brief."], "data.system_prompt"),  # raw prompts: no turns
    (["data.chat_template=true", "data.enable_thinking=off", "env.name=tools"],
     "data.enable_thinking"),  # multi-turn environments render their own turns
])
def test_chat_options_refused_where_they_would_not_apply(sets, key):
    from orbitrl.errors import OrbitError
    from orbitrl.rl.sources import check_modes

    cfg = load_config(None, sets)
    with pytest.raises(OrbitError, match=f"config key '{key}'"):
        check_modes(cfg, SimpleNamespace(enabled=False))


# DeepSeek-R1's distilled models: the generation prompt itself opens the thoughts
R1_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
               "{% if add_generation_prompt %}<assistant><think>\n{% endif %}")


@pytest.mark.parametrize("text,reply", [
    ("23+45 is 68</think>68", "68"),
    ("68", ""),  # still thinking when it stopped: no reply, whatever it says
    ("</think>", ""),
])
def test_reply_after_thinking_the_prompt_opened(text, reply):
    assert reply_after_thinking(text, opened=True) == reply


def test_a_template_that_opens_thinking_is_detected_and_scored_so(tmp_path, tok):
    from orbitrl.model.tokenizer import opens_thinking

    r1 = load_tokenizer(builtin_with_template(tmp_path / "r1", R1_TEMPLATE))
    chat = SimpleNamespace(chat_template=True)
    assert opens_thinking(r1, prompt_encoder(r1, chat))
    assert not opens_thinking(tok, prompt_encoder(tok, chat))  # <assistant> only
    off = load_config(None, ["data.chat_template=true", "data.enable_thinking=off"]).data
    assert not opens_thinking(tok, prompt_encoder(tok, off))  # an empty, closed block
    assert not opens_thinking(r1, prompt_encoder(r1, SimpleNamespace(chat_template=False)))
    runner = RewardRunner(["exact_match"], timeout_s=None, opened=True)
    got = runner(["23+45="] * 3, ["68", "it is 68</think>68", "so 67</think>67"],
                 [{"answer": "68"}] * 3).rewards
    assert got == [0.0, 1.0, 0.0]  # the unclosed thought "68" is not an answer


def test_training_and_eval_read_the_template(tmp_path):
    from trainer_helpers import make_trainer
    from orbitrl.evals.run import _judging_replies

    d = builtin_with_template(tmp_path / "r1", R1_TEMPLATE)
    tr = make_trainer(f"model.path={d}", "data.chat_template=true", "rollout.n=2",
                      "rollout.prompts_per_step=1", "data.heldout_size=4")
    assert tr.rewards.opened
    seen = []
    judge = _judging_replies(lambda i, c, p: seen.extend(c) or [], opened=True)
    judge([0, 1], ["x = 1</think>```python\nf()\n```", "never closed"], None)
    assert seen == ["```python\nf()\n```", ""]
