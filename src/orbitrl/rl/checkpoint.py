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


def scalar_state(tr, extra: dict) -> dict:
    """What every checkpoint format holds besides the policy's tensors, optimizer and
    anchors: step counters, data position, guard, KL controller, RNG states, the critic."""
    # overlapped, the producer has drawn prompts ahead: keep the position as of the steps
    # trained
    data_pos, order = tr._data_trained or (tr.data_pos, tr.order)
    state = {
        "step_idx": tr.step_idx,
        "iteration": tr.iteration,
        "data_pos": data_pos,
        "order": list(order),
        "fused_applied": tr._fused_applied,
        "fused_held": tr._fused_held,
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
    return state


def restore_scalars(tr, state: dict):
    """The inverse of :func:`scalar_state`."""
    tr._fused_applied = state["fused_applied"]
    tr._fused_held = state.get("fused_held", 0)
    tr.step_idx, tr.data_pos, tr.order = state["step_idx"], state["data_pos"], state["order"]
    tr.iteration = state["iteration"]
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


def capture(tr, extra: dict) -> dict:
    """Everything needed to continue the run bit for bit, copied to host memory."""
    state = {
        **scalar_state(tr, extra),
        "trainable": [p.detach() for p in tr.policy.trainable],
        "optimizer": tr.opt.state_dict(),
        "anchors": tr.anchors.state_dict(),
    }
    if tr.overlap is not None:  # the adapter snapshots the next rollouts sample from
        from orbitrl.model.lora import lora_modules

        mods = list(lora_modules(tr.model).values())
        state["overlap_snapshots"] = {k: (v, [view[id(m)] for m in mods])
                                      for k, (v, view) in tr.overlap.pending_snapshots().items()}
    return _cpu(state)


def restore(tr, state: dict):
    with torch.no_grad():
        for p, s in zip(tr.policy.trainable, state["trainable"]):
            p.copy_(s.to(p.device))
    tr.opt.load_state_dict(state["optimizer"])
    restore_scalars(tr, state)
    tr.anchors.load_state_dict(state["anchors"])
    if tr.snapshot is not None:
        tr.snapshot.save()
    if state.get("overlap_snapshots"):
        from orbitrl.model.lora import lora_modules

        mods = list(lora_modules(tr.model).values())
        dev = tr.policy.trainable[0].device
        tr._resume_snapshots = {k: (v, {id(m): tuple(t.to(dev) for t in ab)
                                        for m, ab in zip(mods, views)})
                                for k, (v, views) in state["overlap_snapshots"].items()}


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
            self._publish(state, tmp / "state.pt", final, step)
        except BaseException as e:  # surfaced on the training thread at the next wait()
            self.error = e

    def _save_sharded(self, tr, extra: dict):
        """All ranks write their shards at once, then rank 0 publishes the directory."""
        from orbitrl.distributed import checkpoint as dcp
        from orbitrl.rl.checkpoint_sharded import capture_sharded

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
            self._publish(meta, tmp / "meta.pt", final, step)
        d.barrier()

    def _publish(self, obj, file: Path, final: Path, step: int):
        """Write ``obj`` to ``file`` (inside the temporary directory), then rename the
        directory to ``final``, point ``latest`` at it and rotate old ones."""
        with open(file, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(file.parent, final)
        _atomic_text(self.root / "latest", final.name)
        self.written.append(step)
        self._rotate()

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


def resume_from(tr, path: Path) -> dict:
    """Restore ``tr`` from a checkpoint directory of either format; returns its state
    (``state["extra"]`` as saved)."""
    path = Path(path)
    if (path / "state.pt").exists():
        state = Checkpointer.load(path)
        if tr.dist.enabled:
            from orbitrl.rl.checkpoint_sharded import restore_whole_into_shards

            restore_whole_into_shards(tr, state)
        else:
            restore(tr, state)
        return state
    from orbitrl.rl.checkpoint_sharded import restore_sharded

    return restore_sharded(tr, path)
