"""A whole run: data, held-out evaluation before and after, the step loop with a progress
bar, metrics, the final adapters or weights, and the summary."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from orbitrl.config import Config, save_config
from orbitrl.data.datasets import load_rows, task_rows
from orbitrl.distributed.collective import Collective
from orbitrl.distributed.roles import assign_roles
from orbitrl.errors import OrbitError
from orbitrl.model.adapters import save_adapters
from orbitrl.model.builtin import pinned_revision, resolve_model_path
from orbitrl.model.lora import routed_adapters
from orbitrl.model.tokenizer import save_tokenizer
from orbitrl.model.weights import save_pretrained
from orbitrl.observe.memory import role_bytes
from orbitrl.observe.metrics import ExternalWriters, MetricsWriter, peak_rss_bytes, read_metrics
from orbitrl.observe.schedule import balance_line
from orbitrl.rewards import get_reward
from orbitrl.rewards.graders import reward_gap_warning, run_grader
from orbitrl.rl.checkpoint import Checkpointer, resume_from
from orbitrl.rl.pool_worker import run_rollout_rank
from orbitrl.rl.trainer import RLTrainer, StepAbandoned


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

    ``dist``: this process's :class:`orbitrl.distributed.env.Dist` under torchrun (every rank
    runs this function; rank 0 alone writes metrics, summary and the final policy)."""
    roles = assign_roles(cfg, dist) if dist is not None else None
    world = dist.world if dist is not None else 1
    check_rewards(cfg)  # fail on a bad name before loading
    if cfg.eval.every and (cfg.rollout.overlap or cfg.schedule.shape != "colocated"):
        raise OrbitError("config key 'eval.every' needs the colocated engine between steps "
                         "(rollout.overlap false, schedule.shape colocated): an overlapped "
                         "rollout is using it")
    train_rows, held = load_data(cfg)
    if roles is not None:  # separate pools: rollout ranks serve the leader, then leave
        if roles.is_rollout:
            run_rollout_rank(cfg, roles, train_rows)
            return {}
        dist = roles.train_dist
    coll = Collective(dist)
    echo = echo if coll.is_main else _quiet
    run_dir.mkdir(parents=True, exist_ok=True)
    # a Hub id's commit, written into config.yaml: resumes and exports read the same weights
    cfg.model.revision = pinned_revision(cfg.model.path, cfg.model.revision)
    if coll.is_main:
        save_config(cfg, run_dir / "config.yaml")
    ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint.keep, dist=coll.dist)
    clock = RunClock()
    trainer = RLTrainer(cfg, train_rows, held, dist=coll.dist, roles=roles)
    if coll.is_main:  # with what the trainer chose for auto keys (model.base_dtype)
        save_config(cfg, run_dir / "config.yaml")
    echo(f"orbitrl train: {cfg.algo.name} / {cfg.train.mode} on {trainer.policy.path.name} "
         f"({sum(p.numel() for p in trainer.policy.trainable):,} trainable params), "
         f"{len(train_rows)} train prompts, {len(held)} held-out")
    start = RunStart.begin(trainer, ckpt.latest() if resume else None, held, clock, echo)
    stopped = train_loop(trainer, cfg, coll, ckpt, run_dir, start, clock, held)
    ckpt.save(trainer, start.extra(clock), block=True)
    if stopped in ("SIGINT", "SIGTERM"):
        echo(f"stopped by {stopped} at step {trainer.iteration}; checkpoint written, "
             f"continue with: orbitrl train --resume {run_dir}")
        raise SystemExit(130 if stopped == "SIGINT" else 143)
    after = evaluate_after(trainer, held, start)
    save_policy(trainer, run_dir / "checkpoints" / "final")
    summary = run_summary(trainer, start, after, stopped, clock, coll)
    summary.update(schedule_summary(trainer, cfg, world, echo))
    if (warn := reward_gap_warning(cfg.reward.name, summary["heldout_accuracy_after"],
                                   summary["heldout_reward_after"], cfg.eval.warn_gap)):
        echo(warn)
        summary["reward_gap_warning"] = warn
    if coll.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if roles is not None:  # the rollout ranks waited through evaluation and checkpoints
        roles.finish()
    return summary


def schedule_summary(trainer, cfg: Config, world: int, echo) -> dict:
    """The shape and the rank split the measured rates propose (printed, and kept)."""
    s = cfg.schedule
    rollout = s.rollout_ranks if s.shape != "colocated" else world
    out = {"schedule_shape": s.shape, "world_size": world}
    if trainer.predictor is None:
        return out
    props = {n: trainer.predictor.balance(n) for n in sorted({world, 8} - {1})}
    for n, b in props.items():
        echo(balance_line(b, s.shape, rollout, world) if n == world else
             f"  at {n} ranks: rollout:training = {b['rollout']}:{b['train']}" if b else "")
    out["balance"] = {str(n): b for n, b in props.items()}
    return out


def check_rewards(cfg: Config):
    """Every named reward resolves (reward models load later, with the trainer)."""
    for name in [cfg.reward.name, *cfg.reward.extra]:
        if not str(name).startswith("rm:"):
            get_reward(name)


class RunClock:
    """Wall seconds of the run, those of the runs it continues included."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.prior = 0.0

    def wall(self) -> float:
        return self.prior + time.perf_counter() - self.t0


@dataclass
class RunStart:
    """Where the run starts: held-out accuracy before training (``number``: the built-in
    task's any-format accuracy, None elsewhere), every earlier step's mean reward, whether it
    continues a checkpoint."""
    acc: float
    number: float | None
    lenient: str | None
    rewards: list
    resumed: bool
    reward: float | None = None  # the held-out mean training reward before training

    @classmethod
    def begin(cls, trainer, latest: Path | None, held: list[dict], clock: RunClock, echo):
        cfg = trainer.cfg
        # the built-in task also reports whether the number was right in any format, so the
        # share of a gain that is arithmetic and the share that is answer format are visible
        lenient = "arithmetic" if not cfg.data.train and cfg.reward.name == "exact_match" \
            else None
        if latest is None:
            j = held_out(trainer, held)
            num = trainer.evaluate(held, lenient) if lenient else None
            echo(f"held-out accuracy before: {j.accuracy:.3f} (reward {j.reward:.3f})")
            return cls(j.accuracy, num, lenient, None, False, j.reward)
        x = resume_from(trainer, latest)["extra"]  # either format, at any world size
        clock.prior = x.get("wall_seconds", 0.0)
        echo(f"resumed from {latest} at step {trainer.iteration}")
        return cls(x["heldout_accuracy_before"], x.get("heldout_number_accuracy_before"),
                   lenient, list(x["rewards"]) if "rewards" in x else None, True,
                   x.get("heldout_reward_before"))

    def extra(self, clock: RunClock) -> dict:
        """What a checkpoint keeps of the run besides the trainer's state."""
        return {"heldout_accuracy_before": self.acc,
                "heldout_number_accuracy_before": self.number,
                "heldout_reward_before": self.reward,
                "wall_seconds": clock.wall(), "rewards": list(self.rewards)}


def train_loop(trainer, cfg: Config, coll, ckpt, run_dir: Path, start: RunStart,
               clock: RunClock, held: list[dict] | None = None) -> str:
    """Steps until ``train.max_steps``, the time budget or a signal; returns why it ended.
    With ``eval.every``, every N-th step's row also holds the held-out accuracy and reward
    (``heldout_accuracy``, ``heldout_reward``, ``heldout_rows``)."""
    log = RunLog(run_dir, cfg, coll, trainer.iteration)
    if start.rewards is None:  # every step's mean reward: the summary's averages
        start.rewards = [r["reward_mean"] for r in log.kept]
    stop = _StopSignals()
    if trainer.source.abandonable:
        # a stop request abandons the step in flight (minutes on a real model on CPUs);
        # overlapped, the producer is cancelled on close and the trained step finishes
        trainer.should_stop = lambda: stop.signal is not None
    budget, t_loop = cfg.train.max_seconds, time.perf_counter()
    bar = Progress(cfg.train.max_steps, budget, trainer.iteration,
                   disable=not (cfg.log.progress and coll.is_main))
    stopped = "max_steps"
    last_acc = None  # the latest in-run held-out accuracy, on the bar
    try:
        while trainer.iteration < cfg.train.max_steps:
            # ranks stop together (each later step is a collective): decisions are reduced
            if budget and coll.any(time.perf_counter() - t_loop > budget):
                stopped = "max_seconds"
                break
            if coll.any(stop.signal is not None):
                stopped = stop.signal or "SIGTERM"
                break
            row = coll.reduce_row(trainer.step())
            validate = bool(held) and cfg.eval.every > 0 and \
                trainer.iteration % cfg.eval.every == 0
            if validate:
                j = held_out(trainer, held, cfg.eval.rows, cfg.eval.max_seconds)
                row.update(heldout_accuracy=j.accuracy, heldout_reward=j.reward,
                           heldout_rows=j.n)
                last_acc = f"{j.accuracy:.3f}"
            row["wall_s"] = clock.wall()
            log.write(row, validate or trainer.iteration % cfg.log.every == 0)
            log.trajectories(trainer.last_trajectories)
            start.rewards.append(row["reward_mean"])
            recent = start.rewards[-20:]
            bar.update(trainer.iteration, reward=f"{sum(recent) / len(recent):.3f}",
                       kl=f"{row.get('kl', 0.0):.4f}",
                       **({"acc": last_acc} if last_acc is not None else {}))
            if cfg.checkpoint.every and trainer.iteration % cfg.checkpoint.every == 0:
                ckpt.save(trainer, start.extra(clock))
    except StepAbandoned:
        stopped = stop.signal or "SIGTERM"
    except KeyboardInterrupt:
        stopped = "SIGINT"
    finally:
        log.close()  # (with the run's last row, whatever ended the loop)
        trainer.close()
        bar.close()
        stop.restore()
    return stopped


class RunLog:
    """metrics.jsonl (and TensorBoard / wandb) on rank 0: each step once (rows logged after
    the checkpoint a run continues from are dropped), every ``log.every`` steps and the
    last one."""

    def __init__(self, run_dir: Path, cfg: Config, coll, iteration: int):
        path = run_dir / "metrics.jsonl"
        self.kept = [r for r in read_metrics(path) if r["step"] < iteration]
        main = coll.is_main
        if main:
            _rewrite_metrics(path, self.kept)
        self.writer = MetricsWriter(path) if main else _NoWriter()
        self.external = ExternalWriters(run_dir, cfg.log.tensorboard, cfg.log.wandb,
                                        cfg.to_dict()) if main else _NoWriter()
        self.pending = None
        self.traj_path = run_dir / "trajectories.jsonl" if main else None

    def trajectories(self, records: list[dict]):
        """Multi-turn runs: a few trajectories per step, as text (what the model called,
        what the environment answered)."""
        if self.traj_path is not None and records:
            with self.traj_path.open("a") as fh:
                for rec in records:
                    fh.write(json.dumps(rec) + "\n")

    def write(self, row: dict, now: bool):
        self.pending = row
        if now:
            self.writer.write(row)
            self.external.write(row)
            self.pending = None

    def close(self):
        if self.pending is not None:
            self.writer.write(self.pending)
            self.external.write(self.pending)
        self.writer.close()
        self.external.close()


def held_out(trainer, held: list[dict], rows: int = 0, max_seconds: float = 0.0):
    """Greedy completions of the held-out rows (the first ``rows``; 0: all) judged by the
    run's strict grader (``eval.grader``, rewards/graders.py), the training reward beside it
    (:class:`orbitrl.rl.evaluate.Judged`)."""
    return trainer.evaluator.judge(held[:rows or None], trainer.rewards, run_grader(trainer.cfg)[1],
                                   max_seconds,
                                   trainer.step_idx)


def evaluate_after(trainer, held: list[dict], start: RunStart) -> dict:
    """Held-out accuracy after training (and the built-in task's any-format accuracy)."""
    j = held_out(trainer, held)
    out = {"heldout_accuracy_after": j.accuracy, "heldout_reward_after": j.reward}
    if start.lenient:
        out["heldout_number_accuracy_after"] = trainer.evaluate(held, start.lenient)
    return out


def run_summary(trainer, start: RunStart, after: dict, stopped: str, clock: RunClock,
                coll) -> dict:
    """summary.json: held-out accuracy before and after, rewards, skips, memory."""
    cfg, rewards = trainer.cfg, start.rewards
    extra_acc = {}
    if start.lenient:
        extra_acc = {"heldout_number_accuracy_before": start.number,
                     "heldout_number_accuracy_after": after["heldout_number_accuracy_after"]}
    summary = {
        "heldout_accuracy_before": start.acc,
        "heldout_accuracy_after": after["heldout_accuracy_after"],
        "heldout_reward_before": start.reward,
        "heldout_reward_after": after["heldout_reward_after"],
        "heldout_grader": run_grader(cfg)[0],
        "steps": trainer.iteration, "optimizer_steps": trainer.step_idx, "stopped": stopped,
        "wall_seconds": clock.wall(),
        "reward_first_20": _mean(rewards[:20]), "reward_last_20": _mean(rewards[-20:]),
        "peak_memory_bytes": peak_rss_bytes(), "anchor_refreshes": trainer.anchors.events,
        **trainer.skip_counts(),
        "mode": cfg.train.mode, "algo": cfg.algo.name, "resumed": start.resumed,
        **(mem := trainer.mem.summary()),
        # what each role holds resident at the end (weights, optimizer state, the KV pool);
        # activations and gradients come and go within a phase (the measured phase peaks)
        "role_bytes": role_bytes({
            "actor": [trainer.model, trainer.opt],
            "critic": [trainer.critic.module, trainer.critic.opt] if trainer.critic else [],
            "reference": [trainer.policy.reference], "rollout_kv": [trainer.engine.cache]}),
        **extra_acc,
    }
    if coll.enabled:
        summary["world_size"] = coll.world
        peaks = coll.gather_objects(mem)
        summary["measured_peak_bytes_by_rank"] = [p["measured_peak_bytes"] for p in peaks]
        for ph in ("rollout", "score", "train"):
            summary[f"measured_{ph}_bytes_by_rank"] = [p.get(f"measured_{ph}_bytes")
                                                      for p in peaks]
    return summary


class Progress:
    """The run's bar. Without a time budget: steps against ``train.max_steps``. With
    ``train.max_seconds``: the share of whichever limit is nearer, so the bar fills as the
    run nears its end and tqdm's rate and ETA read as the time left; steps done and steps
    per second go in the postfix."""

    SCALE = 1000

    def __init__(self, max_steps: int, budget_s: float, start_step: int, disable: bool):
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
    coll = trainer.coll
    with coll.gathered(trainer.model):
        if coll.is_main:
            _save_policy(trainer, out)
    coll.barrier()


def _save_policy(trainer, out: Path):
    # adapters on a mixture's routed experts have no PEFT layout: merged weights instead
    if trainer.cfg.train.mode == "adapter" and not routed_adapters(trainer.model):
        # the base directory and the tokenizer beside the adapters: peft's
        # AutoPeftModelForCausalLM.from_pretrained(out) then needs nothing else
        base = resolve_model_path(trainer.cfg.model.path, trainer.cfg.model.revision).resolve()
        save_adapters(trainer.model, out, base_model_name_or_path=base,
                      trained_base=trainer.cfg.model.base_dtype)
        save_tokenizer(trainer.tok, out)
    else:  # (a model without native code: transformers writes it)
        save_pretrained(trainer.model, out, tokenizer=trainer.tok)


def _mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def _plan_rows(plan: dict | None) -> list[tuple[str, str]]:
    """The summary lines of a run from a plan file: its predictions against the measured."""
    if not plan:
        return []

    def row(entry: dict, fmt) -> str:
        p, m, r = entry.get("predicted"), entry.get("measured"), entry.get("ratio")
        return (f"{fmt(p) if p is not None else '-'} -> {fmt(m) if m is not None else '-'}"
                + (f" (x{r:.2f})" if r is not None else ""))

    return [("plan peak per device (planned -> measured)",
             row(plan["peak_bytes_per_device"], lambda b: f"{b / 2**20:.1f} MiB")),
            ("plan step time (planned -> measured)",
             row(plan["step_s"], lambda t: f"{t:.3g} s"))]


def print_summary(summary: dict, run_dir: Path, echo=print):
    rows = [("held-out accuracy before", f"{summary['heldout_accuracy_before']:.3f}"),
            ("held-out accuracy after", f"{summary['heldout_accuracy_after']:.3f}"),
            *([("held-out training reward (before -> after)",
                f"{summary['heldout_reward_before'] or 0.0:.3f} -> "
                f"{summary['heldout_reward_after']:.3f}")]
              if "heldout_reward_after" in summary else []),
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
            *_plan_rows(summary.get("plan")),
            ("run directory", str(run_dir))]
    w = max(len(k) for k, _ in rows)
    echo("-" * (w + 30))
    for k, v in rows:
        echo(f"{k:<{w}}  {v}")
    echo("-" * (w + 30))
