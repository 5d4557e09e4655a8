"""Multi-turn environments and tools: what a trajectory's turns talk to.

An :class:`Environment` gets the dataset row (``reset``) and then each model turn's text
(``step``), and answers with an observation to append, a reward and whether the trajectory
is done. The built-in ``tools`` environment parses tool calls from the turn
(``toolcall.py``), runs them (``tools.py``: ``calculator``, ``python`` in the sandbox, user
tools by import path) and answers with their results. Calls run in worker threads with a
time limit each (``calls.py``), so a slow or hung environment never blocks the others; the
turn loop that drives the engine lives in ``orbitrl.rl.trajectory``.
"""

from orbitrl.envs.base import Environment, StepResult
from orbitrl.envs.registry import get_env, list_envs, register_env

__all__ = ["Environment", "StepResult", "get_env", "list_envs", "register_env"]
