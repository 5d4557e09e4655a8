"""Reward registry and built-in verifiers."""

import os
import subprocess
import sys

import pytest

import orbitrl
from orbitrl.errors import OrbitError
from orbitrl.rewards import RewardRunner, get_reward, list_rewards, register, registry
from orbitrl.rewards.verifiers import (arithmetic, exact_match, format_check,
                                       make_format_reward)


@pytest.fixture
def clean_registry(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


def test_builtins_registered():
    assert {"exact_match", "arithmetic", "math", "format"} <= set(list_rewards())
    assert get_reward("exact_match") is exact_match


def test_unknown_name_lists_registered():
    with pytest.raises(OrbitError, match="unknown reward 'exact_mtch'.*arithmetic.*exact_match"):
        get_reward("exact_mtch")


def test_import_path():
    assert get_reward("orbitrl.rewards.verifiers:exact_match") is exact_match
    with pytest.raises(OrbitError, match="no_such_mod"):
        get_reward("no_such_mod:f")
    with pytest.raises(OrbitError, match="has no 'nope'"):
        get_reward("orbitrl.rewards.verifiers:nope")


def test_register_and_duplicates(clean_registry):
    @register("my_len")
    def my_len(prompt, completion, **fields):
        return float(len(completion))

    assert get_reward("my_len")("p", "abc") == 3.0
    with pytest.raises(OrbitError, match="already registered"):
        register("my_len")(lambda p, c, **f: 0.0)
    register("my_len", override=True)(lambda p, c, **f: 1.0)
    assert get_reward("my_len")("p", "abc") == 1.0


def test_exact_match():
    assert exact_match("q", " 42 \n", answer=42) == 1.0
    assert exact_match("q", "42<|endoftext|>junk", answer="42", eos_text="<|endoftext|>") == 1.0
    assert exact_match("q", "42<|endoftext|>junk", answer="42") == 0.0
    assert exact_match("q", "41", answer="42") == 0.0
    with pytest.raises(KeyError, match="answer"):
        exact_match("q", "42")


def test_arithmetic():
    assert arithmetic("q", "The answer is 1,234.", answer="1234") == 1.0
    assert arithmetic("q", "-3.5 apples", answer=-3.5) == 1.0
    assert arithmetic("q", "12 then 13", answer=13) == 1.0  # the final number counts
    assert arithmetic("q", "13 then 12", answer=13) == 0.0
    assert arithmetic("q", "no idea", answer=13) == 0.0
    with pytest.raises(ValueError, match="not a number"):
        arithmetic("q", "5", answer="five")


def test_format():
    assert format_check("q", "so <answer>5</answer>") == 1.0
    assert format_check("q", "so \\boxed{5}") == 1.0
    assert format_check("q", "5") == 0.0
    assert format_check("q", "<think>hm</think> <answer>5</answer>", format_pattern="think_answer") == 1.0
    assert format_check("q", "<answer>5</answer>", format_pattern="think_answer") == 0.0
    assert make_format_reward(r"^\d+$")("q", "17") == 1.0


def test_math_verify():
    pytest.importorskip("math_verify")
    fn = get_reward("math")
    assert fn("q", "so \\boxed{\\frac{1}{2}}", answer="0.5") == 1.0
    assert fn("q", "so \\boxed{3}", answer="0.5") == 0.0
    # in a worker thread math-verify's SIGALRM timeouts must be off, not an error
    res = RewardRunner(["math"], timeout_s=10)(["q"], ["x = \\frac{6}{4}"], [{"answer": "1.5"}])
    assert res.rewards == [1.0] and res.errors == []


def test_math_without_math_verify(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes the import fail
    with pytest.raises(OrbitError, match="pip install math-verify"):
        get_reward("math")("q", "1", answer="1")


def test_rewards_do_not_import_torch():
    src = os.path.dirname(os.path.dirname(orbitrl.__file__))
    env = {**os.environ, "PYTHONPATH": src}
    code = "import sys, orbitrl.rewards; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
