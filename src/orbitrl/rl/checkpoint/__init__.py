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
import shutil
import threading
from pathlib import Path

import torch

from orbitrl.distributed import checkpoint as dcp
from orbitrl.errors import OrbitError
from orbitrl.rl.checkpoint.sharded import capture_sharded, restore_sharded, \
    restore_whole_into_shards
from orbitrl.rl.checkpoint.whole import capture, restore

__all__ = ["Checkpointer", "capture", "restore", "resume_from"]


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
        d = self.dist
        step = tr.iteration
        final = self.root / f"step-{step:06d}"
        tmp = self.root / f"step-{step:06d}.tmp"
        if d.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        d.barrier()
        tensors, meta = capture_sharded(tr, extra)
        dcp.save(tensors, tmp, d.group)
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
            restore_whole_into_shards(tr, state)
        else:
            restore(tr, state)
        return state
    return restore_sharded(tr, path)
