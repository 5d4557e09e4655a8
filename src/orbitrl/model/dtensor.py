"""Sharded-tensor checks the model and everything above it need, without importing the
distributed package (which sits above the model): is a tensor a DTensor, and its local shard."""

from __future__ import annotations

import sys

import torch


def is_dtensor(t) -> bool:
    """A sharded (FSDP2) tensor? Free on a one-process run: a DTensor cannot exist unless
    torch.distributed.tensor was imported, and importing it costs about half a second."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    return t.to_local() if is_dtensor(t) else t
