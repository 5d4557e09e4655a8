"""The sharded format (torchrun): what the checkpoint package writes and reads when ranks
hold shards.

Tensors (trainable parameters, optimizer state, the adapter anchor) go through
``orbitrl.distributed.checkpoint`` keyed by parameter name; everything else goes to rank 0's
``meta.pt``. Restoring fills this run's layout, whatever world size wrote the checkpoint;
a one-process ``state.pt`` restores into shards by keeping each rank's rows.
"""

from __future__ import annotations

from pathlib import Path

import torch

from orbitrl.distributed import checkpoint as dcp
from orbitrl.distributed.checkpoint import dim0_shard, local_rows, shard_like
from orbitrl.distributed.fsdp import reshard
from orbitrl.errors import OrbitError
from orbitrl.model.dtensor import is_dtensor, local
from orbitrl.model.lora import adapter_parameters
from orbitrl.rl.checkpoint.state import restore_scalars, scalar_state, to_cpu
from orbitrl.train.optim import is_fused


def _trainable_names(tr) -> list[str]:
    reshard(tr.model)  # the registered parameters are the sharded ones
    ids = {id(p): n for n, p in tr.model.named_parameters(remove_duplicate=False)}
    return [ids[id(p)] for p in tr.policy.trainable]


def _split(opt, key: str, p, shape=None) -> bool:
    """Whether optimizer state ``key`` of parameter ``p`` is held split by rows as ``p``."""
    if not is_dtensor(p):
        return False
    if is_fused(opt):
        return key in opt.SHARDED_STATE
    return shape is not None and tuple(shape) == tuple(p.shape)  # torch.optim: like p


def capture_sharded(tr, extra: dict) -> tuple[dict, dict]:
    """(tensors for DCP keyed by name, everything else for rank 0's ``meta.pt``)."""
    names = _trainable_names(tr)
    tensors, scalars = {}, {}
    for n, p in zip(names, tr.policy.trainable):
        tensors[f"param/{n}"] = p.detach()
        for k, v in tr.opt.state.get(p, {}).items():
            if not isinstance(v, torch.Tensor):
                scalars.setdefault(n, {})[k] = v
            elif not is_dtensor(v) and _split(tr.opt, k, p):
                tensors[f"optim/{n}/{k}"] = dim0_shard(v, p, (p.shape[0],) + tuple(v.shape[1:]))
            else:
                tensors[f"optim/{n}/{k}"] = v
    if tr.anchors.snapshot is not None:
        for i, t in enumerate(tr.anchors.snapshot):
            tensors[f"anchor/{i}"] = t
    osd = tr.opt.state_dict()
    anchors = tr.anchors.state_dict()
    meta = {
        **to_cpu(scalar_state(tr, extra)),
        "format": "sharded", "world": tr.dist.world,
        "param_groups": [{k: v for k, v in g.items() if k != "params"}
                         for g in osd["param_groups"]],
        "fused": osd.get("fused"), "optim_scalars": scalars,
        "anchors": {k: v for k, v in anchors.items() if k != "snapshot"},
        "anchor_count": None if tr.anchors.snapshot is None else len(tr.anchors.snapshot),
    }  # (the critic in it is replicated, identical on every rank)
    return tensors, meta


def restore_whole_into_shards(tr, state: dict):
    """A one-process ``state.pt`` into sharded parameters: each rank keeps its rows."""
    params = tr.policy.trainable
    with torch.no_grad():
        for p, s in zip(params, state["trainable"]):
            local(p).copy_(local_rows(s, p) if is_dtensor(p) else s)
    tr.opt.load_state_dict(state["optimizer"])

    for p in params:
        st = tr.opt.state.get(p, {})
        for k, v in list(st.items()):
            if isinstance(v, torch.Tensor) and _split(tr.opt, k, p, v.shape):
                st[k] = local_rows(v, p) if is_fused(tr.opt) else shard_like(v, p)
    anchors = dict(state["anchors"])
    if anchors.get("snapshot") is not None:
        anchors["snapshot"] = [shard_like(s, p) for s, p in
                               zip(anchors["snapshot"], adapter_parameters(tr.model))]
    tr.anchors.load_state_dict(anchors)
    restore_scalars(tr, state)
    if tr.snapshot is not None:
        tr.snapshot.save()


def restore_sharded(tr, path: Path) -> dict:
    """A DCP checkpoint into this run's layout (one process, or any number of ranks)."""
    try:
        meta = torch.load(path / "meta.pt", map_location="cpu", weights_only=False)
    except Exception as e:
        raise OrbitError(f"{path / 'meta.pt'}: unreadable checkpoint ({e})") from None
    held = dcp.stored(path)
    names = _trainable_names(tr)
    by_name = dict(zip(names, tr.policy.trainable))
    missing = [n for n in names if f"param/{n}" not in held]
    if missing:
        raise OrbitError(f"{path}: checkpoint lacks trainable tensor {missing[0]!r} "
                         "(saved by a different train.mode or model?)")
    targets = {f"param/{n}": p.detach() for n, p in by_name.items()}
    for key, (shape, dtype) in held.items():
        if key.startswith("optim/"):
            n, k = key[len("optim/"):].rsplit("/", 1)
            p = by_name[n]
            targets[key] = dcp.empty_target(shape, dtype, p, _split(tr.opt, k, p, shape))
        elif key.startswith("anchor/"):
            p = adapter_parameters(tr.model)[int(key.split("/")[1])]
            targets[key] = dcp.empty_target(shape, dtype, p, True)
    with torch.no_grad():
        dcp.load(targets, path, tr.dist.group)  # parameters are filled in place
    fused = is_fused(tr.opt)
    tr.opt.state.clear()
    for n, p in by_name.items():
        st = dict(meta["optim_scalars"].get(n, {}))
        for key, t in targets.items():
            if key.startswith(f"optim/{n}/") and key.count("/") == n.count("/") + 2:
                k = key.rsplit("/", 1)[1]
                st[k] = t.to_local() if fused and is_dtensor(t) else t
        if st:
            tr.opt.state[p] = st
    for g, sg in zip(tr.opt.param_groups, meta["param_groups"]):
        g.update(sg)
    if meta["fused"] is not None:
        tr.opt.load_fused_state(meta["fused"])
    anchors = dict(meta["anchors"])
    anchors["snapshot"] = None if meta["anchor_count"] is None else \
        [targets[f"anchor/{i}"] for i in range(meta["anchor_count"])]
    tr.anchors.load_state_dict(anchors)
    restore_scalars(tr, meta)
    if tr.snapshot is not None:
        tr.snapshot.save()
    return meta
