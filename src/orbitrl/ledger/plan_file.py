"""Plan files: the document ``orbitrl plan --out`` writes and ``orbitrl train --plan`` runs.

A plan file holds the per-role execution plan, the config keys the plan fixes
(``settings``) and what the planner predicts (peak bytes per device, device bytes per role,
step seconds). Reading one checks its format, version and settings keys; running one checks
that the launch has the plan's device count; after the run, :func:`compare` sets the
prediction beside what was measured.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import os
import tempfile
from pathlib import Path

from orbitrl.config import Config
from orbitrl.errors import OrbitError

FORMAT = "orbitrl-plan"
VERSION = 1


def write_plan(path: str | Path, doc: dict) -> Path:
    """Write ``doc`` to ``path`` atomically (a temp file beside it, then ``os.replace``)."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise OrbitError(f"--out {p}: directory {parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return p


def _known_key(key: str) -> bool:
    """``a.b.c`` names a leaf (not a section) of :class:`orbitrl.config.Config`."""
    obj = Config()
    for part in key.split("."):
        if not dataclasses.is_dataclass(obj) or part not in {f.name for f in dataclasses.fields(obj)}:
            return False
        obj = getattr(obj, part)
    return not dataclasses.is_dataclass(obj)


def read_plan(path: str | Path) -> dict:
    """The plan document at ``path``, checked; one-line OrbitError naming the file."""
    p = Path(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise OrbitError(f"--plan {p}: cannot read it ({type(e).__name__}: "
                         f"{getattr(e, 'strerror', None) or e})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise OrbitError(f"--plan {p}: not JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise OrbitError(f"--plan {p}: not an orbitrl plan (format {got!r}, expected {FORMAT!r}; "
                         f"write one with orbitrl plan ... --out FILE)")
    if doc.get("version") != VERSION:
        raise OrbitError(f"--plan {p}: plan version {doc.get('version')!r} is not supported "
                         f"(this orbitrl reads version {VERSION})")
    devices = doc.get("devices")
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise OrbitError(f"--plan {p}: 'devices' must be a positive integer, got {devices!r}")
    settings = doc.get("settings", {})
    if not isinstance(settings, dict):
        raise OrbitError(f"--plan {p}: 'settings' must be a mapping of config key -> value")
    for key in settings:
        if not _known_key(key):
            raise OrbitError(f"--plan {p}: settings key {key!r} is not a config key "
                             f"(docs/config.md lists them)")
    if not isinstance(doc.get("predicted", {}), dict):
        raise OrbitError(f"--plan {p}: 'predicted' must be a mapping")
    return doc


def settings_layer(doc: dict) -> dict:
    """The plan's flat ``settings`` as the nested mapping ``load_config(base=...)`` takes."""
    nested: dict = {}
    for key, value in doc.get("settings", {}).items():
        *sections, leaf = key.split(".")
        cur = nested
        for s in sections:
            cur = cur.setdefault(s, {})
        cur[leaf] = value
    return nested


def check_world(doc: dict, path: str | Path, world: int):
    """Refuse a plan made for another number of devices than this launch's processes."""
    if doc["devices"] != world:
        raise OrbitError(f"--plan {path}: the plan is for {doc['devices']} devices but this "
                         f"launch has {world} (world size); launch {doc['devices']} ranks "
                         f"(torchrun --nproc-per-node {doc['devices']}) or plan again with "
                         f"--devices {world}")


def _ratio(measured, predicted):
    return measured / predicted if measured and predicted else None


def measured_step_seconds(metrics_path: str | Path) -> tuple[float | None, int]:
    """Median ``time_step_s`` over the rows of a run's metrics.jsonl (the first step, which
    warms caches and measures the machine, does not move it), and how many rows."""
    xs = []
    try:
        with open(metrics_path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a row cut by a kill
                if isinstance(row, dict) and isinstance(row.get("time_step_s"), (int, float)):
                    xs.append(float(row["time_step_s"]))
    except OSError:
        return None, 0
    return (statistics.median(xs) if xs else None), len(xs)


def compare(doc: dict, path: str | Path, summary: dict, step_s: float | None,
            steps: int) -> dict:
    """The summary's ``plan`` entry: predicted against measured, each with measured/predicted."""
    pred = doc.get("predicted", {})
    by_rank = summary.get("measured_peak_bytes_by_rank")
    peak = max((b for b in by_rank if b), default=None) if by_rank else \
        summary.get("measured_peak_bytes")
    return {
        "file": str(path),
        "devices": doc["devices"],
        "settings": doc.get("settings", {}),
        "peak_bytes_per_device": {"predicted": pred.get("peak_bytes_per_device"),
                                  "measured": peak,
                                  "ratio": _ratio(peak, pred.get("peak_bytes_per_device"))},
        "step_s": {"predicted": pred.get("step_s"), "measured": step_s, "steps": steps,
                   "ratio": _ratio(step_s, pred.get("step_s"))},
        # per role: the plan's device bytes in the role's largest phase (gradients and
        # activations included) against what the role held resident at the end of the run
        "role_bytes": {r: {"predicted": b, "measured": (summary.get("role_bytes") or {}).get(r),
                           "ratio": _ratio((summary.get("role_bytes") or {}).get(r), b)}
                       for r, b in pred.get("role_bytes", {}).items()},
    }
