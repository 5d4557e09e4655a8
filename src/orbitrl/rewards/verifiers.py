"""Built-in rule-based rewards: exact match, arithmetic, math (math-verify), format.

Each returns 1.0 or 0.0. A missing or unusable `answer` field raises (the runner records it
as an error for that sample), because a data problem must not read as a wrong answer.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

from orbitrl.errors import OrbitError
from orbitrl.rewards.answers import admissible, as_number, final_answer, strict_correct
from orbitrl.rewards.registry import register


FORMAT_PRESETS = {
    "boxed": r"\\boxed\{.+?\}",
    "answer_tag": r"<answer>.+?</answer>",
    "boxed_or_answer_tag": r"\\boxed\{.+?\}|<answer>.+?</answer>",
    "think_answer": r"^\s*<think>.*?</think>\s*<answer>.+?</answer>\s*$",
}


def cut_at_eos(completion: str, eos_text: str | None = None) -> str:
    """The completion up to (not including) the first `eos_text`, if given and present."""
    if eos_text:
        idx = completion.find(eos_text)
        if idx >= 0:
            return completion[:idx]
    return completion


def _answer(fields: dict[str, Any], reward: str) -> Any:
    if "answer" not in fields or fields["answer"] is None:
        raise KeyError(f"reward {reward!r} needs the dataset field 'answer'")
    return fields["answer"]


@register("exact_match")
def exact_match(prompt: str, completion: str, **fields: Any) -> float:
    """1.0 when the completion (cut at `eos_text` if given) stripped equals str(answer)
    stripped, else 0.0."""
    text = cut_at_eos(completion, fields.get("eos_text")).strip()
    return 1.0 if text == str(_answer(fields, "exact_match")).strip() else 0.0


@register("arithmetic")
def arithmetic(prompt: str, completion: str, **fields: Any) -> float:
    """1.0 when the completion's final answer (rewards/answers.py: a box, an answer line or
    the final number; never a list of candidates, an operand or text copied from the prompt)
    is one number equal to the answer (relative tolerance 1e-9, absolute 1e-6), else 0.0."""
    answer = _answer(fields, "arithmetic")
    if as_number(str(answer)) is None:
        raise ValueError(f"reward 'arithmetic': answer {answer!r} is not a number")
    text = cut_at_eos(completion, fields.get("eos_text"))
    return 1.0 if strict_correct(text, answer, prompt) else 0.0


def _drop_timeout_notice(record: logging.LogRecord) -> bool:
    return "Timeout is disabled" not in record.getMessage()


@register("math")
def math_answer(prompt: str, completion: str, **fields: Any) -> float:
    """1.0 when the completion's final answer (rewards/answers.py: the last box, an answer
    line or the final number; never a list of candidates or an expression copied from the
    prompt) equals the gold answer: a numeric gold answer wants a number or a fraction of
    that value, any other by math-verify's equivalence.

    math-verify's own timeouts use SIGALRM, which only works in the main thread; inside a
    RewardRunner worker they are off and the runner's time limit applies instead.
    """
    try:
        from math_verify import parse, verify  # optional: math_verify
    except ImportError as e:
        raise OrbitError("reward 'math' needs math-verify: pip install math-verify") from e
    for name in ("math_verify.parser", "math_verify.grader"):  # the runner owns the timeout
        logger = logging.getLogger(name)
        if _drop_timeout_notice not in logger.filters:
            logger.addFilter(_drop_timeout_notice)
    main = threading.current_thread() is threading.main_thread()
    t = 5 if main else None
    answer = str(_answer(fields, "math"))
    text = cut_at_eos(completion, fields.get("eos_text"))
    if as_number(answer) is not None:  # a number wants a number (or a fraction) of its value
        return 1.0 if strict_correct(text, answer, prompt) else 0.0
    # the gold answer read as the reply's is (a box's content): plain text would be read
    # as its last number ("(1, 2)" as 2)
    gold = parse("\\boxed{" + answer + "}", parsing_timeout=t) or \
        parse(f"${answer}$", parsing_timeout=t) or parse(answer, parsing_timeout=t)
    if not gold:
        raise ValueError(f"reward 'math': cannot parse the answer {answer!r}")
    # only the reply's final answer is judged: math-verify given the whole text finds any
    # expression in it (a restated "23 + 45" is proved equal to 68)
    ans = final_answer(text, prompt)
    if ans is None or not admissible(ans, answer, prompt):
        return 0.0
    pred = parse("\\boxed{" + ans.text + "}", parsing_timeout=t)
    return 1.0 if pred and verify(gold, pred, timeout_seconds=t) else 0.0


def make_format_reward(pattern: str = "boxed_or_answer_tag"):
    """A reward that is 1.0 when `pattern` (a FORMAT_PRESETS name or a regex, searched with
    DOTALL) matches the completion. Register it with `register(name)(make_format_reward(...))`."""
    regex = re.compile(FORMAT_PRESETS.get(pattern, pattern), re.DOTALL)

    def format_reward(prompt: str, completion: str, **fields: Any) -> float:
        text = cut_at_eos(completion, fields.get("eos_text"))
        return 1.0 if regex.search(text) else 0.0
    format_reward.reads_thinking = True  # its pattern may require the <think> block
    return format_reward


_default_format = make_format_reward()


@register("format")
def format_check(prompt: str, completion: str, **fields: Any) -> float:
    """1.0 when the completion matches `format_pattern` (a preset name or regex; default:
    an answer in \\boxed{} or <answer></answer> tags). Set `format_pattern` through the
    reward source's kwargs."""
    pattern = fields.get("format_pattern")
    fn = _default_format if pattern is None else make_format_reward(pattern)
    return fn(prompt, completion, **fields)


format_check.reads_thinking = True  # judges the whole completion, thoughts included
