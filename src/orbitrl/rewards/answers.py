"""The final answer of a reply, extracted the way the field does and hardened against the
replies a policy finds when the reward is what it optimises.

Where the answer is (the first rule that finds one wins):

1. ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; every box must hold the same answer;
2. ``<answer>...</answer>``; every tag must hold the same answer;
3. the last answer line: ``#### X``, ``answer: X``, ``answer is X`` (``final answer`` too),
   X up to the end of its line;
4. the final expression after the last ``=`` of the last line (short, no words), else the
   final number of the reply.

What is never an answer (the reply scores as having none):

- text the reply copied from the prompt: every prompt line of 8 or more characters is cut
  out of the reply first (a reply that restates the question, or echoes a prompt that holds
  the answer, keeps only what it added);
- a list of candidates: ``68 or 69``, ``68, 69``, ``68/69``, ``between 60 and 70``, two boxes
  with different answers; (an answer with as many numbers as the gold answer may list them:
  a gold ``(1, 2)`` allows ``(1, 2)``);
- an unevaluated expression of the question's numbers: ``23+45``, ``\\boxed{45+23}``, the
  final number of ``... 23 + 45`` (an operand): its operators (``+ - * / ^ \\times \\cdot
  \\div \\frac``) act on numbers that the prompt holds, and it is not the gold answer's own text;
- an answer longer than 200 characters.

The rewards (``math``, ``arithmetic``) and the strict evaluator (:func:`strict_correct`, held-out
accuracy) read answers through :func:`final_answer`; the evaluator then compares exactly
(numbers by value, text normalised), never by proving equivalence. Where the gold answer is
a number, so must the reply's be (or a fraction): ``\\boxed{60+8}`` is not a final answer.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?![\w])"
                    r"|(?<![\w.])[-+]?\.\d+")
_NUM_LOOSE = re.compile(r"\d+(?:\.\d+)?")
_MARKER = re.compile(r"(?:####|\banswer\s*(?:is|:)|\banswer\s*=)\s*(.*)", re.IGNORECASE)
_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_OPERATOR = re.compile(r"\d\s*(?:[-+*/^×÷·]|\\times|\\cdot|\\div)\s*[-+]?\(?\s*\\?\w*\{?\d"
                       r"|\\frac|\\dfrac|\\tfrac")
_OPS = r"(?:[-+*/^×÷·]|\\times|\\cdot|\\div)"
_OPERAND_BEFORE = re.compile(_OPS + r"\s*$")
_OPERAND_AFTER = re.compile(r"\s*" + _OPS + r"\s*[-+]?\d")
_CONNECTOR = r"(?:,|;|\||\bor\b|\band\b|\bnor\b|\\lor|\\text\{\s*or\s*\})"
_LIST_BEFORE = re.compile(r"\d\W{0,3}\s*" + _CONNECTOR + r"\s*\W{0,3}$", re.IGNORECASE)
_LIST_IN = re.compile(_CONNECTOR, re.IGNORECASE)
MAX_ANSWER_CHARS = 200
ECHO_MIN_CHARS = 8


@dataclass(frozen=True)
class Answer:
    """text: the answer as written; source: boxed | tag | marker | final."""
    text: str
    source: str


def _boxed(text: str) -> list[str]:
    out = []
    for m in _BOX.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append(text[m.end():i - 1])
    return out


def strip_echo(reply: str, prompt: str | None) -> str:
    """``reply`` without any copy of a prompt line of ECHO_MIN_CHARS or more characters
    (whitespace-insensitive at the ends), nor of the whole prompt."""
    if not prompt:
        return reply
    pieces = [prompt.strip()] + sorted({ln.strip() for ln in prompt.splitlines()}, key=len,
                                       reverse=True)
    for p in pieces:
        if len(p) >= ECHO_MIN_CHARS:
            reply = reply.replace(p, " ")
    return reply


def normalize(text: str) -> str:
    """Answer text for comparison: no ``$``, ``\\left``/``\\right``, ``\\text{}`` wrapper,
    ``\\,`` spacing, whitespace, trailing period; lower case."""
    t = re.sub(r"\\text\{([^{}]*)\}", r"\1", text)
    t = re.sub(r"\\left|\\right|\\[,!; ]|\$", "", t)
    t = re.sub(r"\s+", "", t).rstrip(".").lower()
    return t


def numbers(text: str) -> list[float]:
    """The numbers written in ``text`` ("1,234" is one number)."""
    return [float(m.group(0).replace(",", "")) for m in NUMBER.finditer(text)]


def _distinct(found: list[str]) -> str | None:
    vals = {normalize(f) for f in found if f.strip()}
    return found[-1].strip() if len(vals) == 1 else None


def _final_number(text: str) -> str | None:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return None
    line = lines[-1]
    if "=" in line:
        line = line.rsplit("=", 1)[1]
        expr = re.sub(r"^\s*\$|[\s.$]*$|\\[)\]]\s*$", "", line).strip()
        words = re.sub(r"\\[a-zA-Z]+", "", expr)
        if expr and len(expr) <= 60 and re.search(r"\d", expr) and \
                not re.search(r"[a-zA-Z]{3,}", words):
            return expr  # the final expression: "x = \\frac{6}{4}", "= 68"
    found = list(NUMBER.finditer(line))
    if not found:  # the number may sit on an earlier line ("68\n\nHope this helps!")
        for ln in reversed(lines[:-1]):
            found = list(NUMBER.finditer(ln.rsplit("=", 1)[-1]))
            if found:
                line = ln.rsplit("=", 1)[-1]
                break
    if not found:
        return None
    last = found[-1]
    before = line[:last.start()]
    if _OPERAND_BEFORE.search(before) or _OPERAND_AFTER.match(line[last.end():]):
        return None  # an operand of an unevaluated expression: "23 + 45", "68 + 1 ..."
    if _LIST_BEFORE.search(before):
        return None  # the last of a list: "68 or 69", "60, 65, 70", "between 60 and 70"
    return last.group(0)


def final_answer(reply: str, prompt: str | None = None) -> Answer | None:
    """The reply's final answer (module docstring), or None when it has none, hedges, or
    copies it from the prompt.

    Args:
        reply: the completion text (already cut at the end of sequence).
        prompt: the prompt it answers (what an echo is cut against); None: no cut.
    """
    text = strip_echo(reply, prompt).replace("**", "").replace("__", "").replace("`", "")
    if not text.strip():
        return None
    boxes = _boxed(text)
    if boxes:
        got, source = _distinct(boxes), "boxed"
    else:
        tags = _TAG.findall(text)
        if tags:
            got, source = _distinct(tags), "tag"
        else:
            marks = [m.group(1) for m in _MARKER.finditer(text)]
            marks = [m for m in marks if m.strip()]
            if marks:
                got = marks[-1].strip().rstrip(".").strip()
                got = re.sub(r"^\$|\$$", "", got).strip()
                source = "marker"
            else:
                got, source = _final_number(text), "final"
    if got is None or not got.strip() or len(got) > MAX_ANSWER_CHARS:
        return None
    return Answer(got.strip(), source)


def admissible(ans: Answer, gold: str, prompt: str | None = None) -> bool:
    """False when ``ans`` lists candidates or restates an expression of the prompt's
    numbers (module docstring), judged against the gold answer's own form."""
    if normalize(ans.text) == normalize(str(gold)):
        return True
    if len(NUMBER.findall(ans.text)) > max(1, len(NUMBER.findall(str(gold)))) and \
            _LIST_IN.search(ans.text):
        return False
    if prompt and _OPERATOR.search(ans.text):
        mine = set(_NUM_LOOSE.findall(ans.text))
        if mine and mine <= set(_NUM_LOOSE.findall(prompt)):
            return False
    return True


_FRACTION = re.compile(r"^\s*([-+]?)\s*(?:\\[dt]?frac\{\s*(\d+)\s*\}\{\s*(\d+)\s*\}"
                       r"|(\d+)\s*/\s*(\d+))\s*$")


def as_number(text: str) -> float | None:
    """The value of an answer that is one number (units and ``\\text{}`` words around it
    allowed: ``68``, ``$68$``, ``68 apples``, ``1,234``, ``-3.5``, ``68%``) or one fraction
    (``3/4``, ``\\frac{3}{4}``), else None: an expression is not a final answer."""
    t = re.sub(r"\\(?:text|mathrm|textbf|mathbf)\{([^{}]*)\}", r" \1 ", text)
    t = re.sub(r"\\[,!; ]|\$|\\%|%", " ", t)
    frac = _FRACTION.match(t)
    if frac:
        sign, a, b, c, d = frac.groups()
        num, den = (int(a), int(b)) if a is not None else (int(c), int(d))
        return None if den == 0 else (-1 if sign == "-" else 1) * num / den
    found = numbers(t)
    if len(found) != 1 or _OPERATOR.search(t) or re.search(r"\d\s*/\s*\d|\\[a-zA-Z]|[{}^_]", t):
        return None  # an expression, or LaTeX around the number (\\sqrt{12} is not 12)
    return found[0]


def strict_correct(reply: str, gold, prompt: str | None = None) -> bool:
    """The strict evaluator: the reply's final answer (:func:`final_answer`), admissible, and
    equal to ``gold``: by value when the gold answer is a number (relative 1e-9, absolute
    1e-6), else as normalised text. No equivalence proving, no partial credit."""
    ans = final_answer(reply, prompt)
    if ans is None or not admissible(ans, str(gold), prompt):
        return False
    want = as_number(str(gold))
    if want is not None:
        got = as_number(ans.text)
        return got is not None and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-6)
    return normalize(ans.text) == normalize(str(gold))
