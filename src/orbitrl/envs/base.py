"""The environment interface: ``reset(row) -> first observation`` and
``step(action_text) -> (observation | None, reward, done, info)``.

Either method may be a coroutine function (``async def``): the call runner awaits it in its
worker thread, so an environment that waits on I/O can be written with asyncio.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orbitrl.errors import OrbitError


@dataclass
class StepResult:
    """What one ``step`` gave: ``observation`` the text to append (None: nothing, the
    trajectory ends), ``reward`` this turn's reward (summed into the trajectory's),
    ``done`` the trajectory ends here, ``info`` counters (``tool_calls``, ``tool_errors``,
    ``answer_hits``, ...) summed into the step's metrics."""
    observation: str | None
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)


def as_step_result(value) -> StepResult:
    """A StepResult from what ``step`` returned: a StepResult or an
    ``(observation, reward, done, info)`` tuple."""
    if isinstance(value, StepResult):
        return value
    if isinstance(value, tuple) and len(value) == 4:
        obs, reward, done, info = value
        if obs is not None and not isinstance(obs, str):
            raise OrbitError(f"environment step: observation must be str or None, not "
                             f"{type(obs).__name__}")
        return StepResult(obs, float(reward), bool(done), dict(info or {}))
    raise OrbitError("environment step must return a StepResult or (observation, reward, "
                     f"done, info), not {type(value).__name__}")


class Environment:
    """One trajectory's environment (a new instance per trajectory).

    Subclasses implement ``reset`` and ``step``; the first observation must depend on the
    row only (the n samples of a prompt share its KV, so they share its first prompt).
    """

    def reset(self, row: dict) -> str:
        """The first observation (the prompt text) for dataset ``row``."""
        raise NotImplementedError

    def step(self, action: str):
        """React to the model's turn ``action``; returns a StepResult or a 4-tuple."""
        raise NotImplementedError
