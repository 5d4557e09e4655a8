"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), resumable at any
world size.

Every rank writes its own shards in parallel (one ``__N_0.distcp`` file per rank) and rank
0 writes DCP's ``.metadata``, which records each tensor's global shape and which slice each
file holds. Loading asks for whole tensors (one process) or for this rank's slices (several):
DCP reads the overlapping pieces of whatever files hold them, so a checkpoint written by 2
ranks resumes on 1, 3 or 4. Tensors are keyed by name (``param/model.layers.0...``), not
by position, so a resume never depends on the order parameters were registered in.

This module moves tensors; what a run's state is (the trainer, its optimizer, the data
position) is assembled in ``orbitrl.rl.checkpoint``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from orbitrl.model.dtensor import is_dtensor, local as local_of
from orbitrl.errors import OrbitError


def _contiguous_stride(shape) -> tuple:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def dim0_shard(local: torch.Tensor, like, full_shape) -> torch.Tensor:
    """A DTensor over ``like``'s mesh whose dim 0 is split as ``like``'s is, from this rank's
    ``local`` rows (optimizer state that follows a parameter's rows)."""
    from torch.distributed.tensor import DTensor  # start-up: ~1 s import, sharded runs only

    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                              shape=torch.Size(full_shape),
                              stride=_contiguous_stride(full_shape))


def local_rows(full: torch.Tensor, like) -> torch.Tensor:
    """This rank's rows of a whole tensor, split as the DTensor ``like`` splits its dim 0
    (``torch.chunk`` over the mesh, trailing ranks possibly empty)."""
    mesh = like.device_mesh
    rank, world = mesh.get_local_rank(), mesh.size()
    chunks = torch.chunk(full, world, dim=0)
    if rank < len(chunks):
        return chunks[rank].contiguous()
    return full.new_zeros((0,) + tuple(full.shape[1:]))


def shard_like(full: torch.Tensor, like) -> torch.Tensor:
    """A whole tensor laid out as ``like`` (a DTensor parameter), or itself when ``like``
    is a plain tensor."""
    if not is_dtensor(like):
        return full
    return dim0_shard(local_rows(full, like).to(like.to_local().device), like, full.shape)


def save(tensors: dict, path: Path, group=None) -> None:
    """Every rank writes its shards of ``tensors`` (flat ``{key: tensor or DTensor}``) under
    ``path``; a collective over ``group`` (None: every rank) when a process group is up."""
    import torch.distributed.checkpoint as dcp  # start-up: ~1 s import, sharded runs only

    dcp.save(tensors, checkpoint_id=str(path), process_group=group)


def stored(path: Path) -> dict:
    """``{key: (global shape, dtype)}`` of the tensors a DCP checkpoint holds."""
    from torch.distributed.checkpoint import (  # start-up: ~1 s import, sharded runs only
        FileSystemReader)
    from torch.distributed.checkpoint.metadata import (  # start-up: ~1 s import, sharded runs only
        TensorStorageMetadata)

    try:
        md = FileSystemReader(str(path)).read_metadata()
    except Exception as e:
        raise OrbitError(f"{path}: unreadable distributed checkpoint ({e})") from None
    return {k: (tuple(v.size), v.properties.dtype)
            for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def load(targets: dict, path: Path, group=None) -> dict:
    """Fill ``targets`` (``{key: tensor or DTensor}`` of the wanted layout) in place from
    the checkpoint at ``path``; works with or without a process group (``group``: the ranks
    that load together, None: every rank)."""
    import torch.distributed.checkpoint as dcp  # start-up: ~1 s import, sharded runs only

    try:
        dcp.load(targets, checkpoint_id=str(path), process_group=group)
    except Exception as e:
        raise OrbitError(f"{path}: cannot load the distributed checkpoint ({e})") from None
    return targets


def empty_target(shape, dtype, like, split: bool) -> torch.Tensor:
    """A zero target for a stored tensor of global ``shape``: split by rows as the DTensor
    parameter ``like`` is (``split``, and ``like`` sharded), else whole on ``like``'s device."""
    if split and is_dtensor(like):
        rows = local_rows(torch.empty(shape[0], 0), like).shape[0]
        local = torch.zeros((rows,) + tuple(shape[1:]), dtype=dtype,
                            device=local_of(like).device)
        return dim0_shard(local, like, shape)
    return torch.zeros(shape, dtype=dtype, device=local_of(like).device)
