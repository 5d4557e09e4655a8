"""Strict graders: held-out accuracy judged by the task's own answer extraction, not by the
training reward (a reward the policy can fool would otherwise report its own success).

A grader is ``fn(prompt, completion, answer) -> bool``:

- ``exact``: the completion, stripped, is the answer (the built-in arithmetic task, whose
  reward wants the bare number);
- ``answer``: the completion's final answer (rewards/answers.py: a box, an answer line or
  the final number; never a list of candidates, an operand or text copied from the prompt)
  equals the answer, numbers by value and text normalised; no equivalence proving;
- ``reward``: the training reward (the ``code`` reward, whose tests are the task's own
  judge; or when asked for).

``auto`` picks ``exact`` for the built-in arithmetic tasks, ``reward`` for code, else
``answer``.
"""

from __future__ import annotations

from typing import Callable

from orbitrl.errors import OrbitError
from orbitrl.rewards.answers import strict_correct

Grader = Callable[[str, str, object], bool]
GRADERS = ("auto", "exact", "answer", "reward")


def _exact(prompt: str, completion: str, answer) -> bool:
    return completion.strip() == str(answer).strip()


def _answer(prompt: str, completion: str, answer) -> bool:
    return strict_correct(completion, answer, prompt)


def choose_grader(name: str, reward: str, task: str | None) -> tuple[str, Grader | None]:
    """(the grader's name, its function; None for ``reward``).

    Args:
        name: ``eval.grader`` (one of GRADERS).
        reward: the run's reward name (``reward.name``).
        task: the built-in task the rows come from, or None for a data file.
    """
    if name not in GRADERS:
        raise OrbitError(f"config key 'eval.grader': {name!r} is not one of "
                         f"{', '.join(GRADERS)}")
    if name == "auto":
        if reward == "code" or task == "code":
            name = "reward"
        elif task in ("arith", "tool_arith") and reward == "exact_match":
            name = "exact"
        else:
            name = "answer"
    return name, {"exact": _exact, "answer": _answer, "reward": None}[name]


def run_grader(cfg) -> tuple[str, Grader | None]:
    """:func:`choose_grader` for a run's config (``eval.grader``, ``reward.name``, and the
    built-in task unless ``data.train`` names a file)."""
    return choose_grader(cfg.eval.grader, cfg.reward.name,
                         None if cfg.data.train else cfg.data.task)


def reward_gap_warning(reward: str, accuracy: float, mean_reward: float,
                       gap: float) -> str | None:
    """The warning when the held-out training reward passes the strict accuracy by more than
    ``gap`` (``eval.warn_gap``): a reward that scores what the grader does not."""
    if mean_reward - accuracy <= gap:
        return None
    return (f"warning: on the held-out rows the training reward {reward!r} gives "
            f"{mean_reward:.3f} where the strict grader gives {accuracy:.3f}: the policy may "
            f"be exploiting the reward {reward!r} (compare completions in "
            f"metrics/summary; docs/eval.md)")
