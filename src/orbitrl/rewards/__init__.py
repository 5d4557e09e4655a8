"""Reward functions: a registry of callables over text and dataset fields, built-in
verifiers (code ones run in a sandbox), and a runner that isolates failures and hangs.
Never imports a model."""

from orbitrl.rewards.registry import get_reward, list_rewards, register
from orbitrl.rewards.runner import RewardError, RewardResult, RewardRunner, RewardSource
from orbitrl.rewards import code, verifiers  # noqa: F401  (registers the built-ins)

__all__ = ["register", "get_reward", "list_rewards", "RewardRunner", "RewardSource",
           "RewardResult", "RewardError", "code", "verifiers"]
