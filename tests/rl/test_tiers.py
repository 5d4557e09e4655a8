"""Full mode's device placement, ``train.recompute`` and ``train.tiers`` in real training runs
on the built-in model (CPU). Where the host and the compute device must differ, the compute
device is ``meta``: a tensor left on the host that meets a ``meta`` tensor is an error, as a
host tensor meeting a CUDA one is."""

import math

import pytest
import torch

from orbitrl.config import load_config
from orbitrl.errors import OrbitError
from orbitrl.rewards import register
from orbitrl.rl.anchors import Anchors
from orbitrl.rl.batch import pack, score
from orbitrl.rl.policy import build_policy, load_base, place_on_tiers
from orbitrl.rl.types import Sample
from trainer_helpers import make_trainer

SMALL = ["rollout.prompts_per_step=2", "rollout.n=4", "rollout.max_tokens=4",
         "data.heldout_size=8", "reward.name=test_length_tiers", "train.lr=1e-3"]


@register("test_length_tiers", override=True)
def _length(prompt, completion, **f):
    return float(len(completion))  # varied rewards so gradients are non-zero


def make(*over):
    return make_trainer(*SMALL, *over)


def _samples():
    return [Sample(0, [3, 4, 5, 6], [7, 8, 9], [-1.0] * 3, "stop", ""),
            Sample(0, [3, 4], [10, 11, 12, 13], [-1.0] * 4, "stop", "")]


def _device_check(model, device, seen: list):
    """Forward pre-hooks on every decoder layer: each input and each of the layer's
    parameters and buffers is on ``device`` when the layer runs."""
    def hook(module, args):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        tensors += list(module.parameters()) + list(module.buffers())
        seen.append({t.device.type for t in tensors})
    return [layer.register_forward_pre_hook(hook) for layer in model.model.layers]


def test_full_mode_reference_computes_on_the_compute_device():
    """The reference forward as the trainer's scoring runs it (``anchors.anchored()``), with
    the compute device distinct from the host: every reference layer runs on the compute
    device, and the int8 host copy stays the storage."""
    cfg = load_config(None, ["train.mode=full"])
    dev = torch.device("meta")
    policy = build_policy(cfg, dev)
    assert policy.reference_residency is not None and policy.reference.device == dev
    batch = pack(_samples(), dev)
    seen: list = []
    handles = _device_check(policy.reference, dev, seen)
    with torch.no_grad(), Anchors(policy.model, policy.reference).anchored() as ref:
        hidden = ref(batch.input_ids, positions=batch.positions, seq_ids=batch.seq_ids,
                     return_hidden=True)
    for h in handles:
        h.remove()
    assert hidden.device == dev and hidden.shape == (1, batch.num_tokens, 128)
    assert seen == [{"meta"}] * 4  # 4 layers, each wholly on the compute device
    res = policy.reference_residency
    assert all(L.state == "cold" for L in res.layers)  # released after use
    assert res.stats.misses == 1 and res.stats.hits == 3  # the rest were prefetched
    for L in res.layers:
        w = L.host["self_attn.q_proj.weight"]
        assert w.device.type == "cpu" and w.qdata.dtype == torch.int8
    # the failure this guards against: a reference left on the host, fed device tensors
    host_ref = load_base(policy.path, "int8", "float32", "cpu")
    with pytest.raises((RuntimeError, NotImplementedError)):
        with torch.no_grad():
            host_ref(batch.input_ids, positions=batch.positions, seq_ids=batch.seq_ids)


def test_reference_pulled_layer_by_layer_scores_as_the_resident_one():
    """The copy path (distinct hot buffers on the host) gives the resident reference's
    logprobs exactly, and moves every int8 layer once per forward."""
    cfg = load_config(None, [])
    from orbitrl.model.builtin import resolve_model_path

    path = resolve_model_path(cfg.model.path)
    resident = load_base(path, "int8", "float32", "cpu")
    tiered = load_base(path, "int8", "float32", "cpu")
    res = place_on_tiers(tiered, torch.device("cpu"), 2)
    assert res.copy and res.stats.host_bytes > 0
    batch = pack(_samples(), "cpu")
    with torch.no_grad():
        want = score(resident, batch)
        got = score(tiered, batch)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert res.stats.bytes_from_host == res.stats.host_bytes
    assert res.stats.peak_resident_layers == 3


def _count_layer_forwards(model) -> tuple[dict, list]:
    """Counts decoder-layer forwards: with gradients (training's forward), and inside a
    backward (recomputation)."""
    counts = {"backward": 0, "grad": 0}

    def hook(module, args):
        if torch._C._current_graph_task_id() != -1:
            counts["backward"] += 1
        elif torch.is_grad_enabled():
            counts["grad"] += 1
    return counts, [layer.register_forward_pre_hook(hook) for layer in model.model.layers]


@pytest.mark.parametrize("mode", ["adapter", "full"])
def test_recompute_changes_nothing_and_recomputes(mode):
    """``train.recompute`` reaches the model: in a training step every decoder layer that ran
    with gradients runs again in backward, and losses, gradient norms and the trained
    weights are the same."""
    runs = {}
    for recompute in (False, True):
        tr = make(f"train.mode={mode}", f"train.recompute={str(recompute).lower()}",
                  "train.optimizer=sgd" if mode == "full" else "train.optimizer=auto")
        assert tr.model.recompute is recompute
        counts, handles = _count_layer_forwards(tr.model)
        rows = [tr.step() for _ in range(2)]
        for h in handles:
            h.remove()
        runs[recompute] = (rows, [p.detach().clone() for p in tr.policy.trainable], counts)
    (rows0, w0, c0), (rows1, w1, c1) = runs[False], runs[True]
    assert c0["backward"] == 0 and c0["grad"] > 0
    assert c1["backward"] == c1["grad"] == c0["grad"]  # each layer once more, in backward
    for a, b in zip(rows0, rows1):
        for k in ("loss", "grad_norm", "kl", "reward_mean"):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), k
    for a, b in zip(w0, w1):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_tiers_train_as_resident_and_prefetch():
    """A full-mode run with ``train.tiers: 1`` takes the same steps as the resident run
    (the policy's layers and the reference's copied in, the updated ones written back),
    and its layers arrive prefetched."""
    runs = {}
    for tiers in (0, 1):
        # (the resident run's rollouts would run on packed weights, which the tiered run's
        # hooks rule out: the same GEMMs on both sides)
        tr = make("train.mode=full", f"train.tiers={tiers}", "algo.check=true",
                  "rollout.packed_weights=off")
        rows = [tr.step() for _ in range(2)]
        runs[tiers] = (tr, rows)
    (tr0, rows0), (tr1, rows1) = runs[0], runs[1]
    assert tr0.policy.residency is None and not tr0.model.recompute
    assert tr1.model.recompute  # tiers imply recompute
    for a, b in zip(rows0, rows1):
        assert b["step_skipped"] == 0 and math.isfinite(b["grad_norm"])
        for k in ("loss", "grad_norm", "kl", "reward_mean", "update_norm"):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), k
    # at rest the tiered layers show their host copies: the trained weights
    for (n, p), q in zip(tr1.model.named_parameters(), tr0.model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=n)
    s = tr1.policy.residency.stats
    layers = len(tr1.policy.residency.layers)
    assert s.hits > s.misses > 0  # layer 0 of each forward misses, the others were prefetched
    assert s.bytes_written_back == 2 * s.host_bytes  # every layer updated once per step
    assert s.peak_resident_layers <= 1 + 2 < layers  # k + 2 at most, k = 1
    r = tr1.policy.reference_residency.stats
    assert r.hits > 0 and r.bytes_from_host == 2 * r.host_bytes  # one reference pass a step
    assert r.bytes_written_back == 0


def test_tiers_config_errors():
    with pytest.raises(OrbitError, match="train.tiers"):
        load_config(None, ["train.tiers=2"])  # adapter mode
    with pytest.raises(OrbitError, match="train.tiers"):
        load_config(None, ["train.mode=full", "train.optimizer=adamw", "train.tiers=2"])
    with pytest.raises(OrbitError, match="train.tiers"):
        load_config(None, ["train.mode=full", "train.tiers=-1"])


def test_tiers_checkpoint_round_trip():
    """A checkpoint of a tiered run holds the trained weights (the host copies at rest), and
    restoring it into the tiered model replays the next step exactly."""
    from orbitrl.rl.checkpoint import capture, restore

    tr = make("train.mode=full", "train.tiers=1", "algo.anchor_refresh_steps=1")
    host_q = tr.policy.reference_residency.layers[0].host["self_attn.q_proj.weight"]
    q0 = host_q.qdata.clone()
    tr.step()
    # the anchor moved: the int8 reference re-quantized from the tiered policy, in place in
    # its host copy
    assert tr.anchors.events and not torch.equal(host_q.qdata, q0)
    w = tr.model.model.layers[0].self_attn.q_proj.weight.detach()
    torch.testing.assert_close(host_q.dequantize(torch.float32), w, rtol=0,
                               atol=float(w.abs().max()) / 100)
    state = capture(tr, {})
    assert all(t.numel() == p.numel() for t, p in zip(state["trainable"], tr.policy.trainable))
    row_a = tr.step()
    after_a = [p.detach().clone() for p in tr.model.parameters()]
    restore(tr, state)
    row_b = tr.step()
    for k in ("loss", "grad_norm", "kl", "reward_mean"):
        assert row_a[k] == row_b[k], k
    for a, b in zip(after_a, tr.model.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_resident_bytes_count_the_compute_device_only():
    """The KV pool is sized from what is already on the compute device; a host tier (the
    pinned layer copies of a tiered policy or reference) is not on it."""
    from orbitrl.model.quant import FrozenLinear
    from orbitrl.observe.memory import tensor_bytes

    lin = FrozenLinear.from_linear(torch.nn.Linear(64, 32, bias=False), "int8")
    host = [torch.zeros(1000), lin]  # fp32 [1000]; int8 [32, 64] + fp32 scale + int8 zero
    whole = 4000 + 32 * 64 + 32 * 4 + 32
    assert tensor_bytes(*host) == tensor_bytes(*host, device="cpu") == whole
    assert tensor_bytes(*host, device="cuda") == 0
