"""Micro-batches side by side on CPU threads (train.workers)."""

import threading

import pytest
import torch

import orbitrl.rl.update as update_mod
from orbitrl.config import load_config
from orbitrl.rl.parallel import Workers, resolve_workers, split_parts
from orbitrl.rl.types import Sample
from trainer_helpers import make_trainer

SMALL = ["rollout.prompts_per_step=4", "rollout.n=4", "rollout.max_tokens=4",
         "data.heldout_size=8", "model.base_dtype=int8", "model.device=cpu",
         "train.deterministic=true"]


def make(*over):
    return make_trainer(*SMALL, *over)


def sample(group, n_prompt, n_completion):
    return Sample(group, [1] * n_prompt, [2] * n_completion, [0.0] * n_completion, "stop", "")


def test_split_keeps_a_prompts_samples_together_and_balances_tokens():
    samples = [sample(g, 10, 5) for g in range(4) for _ in range(3)]  # 4 prompts x 3
    parts = split_parts([list(range(12))], samples, 2)
    assert parts == [list(range(6)), list(range(6, 12))]
    parts = split_parts([list(range(12))], samples, 3)
    assert sorted(i for p in parts for i in p) == list(range(12)) and len(parts) == 3
    for p in parts:  # no prompt cut across micro-batches
        groups = {samples[i].group for i in p}
        assert all(samples[j].group not in groups for q in parts if q is not p for j in q)
    one = [sample(0, 10, 5) for _ in range(3)]  # one prompt: cut between its samples
    assert split_parts([[0, 1, 2]], one, 2) == [[0], [1, 2]]
    assert split_parts([[0]], one[:1], 4) == [[0]]


def test_workers_map_keeps_order_and_raises_after_the_others_finish():
    w = Workers(2)
    names = set()

    def f(x):
        names.add(threading.current_thread().name)
        return x * x

    assert w.map(f, list(range(7))) == [x * x for x in range(7)]
    assert any(n.startswith("orbitrl-mb") for n in names) and "MainThread" in names
    done = []

    def g(x):
        if x == 0:
            raise ValueError("boom")
        done.append(x)

    with pytest.raises(ValueError, match="boom"):
        w.map(g, [0, 1])
    assert done == [1]
    with torch.no_grad():  # grad mode follows the caller onto the pool's thread
        assert w.map(lambda _: torch.is_grad_enabled(), [0, 1]) == [False, False]
    w.close()


def test_auto_workers_only_where_micro_batches_can_run_side_by_side():
    cfg = load_config(None, SMALL)
    cpu = torch.device("cpu")
    assert resolve_workers(cfg, cpu, False, False, False) in (1, 2)
    assert resolve_workers(cfg, cpu, True, False, False) == 1  # torchrun
    assert resolve_workers(cfg, cpu, False, True, False) == 1  # fused optimizer
    assert resolve_workers(cfg, cpu, False, False, True) == 1  # PPO's critic
    assert resolve_workers(cfg, cpu, False, False, False, mixture=True) == 1
    assert resolve_workers(cfg, torch.device("cuda"), False, False, False) == 1
    for over in ("train.threads=2", "lora.dropout=0.1", "train.mode=full",
                 "rollout.overlap=true"):
        cfg = load_config(None, SMALL + ["train.workers=2", over])
        assert resolve_workers(cfg, cpu, False, False, False) == 1, over
    cfg = load_config(None, SMALL + ["train.workers=2"])
    assert resolve_workers(cfg, cpu, False, False, False) == 2
    with pytest.raises(Exception, match="train.workers"):
        load_config(None, ["train.workers=-1"])


def test_step_metrics_sum_the_loss_and_weigh_means_by_tokens():
    from orbitrl.rl.update import mean_metrics

    mbs = [{"loss": 0.25, "entropy": 1.0, "ratio_max": 1.5, "_tokens": 30.0},
           {"loss": 0.5, "entropy": 4.0, "ratio_max": 1.2, "_tokens": 10.0}]
    out = mean_metrics(mbs)
    assert out == {"loss": 0.75, "entropy": (30 + 40) / 40, "ratio_max": 1.5}
    assert mean_metrics(mbs + mbs, epochs=2)["loss"] == 0.75


def test_adamw_is_fused_only_over_contiguous_tensors_and_gradients_keep_the_layout():
    from types import SimpleNamespace

    from orbitrl.rl.parallel import accumulate
    from orbitrl.rl.update import build_optimizer

    t = SimpleNamespace(optimizer="adamw", mode="adapter", lr=1e-2, weight_decay=0.0)
    flat = [torch.nn.Parameter(torch.randn(4, 5))]
    assert build_optimizer(t, flat, None).defaults["fused"]
    stacked = torch.randn(4, 10)
    view = torch.nn.Parameter(stacked[:, :5])  # an expert's slice of stacked weights
    assert not view.is_contiguous()
    opt = build_optimizer(t, [view], None)
    assert not opt.defaults["fused"]
    before = stacked.clone()
    view.grad = torch.ones(4, 5)
    opt.step()  # the slice moves, its neighbours do not
    assert torch.equal(stacked[:, 5:], before[:, 5:]) and not torch.equal(stacked, before)
    col = torch.nn.Parameter(torch.randn(5, 4).t())  # column-major parameter
    accumulate([col], [[torch.ones(4, 5)]])
    assert col.grad.stride() == col.stride() and torch.equal(col.grad, torch.ones(4, 5))


def test_two_workers_are_bitwise_one_worker_on_the_same_micro_batches(monkeypatch):
    """Two workers against one, both cutting the batch into the same micro-batches
    (micro_batch_tokens): the same adapters to the bit after three steps, the same logged
    loss and KL; the passes spread over two threads."""
    cut = "train.micro_batch_tokens=64"
    par = make("train.workers=2", cut)
    assert par.workers.n == 2
    seen = set()
    score = update_mod.score

    def spy(*a, **k):
        seen.add(threading.current_thread().name)
        return score(*a, **k)

    monkeypatch.setattr(update_mod, "score", spy)
    rows_par = [par.step() for _ in range(3)]
    assert "MainThread" in seen and any(n.startswith("orbitrl-mb") for n in seen)
    monkeypatch.undo()

    ser = make("train.workers=1", cut)
    assert ser.workers.n == 1
    rows_ser = [ser.step() for _ in range(3)]
    for a, b in zip(par.policy.trainable, ser.policy.trainable):
        assert torch.equal(a, b)
    for a, b in zip(rows_par, rows_ser):
        assert a["loss"] == b["loss"] and a["kl"] == b["kl"]
    assert par.policy.trainable[1].abs().sum() > 0  # the adapters did move
