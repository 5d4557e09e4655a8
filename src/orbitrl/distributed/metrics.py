"""One metrics row per step for the whole run, from every rank's row.

Rank 0 writes it (metrics.jsonl, TensorBoard, wandb, the progress bar); every rank gets the
same row back, so decisions taken from it agree. Rules, by key:

- counts and throughputs (``groups_kept``, ``dropped_groups``, ``watchdog``,
  ``tokens_per_s``) are summed;
- ``*_max``, times (``time_*``: the slowest rank sets the step) and memory (``mem_*``,
  ``peak_*``: the busiest rank) take the maximum; memory keys also keep every rank's value
  in ``<key>_by_rank``;
- everything else is the mean over ranks weighted by the samples each kept
  (``groups_kept``): ``reward_mean`` is then the global mean. Values that every rank
  already agrees on (step, policy version, lr, the training metrics, which are aggregated
  over every rank's micro-batches before they are logged) are unchanged by this.
"""

from __future__ import annotations

import math

from orbitrl.distributed.env import Dist

SUM_KEYS = frozenset({"groups_kept", "dropped_groups", "watchdog", "tokens_per_s"})


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def reduce_row(row: dict, dist: Dist) -> dict:
    """The run's row from every rank's ``row`` (a collective; identity on one process)."""
    if not dist.enabled:
        return row
    rows = dist.gather_objects(row)
    weights = [float(r.get("groups_kept", 1)) for r in rows]
    out = dict(rows[0])
    for k in set().union(*rows):
        vals = [r.get(k) for r in rows]
        present = [v for v in vals if v is not None]  # (a rank may have none of it)
        if not present or not all(_is_num(v) for v in present):
            out[k] = present[0] if present else None
            continue
        if k.endswith("_max") or k.startswith(("time_", "mem_", "peak_")):
            out[k] = max(present)
            if k.startswith(("mem_", "peak_")) and len(present) == len(vals):
                out[f"{k}_by_rank"] = vals
        elif len(present) < len(vals):
            out[k] = present[0]
            continue
        elif k in SUM_KEYS:
            out[k] = sum(vals)
        else:
            pairs = [(v, w) for v, w in zip(vals, weights) if w > 0 and math.isfinite(v)]
            if not pairs:
                out[k] = vals[0]
            elif len({v for v, _ in pairs}) == 1:
                out[k] = pairs[0][0]  # agreed on every rank: keep it exact
            else:
                out[k] = sum(v * w for v, w in pairs) / sum(w for _, w in pairs)
        if isinstance(rows[0].get(k), int) and not isinstance(out[k], list):
            out[k] = int(out[k]) if float(out[k]).is_integer() else out[k]
    return out
