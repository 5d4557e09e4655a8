"""`orbitrl report RUN_A RUN_B ... --out DIR`: several runs' curves overlaid on one plot
each (reward, KL, entropy, rollout/trainer logprob gap, alignment L1), against step or
wall-clock seconds, and one HTML page with them and each run's summary.

Comparing runs is how the lean setups are judged: one node against several (1 process vs 2
ranks), colocated against overlapped, one learning rate against another. Curves are
smoothed over 10 logged rows (the raw reward is drawn faintly behind).
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from orbitrl.errors import OrbitError
from orbitrl.observe.metrics import read_metrics
from orbitrl.observe.report import _smooth

CURVES = [("reward_mean", "Reward (mean over the step's samples)"),
          ("kl", "KL to the anchor"),
          ("entropy", "Entropy (nats/token)"),
          ("logprob_mismatch_max", "Rollout vs trainer logprob gap (max)"),
          ("align_l1_max", "Engine vs trainer next-token L1 (max, check-alignment)")]


def _load(run_dirs: list[Path], labels: list[str] | None) -> list[tuple[str, list[dict], dict]]:
    if labels is not None and len(labels) != len(run_dirs):
        raise OrbitError(f"--labels: {len(labels)} labels for {len(run_dirs)} runs")
    out = []
    for i, d in enumerate(run_dirs):
        if not d.is_dir():
            raise OrbitError(f"{d}: not a run directory")
        rows = read_metrics(d / "metrics.jsonl")
        if not rows:
            raise OrbitError(f"{d}: no metrics.jsonl rows to report")
        s = d / "summary.json"
        summary = json.loads(s.read_text()) if s.exists() else {}
        out.append((labels[i] if labels else d.name, rows, summary))
    return out


def _xs(rows: list[dict], x: str) -> list[float]:
    if x == "step":
        return [r["step"] for r in rows]
    t, xs = 0.0, []
    for r in rows:  # wall clock: the steps' own seconds, summed
        t += float(r.get("time_step_s") or 0.0)
        xs.append(t)
    return xs


def overlay(run_dirs: list[Path], out_dir: Path, labels: list[str] | None = None,
            x: str = "step") -> Path:
    """Write one PNG per metric that any run logged, and compare.html; returns the page."""
    import matplotlib  # start-up: matplotlib, only for plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # start-up: matplotlib, only for plots

    if x not in ("step", "time"):
        raise OrbitError(f"--x {x!r}: choose step or time")
    runs = _load([Path(d) for d in run_dirs], labels)
    out_dir.mkdir(parents=True, exist_ok=True)
    images = []
    for key, title in CURVES:
        if not any(key in r for _, rows, _ in runs for r in rows):
            continue
        fig, ax = plt.subplots(figsize=(7, 3.4))
        for label, rows, _ in runs:
            pts = [(xv, r[key]) for xv, r in zip(_xs(rows, x), rows)
                   if isinstance(r.get(key), (int, float))]
            if not pts:
                continue
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            line = ax.plot(xs, _smooth(ys), lw=2, label=label)[0]
            if key == "reward_mean":
                ax.plot(xs, ys, lw=1, alpha=0.25, color=line.get_color())
        ax.set_title(title)
        ax.set_xlabel("step" if x == "step" else "seconds (sum of step times)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / f"compare_{key}.png", dpi=90)
        plt.close(fig)
        images.append((f"compare_{key}.png", title))
    return _page(out_dir, runs, images)


def _page(out_dir: Path, runs, images) -> Path:
    keys = sorted({k for _, _, s in runs for k, v in s.items()
                   if isinstance(v, (int, float, str))})
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>orbitrl: "
             f"{len(runs)} runs compared</title><style>body{{font-family:sans-serif;"
             "max-width:960px;margin:auto}td,th{padding:2px 8px}</style></head><body>",
             f"<h1>{len(runs)} runs compared</h1><h2>Summaries</h2><table><tr><th></th>"]
    parts += [f"<th>{html.escape(label)}</th>" for label, _, _ in runs]
    parts.append("</tr>")
    for k in keys:
        cells = "".join(f"<td>{html.escape(str(s.get(k, '')))}</td>" for _, _, s in runs)
        parts.append(f"<tr><td>{html.escape(k)}</td>{cells}</tr>")
    parts.append("</table>")
    for fname, title in images:
        parts.append(f"<h3>{html.escape(title)}</h3><img src='{fname}' alt='{title}'>")
    parts.append("</body></html>")
    page = out_dir / "compare.html"
    page.write_text("\n".join(parts))
    return page
