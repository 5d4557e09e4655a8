"""`orbitrl report RUN_DIR`: PNG plots of a run's metrics and one HTML page with them.

The page references the PNGs beside it by relative path and holds the run's config and
summary inline; it needs no network.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from orbitrl.errors import OrbitError
from orbitrl.observe.metrics import read_metrics

PLOTS = [
    ("reward", "Reward by source", lambda k: k == "reward_mean" or
     (k.startswith("reward_") and k.endswith("_mean"))),
    ("heldout", "Held-out accuracy (strict grader) and reward, beside the training reward",
     lambda k: k in ("heldout_accuracy", "heldout_reward", "reward_mean")),
    ("kl", "KL to the anchor", lambda k: k in ("kl", "kl_coef")),
    ("entropy", "Entropy (nats/token)", lambda k: k == "entropy"),
    ("grad_norm", "Gradient norm", lambda k: k == "grad_norm"),
    ("mismatch", "Rollout vs trainer logprob gap", lambda k: k.startswith("logprob_mismatch")),
    ("clip", "Clip fraction and ratio", lambda k: k in ("clip_frac", "ratio_mean")),
    ("memory", "Memory by phase (MiB)", lambda k: k.startswith("mem_") or
     k == "peak_memory_bytes"),
    ("tokens", "Rollout tokens/s", lambda k: k == "tokens_per_s"),
    ("update", "Update size relative to the weights", lambda k: k == "update_rel"),
    ("staleness", "Staleness of the samples (optimizer steps)",
     lambda k: k in ("staleness_mean", "staleness_max", "staleness_token_mean")),
    ("schedule", "Step time, measured vs the planner's prediction (s)",
     lambda k: k in ("time_step_s", "time_step_predicted_s", "time_sync_s",
                     "time_wait_rollout_s")),
    ("kv_pool", "KV pool: blocks, throttle and grow events",
     lambda k: k in ("kv_blocks", "kv_throttle_events", "kv_grow_events")),
    ("alignment", "Engine vs trainer (check-alignment, log.align_every)",
     lambda k: k in ("align_l1_max", "align_l1_mean", "align_logprob_gap_max",
                     "align_topk_agreement")),
    ("tools", "Tool use (fraction of trajectories) and turns per trajectory",
     lambda k: k in ("env_tool_frac", "env_answer_hits_frac", "env_turns_mean")),
    ("sandbox", "Code reward outcomes (counts per step)",
     lambda k: k.startswith("reward_code_") and k not in ("reward_code_mean",
                                                           "reward_code_pass_rate")),
]


def _smooth(ys, w=10):
    out, acc = [], []
    for y in ys:
        acc.append(y)
        acc = acc[-w:]
        out.append(sum(acc) / len(acc))
    return out


def make_report(run_dir: Path, out_dir: Path | None = None) -> Path:
    import matplotlib  # start-up: matplotlib, only for plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # start-up: matplotlib, only for plots

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl")
    if not rows:
        raise OrbitError(f"{run_dir}: no metrics.jsonl rows to report")
    out = Path(out_dir) if out_dir else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in rows]
    keys = sorted({k for r in rows for k, v in r.items() if isinstance(v, (int, float))})
    images = []
    for name, title, pick in PLOTS:
        chosen = [k for k in keys if pick(k)]
        if not chosen:
            continue
        fig, ax = plt.subplots(figsize=(7, 3.2))
        for k in chosen:
            ys = [r.get(k) for r in rows]
            xs = [s for s, y in zip(steps, ys) if y is not None]
            ys = [y for y in ys if y is not None]
            if name == "memory":
                ys = [y / 2**20 for y in ys]
            sparse = k.startswith("heldout_")  # eval.every steps only
            ax.plot(xs, ys, alpha=0.35 if name == "reward" or (name == "heldout" and not
                                                               sparse) else 0.9,
                    lw=1.5 if sparse else 1, marker="o" if sparse else None, label=k)
            if name == "reward":
                ax.plot(xs, _smooth(ys), lw=2, label=f"{k} (10-step mean)")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=90)
        plt.close(fig)
        images.append((f"{name}.png", title))
    phases = [k for k in keys if k.startswith("time_") and k.endswith("_s")
              and "_predicted" not in k]
    mem_phases = [k for k in keys if k.startswith("mem_") and k.endswith("_measured_bytes")]
    if mem_phases:
        fig, ax = plt.subplots(figsize=(7, 3.2))
        for k in mem_phases:
            ph = k[4:-len("_measured_bytes")]
            # rows of probe steps only (log.memory_every)
            xs = [x for x, r in zip(steps, rows) if r.get(k) is not None]
            ys = [r[k] / 2**20 for r in rows if r.get(k) is not None]
            line = ax.plot(xs, ys, lw=1.2, marker=".", label=f"{ph} measured")[0]
            pk = f"mem_{ph}_predicted_bytes"
            if pk in keys:
                xp = [x for x, r in zip(steps, rows) if r.get(pk) is not None]
                ax.plot(xp, [r[pk] / 2**20 for r in rows if r.get(pk) is not None], lw=1,
                        ls="--", color=line.get_color(), label=f"{ph} predicted")
        ax.set_title("Memory by phase, measured vs planner (MiB)")
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "memory_phases.png", dpi=90)
        plt.close(fig)
        images.append(("memory_phases.png", "Memory by phase, measured vs planner"))
    if phases:
        _stacked(plt, rows, steps, [(k, k[5:-2]) for k in phases], "Seconds per step by phase",
                 out / "phases.png")
        images.append(("phases.png", "Seconds per step by phase"))
    if "mfu_ideal_s" in keys:
        parts = [("mfu_ideal_s", "useful FLOPs at peak")] + [
            (k, k[9:-2].replace("_", " ")) for k in keys if k.startswith("mfu_lost_")]
        mfu = [r.get("mfu") for r in rows if r.get("mfu") is not None]
        title = f"MFU waterfall: seconds per step (mean MFU {sum(mfu) / max(1, len(mfu)):.1%})"
        _stacked(plt, rows, steps, parts, title, out / "mfu.png")
        images.append(("mfu.png", "MFU waterfall"))
    _write_html(run_dir, out, images, rows)
    return out / "report.html"


def _stacked(plt, rows, steps, parts, title, path):
    """Stacked bars per step of the (key, label) parts."""
    fig, ax = plt.subplots(figsize=(7, 3.2))
    bottom = [0.0] * len(rows)
    for k, label in parts:
        ys = [r.get(k) or 0.0 for r in rows]
        ax.bar(steps, ys, bottom=bottom, width=1.0, label=label)
        bottom = [b + y for b, y in zip(bottom, ys)]
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _write_html(run_dir: Path, out: Path, images, rows):
    summary = run_dir / "summary.json"
    config = run_dir / "config.yaml"
    s = json.loads(summary.read_text()) if summary.exists() else {}
    parts = ["<!doctype html><html><head><meta charset='utf-8'>",
             f"<title>orbitrl run {html.escape(run_dir.name)}</title>",
             "<style>body{font-family:sans-serif;max-width:960px;margin:auto}"
             "td{padding:2px 8px}pre{background:#f4f4f4;padding:8px}</style></head><body>",
             f"<h1>orbitrl run {html.escape(run_dir.name)}</h1>",
             f"<p>{len(rows)} steps logged.</p><h2>Summary</h2><table>"]
    for k, v in s.items():
        parts.append(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>")
    parts.append("</table><h2>Plots</h2>")
    for fname, title in images:
        parts.append(f"<h3>{html.escape(title)}</h3><img src='{fname}' alt='{title}'>")
    if config.exists():
        parts.append(f"<h2>Config</h2><pre>{html.escape(config.read_text())}</pre>")
    parts.append("</body></html>")
    (out / "report.html").write_text("\n".join(parts))
