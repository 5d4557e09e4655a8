"""Environments by name: a registry plus "pkg.module:factory" import paths (as rewards).

A factory is called once per trajectory as ``factory(env_section, run_config)`` and returns
an :class:`orbitrl.envs.Environment`; a class whose ``__init__`` takes those two works.
"""

from __future__ import annotations

import importlib
from typing import Callable

from orbitrl.errors import OrbitError

_REGISTRY: dict[str, Callable] = {}


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
    _builtins()
    return sorted(_REGISTRY)


def load_object(spec: str, what: str):
    """The attribute a "pkg.module:attr" path names (a one-line OrbitError otherwise)."""
    module_name, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is a config error here
        raise OrbitError(f"{what} {spec!r}: cannot import module {module_name!r} "
                         f"({type(e).__name__}: {e})") from e
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise OrbitError(f"{what} {spec!r}: module {module_name!r} has no {attr!r}")
    if not callable(obj):
        raise OrbitError(f"{what} {spec!r} is not callable")
    return obj


def get_env(name: str) -> Callable:
    """The factory of a registered name or an import path."""
    _builtins()
    if callable(name):
        return name
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" in name:
        return load_object(name, "environment")
    raise OrbitError(f"config key 'env.name': unknown environment {name!r}; registered: "
                     f"{', '.join(sorted(_REGISTRY))} (or give an import path "
                     "'pkg.module:factory')")


def _builtins():
    import orbitrl.envs.tool_env  # noqa: F401 - registers "tools"
