"""Reward functions by name: a registry plus "pkg.module:func" import paths.

A reward function is `fn(prompt: str, completion: str, **fields) -> float`, where `fields`
are the sample's dataset fields (the answer under `answer`, whatever else the row holds)
plus what the trainer adds (e.g. `completion_ids`, `truncated`, `eos_text`). It sees text,
token ids and fields only, never a model or the trainer.
"""

from __future__ import annotations

from typing import Any, Callable

from orbitrl.errors import OrbitError
from orbitrl.plugins import load_object

RewardFn = Callable[..., float]

_REGISTRY: dict[str, RewardFn] = {}


def register(name: str, override: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Decorator that registers a reward function under `name`.

    Args:
        name: the name configs use (`reward.name`).
        override: replace an existing entry; otherwise a different function under a taken
            name is an error (two plugins silently shadowing each other is worse).

    Returns:
        The decorator; it returns the function unchanged.
    """
    def deco(fn: RewardFn) -> RewardFn:
        old = _REGISTRY.get(name)
        if old is not None and old is not fn and not override:
            raise OrbitError(f"reward {name!r} is already registered "
                             f"({old.__module__}.{old.__qualname__})")
        _REGISTRY[name] = fn
        return fn
    return deco


def list_rewards() -> list[str]:
    """Names of the registered rewards (built-ins included: the package's ``__init__``
    imports the modules that register them before anything can call this), sorted."""
    return sorted(_REGISTRY)


def get_reward(name: str | RewardFn, config: Any = None) -> RewardFn:
    """Resolve a registered name or a "pkg.module:func" import path to a reward function.

    Args:
        name: a registered name, an import path, or a callable (returned as is).
        config: the run's ``reward`` config section; a reward that has settings there (the
            ``code`` reward's sandbox) has a ``with_config(section)`` method and is bound
            to them. Without it, such a reward uses its defaults.

    Returns:
        The callable.

    Raises:
        OrbitError: unknown name (listing the registered ones), or an import path whose
            module or attribute cannot be loaded, or that is not callable.
    """
    if callable(name):
        return name
    if name in _REGISTRY:
        fn = _REGISTRY[name]
        return fn.with_config(config) if config is not None and hasattr(fn, "with_config") else fn
    if ":" in name:
        return load_object(name, "reward")
    raise OrbitError(f"unknown reward {name!r}; registered: {', '.join(sorted(_REGISTRY))} "
                     f"(or give an import path 'pkg.module:func')")

