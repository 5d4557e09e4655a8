"""User code named by import path in a config ("pkg.module:attr"): rewards, environments,
tools."""

from __future__ import annotations

import importlib

from orbitrl.errors import OrbitError


def load_object(spec: str, what: str):
    """The callable a "pkg.module:attr" path names (a one-line OrbitError otherwise).
    ``what`` names it in the message ("reward", "environment", "tool")."""
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
