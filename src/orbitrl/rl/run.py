"""A whole run: data, held-out evaluation before and after, the step loop with a progress
bar, metrics, the final adapters or weights, and the summary."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from orbitrl.config import Config, save_config
from orbitrl.data.datasets import load_rows, task_rows
from orbitrl.errors import OrbitError
from orbitrl.observe.metrics import ExternalWriters, MetricsWriter, peak_rss_bytes, read_metrics


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


def run_training(cfg: Config, run_dir: Path, echo=print, resume: bool = False,
                 dist=None) -> dict:
    """Train (or continue a run from its latest checkpoint) and write the summary.

    ``dist``: this process's :class:`orbitrl.dist.env.Dist` under torchrun (every rank
    runs this function; rank 0 alone writes metrics, summary and the final policy)."""
    from orbitrl.dist.env import Dist
    from orbitrl.dist.metrics import reduce_row
    from orbitrl.rewards import get_reward
    from orbitrl.rl.checkpoint import Checkpointer, resume_from
    from orbitrl.rl.trainer import RLTrainer, StepAbandoned

    dist = dist or Dist()
    main = dist.is_main
    if not main:
        echo = _quiet

    for name in [cfg.reward.name, *cfg.reward.extra]:  # fail on a bad name before loading
        if not str(name).startswith("rm:"):
            get_reward(name)
    train_rows, held = load_data(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    if main:
        save_config(cfg, run_dir / "config.yaml")
    ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint.keep, dist=dist)
    t_start = time.perf_counter()
    trainer = RLTrainer(cfg, train_rows, held, dist=dist)
    echo(f"orbitrl train: {cfg.algo.name} / {cfg.train.mode} on {trainer.policy.path.name} "
         f"({sum(p.numel() for p in trainer.policy.trainable):,} trainable params), "
         f"{len(train_rows)} train prompts, {len(held)} held-out")
    # the built-in task also reports whether the number was right in any format, so the
    # share of a gain that is arithmetic and the share that is answer format are visible
    lenient = "arithmetic" if not cfg.data.train and cfg.reward.name == "exact_match" else None
    latest = ckpt.latest() if resume else None
    if latest is not None:
        state = resume_from(trainer, latest)  # either format, at any world size
        acc0 = state["extra"]["heldout_accuracy_before"]
        num0 = state["extra"].get("heldout_number_accuracy_before")
        prior_wall = state["extra"].get("wall_seconds", 0.0)
        echo(f"resumed from {latest} at step {trainer.iteration}")
    else:
        acc0 = trainer.evaluate(held)
        num0 = trainer.evaluate(held, lenient) if lenient else None
        prior_wall = 0.0
        echo(f"held-out accuracy before: {acc0:.3f}")

    # each step appears once: drop rows logged after the checkpoint we continue from
    kept = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] < trainer.iteration]
    if main:
        _rewrite_metrics(run_dir / "metrics.jsonl", kept)
    # every step's mean reward (the summary's averages), from the checkpoint: with
    # log.every > 1 metrics.jsonl holds only some steps
    rewards = list(state["extra"]["rewards"]) if latest is not None and \
        "rewards" in state["extra"] else [r["reward_mean"] for r in kept]
    writer = MetricsWriter(run_dir / "metrics.jsonl") if main else _NoWriter()
    external = ExternalWriters(run_dir, cfg.log.tensorboard, cfg.log.wandb, cfg.to_dict()) \
        if main else _NoWriter()
    stop = _StopSignals()
    if not dist.enabled and not cfg.rollout.overlap:
        # a stop request abandons the step in flight (minutes on a real model on CPUs);
        # overlapped, the producer is cancelled on close and the trained step finishes
        trainer.should_stop = lambda: stop.signal is not None
    budget, t_loop = cfg.train.max_seconds, time.perf_counter()
    bar = Progress(cfg.train.max_steps, budget, trainer.iteration,
                   disable=not (cfg.log.progress and main))
    stopped = "max_steps"
    pending = None

    def extra():
        return {"heldout_accuracy_before": acc0, "heldout_number_accuracy_before": num0,
                "wall_seconds": prior_wall + time.perf_counter() - t_start,
                "rewards": list(rewards)}

    try:
        while trainer.iteration < cfg.train.max_steps:
            # ranks stop together (each later step is a collective): decisions are reduced
            if budget and dist.any(time.perf_counter() - t_loop > budget):
                stopped = "max_seconds"
                break
            if dist.any(stop.signal is not None):
                stopped = stop.signal or "SIGTERM"
                break
            row = reduce_row(trainer.step(), dist)
            row["wall_s"] = prior_wall + time.perf_counter() - t_start
            pending = row  # written every log.every steps, and the last one at the end
            if trainer.iteration % cfg.log.every == 0:
                writer.write(row)
                external.write(row)
                pending = None
            rewards.append(row["reward_mean"])
            recent = rewards[-20:]
            bar.update(trainer.iteration, reward=f"{sum(recent) / len(recent):.3f}",
                       kl=f"{row.get('kl', 0.0):.4f}")
            if cfg.checkpoint.every and trainer.iteration % cfg.checkpoint.every == 0:
                ckpt.save(trainer, extra())
    except StepAbandoned:
        stopped = stop.signal or "SIGTERM"
    except KeyboardInterrupt:
        stopped = "SIGINT"
    finally:
        if pending is not None:  # the run's last step, whatever ended the loop
            writer.write(pending)
            external.write(pending)
        trainer.close()
        bar.close()
        writer.close()
        external.close()
        stop.restore()
    ckpt.save(trainer, extra(), block=True)
    if stopped in ("SIGINT", "SIGTERM"):
        echo(f"stopped by {stopped} at step {trainer.iteration}; checkpoint written, "
             f"continue with: orbitrl train --resume {run_dir}")
        raise SystemExit(130 if stopped == "SIGINT" else 143)
    acc1 = trainer.evaluate(held)
    extra_acc = {}
    if lenient:
        extra_acc = {"heldout_number_accuracy_before": num0,
                     "heldout_number_accuracy_after": trainer.evaluate(held, lenient)}
    save_policy(trainer, run_dir / "checkpoints" / "final")
    summary = {
        "heldout_accuracy_before": acc0, "heldout_accuracy_after": acc1,
        "steps": trainer.iteration, "optimizer_steps": trainer.step_idx, "stopped": stopped,
        "wall_seconds": prior_wall + time.perf_counter() - t_start,
        "reward_first_20": _mean(rewards[:20]), "reward_last_20": _mean(rewards[-20:]),
        "peak_memory_bytes": peak_rss_bytes(), "anchor_refreshes": trainer.anchors.events,
        **trainer.skip_counts(),
        "mode": cfg.train.mode, "algo": cfg.algo.name, "resumed": latest is not None,
        **(mem := trainer.mem.summary()),
        **extra_acc,
    }
    if dist.enabled:
        summary["world_size"] = dist.world
        peaks = dist.gather_objects(mem)
        summary["measured_peak_bytes_by_rank"] = [p["measured_peak_bytes"] for p in peaks]
        for ph in ("rollout", "score", "train"):
            summary[f"measured_{ph}_bytes_by_rank"] = [p.get(f"measured_{ph}_bytes")
                                                      for p in peaks]
    if main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


class Progress:
    """The run's bar. Without a time budget: steps against ``train.max_steps``. With
    ``train.max_seconds``: the share of whichever limit is nearer, so the bar fills as the
    run nears its end and tqdm's rate and ETA read as the time left; steps done and steps
    per second go in the postfix."""

    SCALE = 1000

    def __init__(self, max_steps: int, budget_s: float, start_step: int, disable: bool):
        from tqdm import tqdm

        self.max_steps, self.budget_s, self.start = max_steps, budget_s, start_step
        self.t0 = time.perf_counter()
        if budget_s:
            self.bar = tqdm(total=self.SCALE, desc="train", file=sys.stderr, disable=disable,
                            dynamic_ncols=True, bar_format="{desc}: {percentage:3.0f}%|{bar}| "
                            "[{elapsed}<{remaining}{postfix}]")
        else:
            self.bar = tqdm(total=max_steps, initial=start_step, desc="train", unit="step",
                            file=sys.stderr, disable=disable, dynamic_ncols=True)

    def update(self, step: int, **postfix):
        """After a step: ``step`` steps done in all (a resumed run counts its earlier ones)."""
        if not self.budget_s:
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(step - self.bar.n)
            return
        elapsed = time.perf_counter() - self.t0
        frac = min(1.0, max(step / max(1, self.max_steps), elapsed / self.budget_s))
        rate = (step - self.start) / max(elapsed, 1e-9)
        self.bar.set_postfix({"step": f"{step}/{self.max_steps}", "steps/s": f"{rate:.2f}",
                              **postfix}, refresh=False)
        self.bar.update(round(frac * self.SCALE) - self.bar.n)

    def close(self):
        self.bar.close()


def _quiet(*_args, **_kw):
    pass


class _NoWriter:
    """Ranks other than 0 log nothing (rank 0 writes the reduced row)."""

    def write(self, row):
        pass

    def close(self):
        pass


class _StopSignals:
    """SIGTERM ends the loop: the step in flight is abandoned where nothing has been applied
    yet (between decode steps, before scoring, between micro-batches), or finishes where
    an update is already applying; then the consistent state is checkpointed, exit 143."""

    def __init__(self):
        self.signal = None
        self._old = signal.getsignal(signal.SIGTERM)
        try:
            signal.signal(signal.SIGTERM, self._on)
        except ValueError:  # not the main thread
            self._old = None

    def _on(self, signum, frame):
        self.signal = "SIGTERM"

    def restore(self):
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


def _rewrite_metrics(path: Path, rows: list[dict]):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)


def save_policy(trainer, out: Path):
    """Adapters in PEFT's format (adapter mode) or the whole model as an HF directory.
    Sharded: every rank joins the gather of the whole weights, rank 0 writes them."""
    dist = getattr(trainer, "dist", None)
    if dist is not None and dist.enabled:
        from orbitrl.dist.fsdp import gathered

        with gathered(trainer.model):
            if dist.is_main:
                _save_policy(trainer, out)
        dist.barrier()
        return
    _save_policy(trainer, out)


def _save_policy(trainer, out: Path):
    from orbitrl.model.moe import routed_adapters

    # adapters on a mixture's routed experts have no PEFT layout: merged weights instead
    if trainer.cfg.train.mode == "adapter" and not routed_adapters(trainer.model):
        from orbitrl.model.adapters import save_adapters
        from orbitrl.model.builtin import resolve_model_path

        # the base directory and the tokenizer beside the adapters: peft's
        # AutoPeftModelForCausalLM.from_pretrained(out) then needs nothing else
        base = resolve_model_path(trainer.cfg.model.path).resolve()
        save_adapters(trainer.model, out, base_model_name_or_path=base)
        trainer.tok.save_pretrained(str(out))
    else:
        from orbitrl.model.weights import save_pretrained

        save_pretrained(trainer.model, out, tokenizer=trainer.tok)


def _mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def print_summary(summary: dict, run_dir: Path, echo=print):
    rows = [("held-out accuracy before", f"{summary['heldout_accuracy_before']:.3f}"),
            ("held-out accuracy after", f"{summary['heldout_accuracy_after']:.3f}"),
            *([("held-out number right, any format (before -> after)",
                f"{summary['heldout_number_accuracy_before']:.3f} -> "
                f"{summary['heldout_number_accuracy_after']:.3f}")]
              if "heldout_number_accuracy_after" in summary else []),
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
