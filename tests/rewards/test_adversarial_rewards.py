"""Every built-in verifier against the replies a policy finds when the reward is what it
optimises: the question restated, operands echoed, lists of candidates, the answer inside a
prompt echo, units and LaTeX tricks, empty and very long replies. A wrong reply must never
score; the usual right ones must."""

import pytest

from orbitrl.evals.tasks import gsm8k_task
from orbitrl.rewards.answers import final_answer, strict_correct
from orbitrl.rewards.verifiers import arithmetic, exact_match, format_check, math_answer

PROMPT = "What is 23+45? Reply with only the final number."
GOLD = 68

RIGHT = ["68", "68.", " 68\n", "The answer is 68.", "23+45=68", "23 + 45 = 68",
         "The sum of 23 and 45 is 68", "\\boxed{68}", "$\\boxed{68}$", "**68**",
         "Answer: 68", "#### 68", "<answer>68</answer>", "68 apples", "68\n\nHope this helps!",
         "23 + 45 = 68\nSo the answer is 68.", "\\( 68 \\)", "\\boxed{68} and again \\boxed{68}"]

WRONG = [
    # the question restated, or its operands echoed (math-verify proves "23+45" = 68)
    "To calculate 23 + 45, we need to", "23+45", "23 + 45", "45 + 23", "\\boxed{23+45}",
    "\\boxed{45 + 23}", "The answer is 23+45.", "Answer: 23 + 45", "23 and 45",
    "$23 + 45$", "\\boxed{23 \\times 1 + 45}",
    # the prompt echoed whole
    PROMPT, PROMPT + "\n" + PROMPT,
    # lists of candidates
    "68 or 69", "69 or 68", "67, 68, 69", "\\boxed{68} or \\boxed{69}", "\\boxed{68, 69}",
    "Answer: 68 or 69", "between 60 and 70", "<answer>68</answer><answer>69</answer>",
    "68 | 69", "\\boxed{68 \\text{ or } 69}",
    # wrong values and non-answers
    "69", "\\boxed{69}", "6 8", "", "   ", "I don't know", "\\boxed{}", "x" * 100_000,
    "68" * 1000, "6800", "0.68", "-68",
]


@pytest.mark.parametrize("reply", RIGHT)
def test_right_replies_score(reply):
    assert math_answer(PROMPT, reply, answer=str(GOLD)) == 1.0
    assert arithmetic(PROMPT, reply, answer=GOLD) == 1.0
    assert strict_correct(reply, GOLD, PROMPT)


@pytest.mark.parametrize("reply", WRONG)
def test_wrong_replies_never_score(reply):
    assert math_answer(PROMPT, reply, answer=str(GOLD)) == 0.0
    assert arithmetic(PROMPT, reply, answer=GOLD) == 0.0
    assert not strict_correct(reply, GOLD, PROMPT)
    assert exact_match(PROMPT, reply, answer=GOLD) == 0.0


def test_the_answer_inside_the_prompt_echo():
    """A few-shot prompt holds the answer to another question; echoing it scores nothing."""
    prompt = "Example: What is 20+48? 68\nNow: What is 23+45?"
    assert strict_correct("68", 68, prompt)
    for reply in ("Example: What is 20+48? 68", "Example: What is 20+48? 68\nNow:",
                  "Now: What is 23+45?"):
        assert math_answer(prompt, reply, answer="68") == 0.0
        assert arithmetic(prompt, reply, answer=68) == 0.0


def test_a_very_long_reply_is_judged_by_its_end():
    assert arithmetic(PROMPT, "thinking " * 20_000 + "so 68", answer=68) == 1.0
    assert arithmetic(PROMPT, "68 " + "thinking " * 20_000 + "so 69", answer=68) == 0.0
    assert final_answer("\\boxed{" + "1" * 500 + "}") is None  # an answer of 500 characters


def test_units_latex_and_thousands():
    assert arithmetic("q", "The answer is 1,234.", answer="1234") == 1.0
    assert arithmetic("q", "-3.5 apples", answer=-3.5) == 1.0
    assert arithmetic("q", "$\\boxed{1{,}234}$", answer=1234) == 0.0  # not one number
    assert math_answer("q", "\\boxed{\\frac{1}{2}}", answer="0.5") == 1.0
    assert math_answer("q", "\\boxed{0.5}", answer="\\frac{1}{2}") == 1.0
    assert math_answer("q", "\\boxed{\\text{68}}", answer="68") == 1.0
    assert math_answer("q", "so x = \\boxed{2\\sqrt{3}}", answer="\\sqrt{12}") == 1.0
    assert math_answer("Find x if x^2 = 12.", "\\boxed{x^2 = 12}", answer="2\\sqrt{3}") == 0.0
    # an interval answer may list its ends: the gold has as many numbers
    assert math_answer("q", "\\boxed{(1, 2)}", answer="(1, 2)") == 1.0


def test_gsm8k_grader_resists_restatement():
    task = gsm8k_task(limit=1)
    row = task.rows[0]  # 14 loaves in the morning and 9 in the afternoon -> 23
    replies = ["She makes 14 + 9 = 23 loaves.\n#### 23", "14 + 9", "Answer: 14 + 9",
               "14 and 9", "23 or 24", row["prompt"]]
    verdicts = task.score([0] * len(replies), replies, lambda n: None)
    assert [v.passed for v in verdicts] == [True, False, False, False, False, False]


def test_format_rewards_want_content():
    assert format_check("q", "\\boxed{68}") == 1.0
    assert format_check("q", "\\boxed{}") == 0.0
    assert format_check("q", "<answer></answer>") == 0.0
    assert format_check("q", "") == 0.0
    think = dict(format_pattern="think_answer")
    assert format_check("q", "<think>a</think><answer>68</answer>", **think) == 1.0
    assert format_check("q", "<answer>68</answer><think>a</think>", **think) == 0.0
    assert format_check("q", "<think>a</think>\n<answer>68</answer> trailing", **think) == 0.0
