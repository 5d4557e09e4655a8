"""Environments by name: a registry plus "pkg.module:factory" import paths (as rewards).

A factory is called once per trajectory as ``factory(env_section, run_config)`` and returns
an :class:`orbitrl.envs.Environment`; a class whose ``__init__`` takes those two works.
"""

from __future__ import annotations

from typing import Callable

from orbitrl.envs.tool_env import ToolEnv
from orbitrl.errors import OrbitError
from orbitrl.plugins import load_object

_REGISTRY: dict[str, Callable] = {"tools": ToolEnv}  # the built-in ones


def register_env(name: str, override: bool = False):
    """Decorator registering an environment factory under ``name`` (``env.name``)."""
    def deco(factory):
        old = _REGISTRY.get(name)
        if old is not None and old is not factory and not override:
            raise OrbitError(f"environment {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory
    return deco


def list_envs() -> list[str]:
    return sorted(_REGISTRY)


def get_env(name: str) -> Callable:
    """The factory of a registered name or an import path."""
    if callable(name):
        return name
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" in name:
        return load_object(name, "environment")
    raise OrbitError(f"config key 'env.name': unknown environment {name!r}; registered: "
                     f"{', '.join(sorted(_REGISTRY))} (or give an import path "
                     "'pkg.module:factory')")
