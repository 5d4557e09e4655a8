"""Checkpoints of the whole RL state, written atomically without stalling training.

A checkpoint is a directory ``checkpoints/step-000042/`` holding ``state.pt`` (trainable
tensors, optimizer and critic state, data position and order, RNG states, anchors, guard,
KL controller, policy version, step, held-out accuracy before training). It is written
under ``step-000042.tmp`` and renamed when complete, and ``checkpoints/latest`` (a one-line
file, replaced atomically) then points at it: a crash mid-write leaves the previous
checkpoint and pointer intact. The state is copied to host memory on the training thread
(the cost of the bytes) and written to disk on a background thread. Old checkpoints are
rotated, keeping ``keep``.

Under torchrun (``tr.dist.enabled``) a checkpoint is a ``torch.distributed.checkpoint``
directory instead: every rank writes its shards of the trainable tensors, the optimizer
state and the adapter anchor in parallel, rank 0 adds ``meta.pt`` (everything that is not a
sharded tensor), then renames the directory and moves ``latest`` as above. Such a write is
synchronous (a collective). :func:`resume_from` reads either format at any world size:
a sharded checkpoint into one process or into a different number of ranks (DCP reads the
slices each rank needs), and a one-process ``state.pt`` into several ranks (each keeps its
rows). Random-number states are rank 0's.
"""

from __future__ import annotations

import os
import random
import shutil
import threading
from pathlib import Path

import torch

from orbitrl.errors import OrbitError


def _cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


def capture(tr, extra: dict) -> dict:
    """Everything needed to continue the run bit for bit, copied to host memory."""
    state = {
        "step_idx": tr.step_idx,
        "iteration": tr.iteration,
        "data_pos": tr.data_pos,
        "order": list(tr.order),
        "trainable": [p.detach() for p in tr.policy.trainable],
        "optimizer": tr.opt.state_dict(),
        "fused_applied": tr._fused_applied,
        "anchors": tr.anchors.state_dict(),
        "guard": tr.guard.state_dict(),
        "kl_coef": tr.kl_ctl.value,
        "rng_python": random.getstate(),
        "rng_torch": torch.get_rng_state(),
        "rng_engine": tr.engine.rng.get_state(),
        "extra": extra,
    }
    if tr.critic is not None:
        state["critic"] = tr.critic.state_dict()
        state["critic_opt"] = tr.critic_opt.state_dict()
    if torch.cuda.is_available():
        state["rng_cuda"] = torch.cuda.get_rng_state_all()
    return _cpu(state)


def restore(tr, state: dict):
    with torch.no_grad():
        for p, s in zip(tr.policy.trainable, state["trainable"]):
            p.copy_(s.to(p.device))
    tr.opt.load_state_dict(state["optimizer"])
    tr._fused_applied = state["fused_applied"]
    tr.step_idx, tr.data_pos, tr.order = state["step_idx"], state["data_pos"], state["order"]
    tr.iteration = state["iteration"]
    tr.anchors.load_state_dict(state["anchors"])
    tr.guard.load_state_dict(state["guard"])
    tr.kl_ctl.value = state["kl_coef"]
    random.setstate(state["rng_python"])
    torch.set_rng_state(state["rng_torch"])
    tr.engine.rng.set_state(state["rng_engine"])
    if "rng_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng_cuda"])
    if tr.critic is not None:
        tr.critic.load_state_dict(state["critic"])
        tr.critic_opt.load_state_dict(state["critic_opt"])
    if tr.snapshot is not None:
        tr.snapshot.save()


class Checkpointer:
    def __init__(self, root: Path, keep: int = 2, dist=None):
        self.root = Path(root)
        self.dist = dist
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = max(1, keep)
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.written: list[int] = []

    def save(self, tr, extra: dict, block: bool = False):
        """Snapshot now (host copy), write in the background; ``block`` waits for it."""
        self.wait()
        if self.dist is not None and self.dist.enabled:
            self._save_sharded(tr, extra)
            return
        state = capture(tr, extra)
        step = state["iteration"]
        self._thread = threading.Thread(target=self._write, args=(state, step), daemon=False)
        self._thread.start()
        if block:
            self.wait()

    def wait(self):
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.error is not None:
            err, self.error = self.error, None
            raise OrbitError(f"{self.root}: checkpoint write failed ({err})")

    def _write(self, state: dict, step: int):
        try:
            final = self.root / f"step-{step:06d}"
            tmp = self.root / f"step-{step:06d}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            with open(tmp / "state.pt", "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _atomic_text(self.root / "latest", final.name)
            self.written.append(step)
            self._rotate()
        except BaseException as e:  # surfaced on the training thread at the next wait()
            self.error = e

    def _save_sharded(self, tr, extra: dict):
        """All ranks write their shards at once, then rank 0 publishes the directory."""
        from orbitrl.dist import checkpoint as dcp

        d = self.dist
        step = tr.iteration
        final = self.root / f"step-{step:06d}"
        tmp = self.root / f"step-{step:06d}.tmp"
        if d.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        d.barrier()
        tensors, meta = capture_sharded(tr, extra)
        dcp.save(tensors, tmp)
        if d.is_main:
            with open(tmp / "meta.pt", "wb") as f:
                torch.save(meta, f)
                f.flush()
                os.fsync(f.fileno())
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _atomic_text(self.root / "latest", final.name)
            self.written.append(step)
            self._rotate()
        d.barrier()

    def _rotate(self):
        steps = sorted(p for p in self.root.glob("step-*") if p.is_dir()
                       and not p.name.endswith(".tmp"))
        for p in steps[:-self.keep]:
            shutil.rmtree(p, ignore_errors=True)

    def latest(self) -> Path | None:
        ptr = self.root / "latest"
        if not ptr.exists():
            return None
        p = self.root / ptr.read_text().strip()
        return p if (p / "state.pt").exists() or (p / "meta.pt").exists() else None

    @staticmethod
    def load(path: Path) -> dict:
        try:
            return torch.load(path / "state.pt", map_location="cpu", weights_only=False)
        except Exception as e:
            raise OrbitError(f"{path / 'state.pt'}: unreadable checkpoint ({e})") from None


def _atomic_text(path: Path, text: str):
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---- sharded (torchrun) checkpoints ------------------------------------------------------

def _trainable_names(tr) -> list[str]:
    from orbitrl.dist.fsdp import reshard

    reshard(tr.model)  # the registered parameters are the sharded ones
    ids = {id(p): n for n, p in tr.model.named_parameters(remove_duplicate=False)}
    return [ids[id(p)] for p in tr.policy.trainable]


def _split(opt, key: str, p, shape=None) -> bool:
    """Whether optimizer state ``key`` of parameter ``p`` is held split by rows as ``p``."""
    from orbitrl.dist.checkpoint import is_dtensor
    from orbitrl.train.optim import is_fused

    if not is_dtensor(p):
        return False
    if is_fused(opt):
        return key in opt.SHARDED_STATE
    return shape is not None and tuple(shape) == tuple(p.shape)  # torch.optim: like p


def capture_sharded(tr, extra: dict) -> tuple[dict, dict]:
    """(tensors for DCP keyed by name, everything else for rank 0's ``meta.pt``)."""
    from orbitrl.dist.checkpoint import dim0_shard, is_dtensor

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
        "format": "sharded", "world": tr.dist.world,
        "step_idx": tr.step_idx, "iteration": tr.iteration, "data_pos": tr.data_pos,
        "order": list(tr.order), "fused_applied": tr._fused_applied,
        "param_groups": [{k: v for k, v in g.items() if k != "params"}
                         for g in osd["param_groups"]],
        "fused": osd.get("fused"), "optim_scalars": scalars,
        "anchors": {k: v for k, v in anchors.items() if k != "snapshot"},
        "anchor_count": None if tr.anchors.snapshot is None else len(tr.anchors.snapshot),
        "guard": tr.guard.state_dict(), "kl_coef": tr.kl_ctl.value,
        "rng_python": random.getstate(), "rng_torch": torch.get_rng_state(),
        "rng_engine": tr.engine.rng.get_state(), "extra": extra,
    }
    if tr.critic is not None:  # replicated, identical on every rank
        meta["critic"] = _cpu(tr.critic.state_dict())
        meta["critic_opt"] = _cpu(tr.critic_opt.state_dict())
    return tensors, meta


def resume_from(tr, path: Path) -> dict:
    """Restore ``tr`` from a checkpoint directory of either format; returns its state
    (``state["extra"]`` as saved)."""
    path = Path(path)
    if (path / "state.pt").exists():
        state = Checkpointer.load(path)
        if tr.dist.enabled:
            _restore_whole_into_shards(tr, state)
        else:
            restore(tr, state)
        return state
    return _restore_sharded(tr, path)


def _restore_common(tr, state: dict):
    tr._fused_applied = state["fused_applied"]
    tr.step_idx, tr.data_pos, tr.order = state["step_idx"], state["data_pos"], state["order"]
    tr.iteration = state["iteration"]
    tr.guard.load_state_dict(state["guard"])
    tr.kl_ctl.value = state["kl_coef"]
    random.setstate(state["rng_python"])
    torch.set_rng_state(state["rng_torch"])
    tr.engine.rng.set_state(state["rng_engine"])
    if tr.critic is not None:
        tr.critic.load_state_dict(state["critic"])
        tr.critic_opt.load_state_dict(state["critic_opt"])


def _restore_whole_into_shards(tr, state: dict):
    """A one-process ``state.pt`` into sharded parameters: each rank keeps its rows."""
    from orbitrl.dist.checkpoint import local_rows, shard_like

    params = tr.policy.trainable
    with torch.no_grad():
        for p, s in zip(params, state["trainable"]):
            p.to_local().copy_(local_rows(s, p)) if hasattr(p, "to_local") else p.copy_(s)
    tr.opt.load_state_dict(state["optimizer"])
    from orbitrl.train.optim import is_fused

    for p in params:
        st = tr.opt.state.get(p, {})
        for k, v in list(st.items()):
            if isinstance(v, torch.Tensor) and _split(tr.opt, k, p, v.shape):
                st[k] = local_rows(v, p) if is_fused(tr.opt) else shard_like(v, p)
    anchors = dict(state["anchors"])
    if anchors.get("snapshot") is not None:
        from orbitrl.model.lora import adapter_parameters

        anchors["snapshot"] = [shard_like(s, p) for s, p in
                               zip(anchors["snapshot"], adapter_parameters(tr.model))]
    tr.anchors.load_state_dict(anchors)
    _restore_common(tr, state)
    if tr.snapshot is not None:
        tr.snapshot.save()


def _restore_sharded(tr, path: Path) -> dict:
    """A DCP checkpoint into this run's layout (one process, or any number of ranks)."""
    from orbitrl.dist import checkpoint as dcp
    from orbitrl.train.optim import is_fused

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
            from orbitrl.model.lora import adapter_parameters

            p = adapter_parameters(tr.model)[int(key.split("/")[1])]
            targets[key] = dcp.empty_target(shape, dtype, p, True)
    with torch.no_grad():
        dcp.load(targets, path)  # parameters are filled in place
    fused = is_fused(tr.opt)
    tr.opt.state.clear()
    for n, p in by_name.items():
        st = dict(meta["optim_scalars"].get(n, {}))
        for key, t in targets.items():
            if key.startswith(f"optim/{n}/") and key.count("/") == n.count("/") + 2:
                k = key.rsplit("/", 1)[1]
                st[k] = t.to_local() if fused and dcp.is_dtensor(t) else t
        if st:
            tr.opt.state[p] = st
    for g, sg in zip(tr.opt.param_groups, meta["param_groups"]):
        g.update(sg)
    if meta["fused"] is not None:
        from orbitrl.train.optim import FusedStats

        tr.opt.stats = FusedStats(**meta["fused"]["stats"])
        tr.opt._prev_norm = meta["fused"]["prev_norm"]
    anchors = dict(meta["anchors"])
    anchors["snapshot"] = None if meta["anchor_count"] is None else \
        [targets[f"anchor/{i}"] for i in range(meta["anchor_count"])]
    tr.anchors.load_state_dict(anchors)
    _restore_common(tr, meta)
    if tr.snapshot is not None:
        tr.snapshot.save()
    return meta
