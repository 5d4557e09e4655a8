"""``train.offload_activations`` reaches the policy a run builds and moves exactly the layer
inputs recompute keeps to a host buffer and back (``decoder.ActivationOffload``), changing
no gradient and no step (CPU: the host copies are separate buffers, so the path runs)."""

import pytest
import torch

from orbitrl.config import load_config
from orbitrl.errors import OrbitError
from orbitrl.ledger.runtime import resolve_recompute
from orbitrl.rewards import register
from orbitrl.rl.batch import pack, score
from orbitrl.rl.policy import build_policy
from orbitrl.rl.types import Sample
from trainer_helpers import make_trainer


@register("test_length_offload", override=True)
def _length(prompt, completion, **f):
    return float(len(completion))  # varied rewards so gradients are non-zero


def _samples():
    return [Sample(0, [3, 4, 5, 6], [7, 8, 9], [-1.0] * 3, "stop", ""),
            Sample(0, [3, 4], [10, 11, 12, 13], [-1.0] * 4, "stop", "")]


def _flag(v: bool) -> str:
    return str(v).lower()


def test_key_moves_each_layer_input_to_the_host_and_keeps_the_gradients():
    runs = {}
    for offload in (False, True):
        cfg = load_config(None, ["train.mode=full", "train.recompute=true",
                                 f"train.offload_activations={_flag(offload)}"])
        policy = build_policy(cfg, torch.device("cpu"), reference=False)
        m = policy.model
        assert m.offload_activations is offload and m.recompute
        batch = pack(_samples(), "cpu")
        score(m, batch).sum().backward()
        assert all(p.grad is not None for p in policy.trainable)
        runs[offload] = (m, batch, [p.grad.clone() for p in policy.trainable])
    (m0, _, g0), (m1, batch, g1) = runs[False], runs[True]
    cfg = m1.config
    moved = cfg.num_layers * batch.input_ids.numel() * cfg.hidden_size * 4  # fp32
    off = m1.activation_offload
    assert off.tensors_stored == off.tensors_restored == cfg.num_layers
    assert off.bytes_to_host == off.bytes_from_host == moved > 0
    assert m0.activation_offload.bytes_to_host == 0  # without the key nothing moves
    for a, b in zip(g0, g1):
        torch.testing.assert_close(a, b, atol=0, rtol=0)  # the same bits come back
    # a forward without gradients (scoring, rollout) saves nothing, so moves nothing
    off.reset()
    with torch.no_grad():
        score(m1, batch)
    assert off.tensors_stored == off.bytes_to_host == 0


def test_key_implies_recompute_and_is_refused_without_it():
    cfg = load_config(None, ["train.offload_activations=true"])  # adapter mode, auto
    assert resolve_recompute(cfg, {}, 8)  # (auto in adapter mode is otherwise off)
    assert not resolve_recompute(load_config(None, []), {}, 8)
    with pytest.raises(OrbitError, match="train.offload_activations.*recompute"):
        load_config(None, ["train.offload_activations=true", "train.recompute=false"])


def test_training_run_with_the_key_takes_the_same_steps():
    """Two full-mode steps with and without the key (both with recompute): the same losses,
    norms and trained weights; the run with the key moved every layer input of every
    training forward to the host and back."""
    runs = {}
    for offload in (False, True):
        tr = make_trainer("rollout.prompts_per_step=2", "rollout.n=4", "rollout.max_tokens=4",
                          "data.heldout_size=8", "reward.name=test_length_offload",
                          "train.lr=1e-3", "train.mode=full", "train.optimizer=sgd",
                          "train.recompute=true", f"train.offload_activations={_flag(offload)}")
        assert tr.model.recompute and tr.model.offload_activations is offload
        rows = [tr.step() for _ in range(2)]
        runs[offload] = (tr, rows, [p.detach().clone() for p in tr.policy.trainable])
    (tr0, rows0, w0), (tr1, rows1, w1) = runs[False], runs[True]
    for a, b in zip(rows0, rows1):
        for k in ("loss", "grad_norm", "kl", "reward_mean"):
            assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-9), k
    for a, b in zip(w0, w1):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    off, cfg = tr1.model.activation_offload, tr1.model.config
    assert off.tensors_stored > 0 and off.tensors_stored % cfg.num_layers == 0
    assert off.tensors_restored == off.tensors_stored  # each came back in its backward
    assert off.bytes_from_host == off.bytes_to_host
    assert off.bytes_to_host % (cfg.num_layers * cfg.hidden_size * 4) == 0
    assert tr0.model.activation_offload.tensors_stored == 0
