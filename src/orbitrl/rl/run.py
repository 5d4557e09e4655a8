"""A whole run: data, held-out evaluation before and after, the step loop with a progress
bar, metrics, the final adapters or weights, and the summary."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from orbitrl.config import Config, save_config
from orbitrl.data.datasets import load_rows, task_rows
from orbitrl.errors import OrbitError
from orbitrl.observe.metrics import MetricsWriter, peak_rss_bytes


def load_data(cfg: Config) -> tuple[list[dict], list[dict]]:
    d = cfg.data
    need = [d.prompt_field, d.answer_field]
    if d.train:
        train = load_rows(d.train, need)
    else:
        train = task_rows(d.task, "rl")
    if d.heldout:
        held = load_rows(d.heldout, need)
    elif d.train:
        # explicit split: the last heldout_size rows of the training file are held out
        n = min(d.heldout_size, len(train) // 5)
        if n == 0:
            raise OrbitError(f"{d.train}: too few rows for a held-out split; set data.heldout")
        train, held = train[:-n], train[-n:]
    else:
        held = task_rows(d.task, "heldout", d.heldout_size)
    return train, held


def run_training(cfg: Config, run_dir: Path, echo=print) -> dict:
    from tqdm import tqdm

    from orbitrl.rl.trainer import RLTrainer

    from orbitrl.rewards import get_reward

    get_reward(cfg.reward.name)  # fail on a bad name before loading anything
    train_rows, held = load_data(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    (run_dir / "checkpoints").mkdir(exist_ok=True)
    t_start = time.perf_counter()
    trainer = RLTrainer(cfg, train_rows, held)
    echo(f"orbitrl train: {cfg.algo.name} / {cfg.train.mode} on {trainer.policy.path.name} "
         f"({sum(p.numel() for p in trainer.policy.trainable):,} trainable params), "
         f"{len(train_rows)} train prompts, {len(held)} held-out")
    acc0 = trainer.evaluate(held)
    echo(f"held-out accuracy before: {acc0:.3f}")
    writer = MetricsWriter(run_dir / "metrics.jsonl")
    budget = cfg.train.max_seconds
    t_loop = time.perf_counter()
    bar = tqdm(total=cfg.train.max_steps, desc="train", unit="step", file=sys.stderr,
               disable=not cfg.log.progress, dynamic_ncols=True)
    rewards: list[float] = []
    steps = 0
    stopped = "max_steps"
    try:
        while steps < cfg.train.max_steps:
            if budget and time.perf_counter() - t_loop > budget:
                stopped = "max_seconds"
                break
            row = trainer.step()
            row["wall_s"] = time.perf_counter() - t_start
            writer.write(row)
            rewards.append(row["reward_mean"])
            steps += 1
            recent = rewards[-20:]
            bar.set_postfix(reward=f"{sum(recent) / len(recent):.3f}",
                            kl=f"{row.get('kl', 0.0):.4f}")
            bar.update(1)
    except KeyboardInterrupt:
        stopped = "interrupted"
    finally:
        bar.close()
        writer.close()
    acc1 = trainer.evaluate(held)
    save_policy(trainer, run_dir / "checkpoints" / "final")
    summary = {
        "heldout_accuracy_before": acc0, "heldout_accuracy_after": acc1, "steps": steps,
        "optimizer_steps": trainer.step_idx, "stopped": stopped,
        "wall_seconds": time.perf_counter() - t_start,
        "train_seconds": time.perf_counter() - t_loop,
        "reward_first_20": _mean(rewards[:20]), "reward_last_20": _mean(rewards[-20:]),
        "peak_memory_bytes": peak_rss_bytes(), "anchor_refreshes": trainer.anchors.events,
        "skipped_spike": trainer.guard.skipped_spike,
        "skipped_nonfinite": trainer.guard.skipped_nonfinite,
        "mode": cfg.train.mode, "algo": cfg.algo.name,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def save_policy(trainer, out: Path):
    """Adapters in PEFT's format (adapter mode) or the whole model as an HF directory."""
    if trainer.cfg.train.mode == "adapter":
        from orbitrl.model.adapters import save_adapters

        save_adapters(trainer.model, out)
    else:
        from orbitrl.model.weights import save_pretrained

        save_pretrained(trainer.model, out, tokenizer=trainer.tok)


def _mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def print_summary(summary: dict, run_dir: Path, echo=print):
    rows = [("held-out accuracy before", f"{summary['heldout_accuracy_before']:.3f}"),
            ("held-out accuracy after", f"{summary['heldout_accuracy_after']:.3f}"),
            ("steps", str(summary["steps"])),
            ("reward (first 20 -> last 20 steps)",
             f"{summary['reward_first_20']:.3f} -> {summary['reward_last_20']:.3f}"),
            ("wall time", f"{summary['wall_seconds']:.0f} s"),
            ("peak memory", f"{summary['peak_memory_bytes'] / 2**20:.0f} MiB"),
            ("skipped steps (spike / non-finite)",
             f"{summary['skipped_spike']} / {summary['skipped_nonfinite']}"),
            ("run directory", str(run_dir))]
    w = max(len(k) for k, _ in rows)
    echo("-" * (w + 30))
    for k, v in rows:
        echo(f"{k:<{w}}  {v}")
    echo("-" * (w + 30))
