"""Routing replay end to end: engine rollout -> Sample.routing -> packed batch -> trainer
forward. A near-tied router nudged between rollout and training (as a weight update nudges
it) flips experts: without replay the sampled tokens' logprobs move by whole experts; with
replay they stay at the engine's to 1e-5 (fp32)."""

import pytest
import torch

import orbitrl
from hf_helpers import gemm_rows_invariant
from orbitrl.engine import Engine, SamplingParams
from orbitrl.model import moe
from orbitrl.rl.batch import pack, score
from orbitrl.rl.routing import attach_routing, pack_routing, replay_check
from orbitrl.rl.rollout import generate as rollout


def _near_tied(path):
    """The tiny Qwen3-MoE with router logits of order 1e-6 (every choice a near tie) and
    experts far apart (a flip changes the output a lot)."""
    m = orbitrl.load_model(path)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for layer in m.model.layers:
            ffn = layer.mlp
            ffn.gate.weight.copy_(1e-6 * torch.randn(ffn.gate.weight.shape, generator=g))
            for ex in ffn.experts:
                for n in ex.names:
                    w = getattr(ex, n).weight
                    w.copy_(0.4 * torch.randn(w.shape, generator=g))
    return m


def _nudge_routers(m, scale=1e-6):
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for layer in m.model.layers:
            w = layer.mlp.gate.weight
            w.add_(scale * torch.randn(w.shape, generator=g))


@pytest.mark.parametrize("share_prompts", [True, False])
def test_replay_closes_the_gap_that_flips_open(hf_dirs, share_prompts):
    path, _ = hf_dirs["qwen3_moe"]
    m = _near_tied(path)
    eng = Engine(m, kv_budget_bytes=1 << 20, block_size=4)
    prompts = [[5, 6, 7, 8, 9], [20, 21, 22], [40, 41, 42, 43, 44, 45, 46]]
    samples = rollout(eng, prompts, [{}] * 3, SamplingParams(n=4, max_tokens=6), 0, seed=3)
    assert len(samples) == 12 and all(s.routing is not None for s in samples)
    _nudge_routers(m)
    part = pack(samples, "cpu", share_prompts=share_prompts)
    assert (part.parent_ids is not None) == share_prompts
    attach_routing(m, [part], [samples])
    with torch.no_grad():
        replayed = score(m, part, 1.0)
    gap = float((replayed - part.rollout_logp).abs()[part.mask.bool()].max())
    check = replay_check(m, [part], 1.0, step=0, every=1)
    print(f"share_prompts={share_prompts}: logprob gap with replay {gap:.2e}, without "
          f"{check['logprob_mismatch_max_noreplay']:.3f} (mean "
          f"{check['logprob_mismatch_mean_noreplay']:.3f}), flips "
          f"{check['routing_flip_frac']:.2f}")
    assert gap <= 1e-5
    assert check["routing_flip_frac"] > 0.05
    assert check["logprob_mismatch_max_noreplay"] > 0.1


def test_replay_off_records_nothing_and_checks_nothing(hf_dirs):
    path, _ = hf_dirs["qwen3_moe"]
    m = orbitrl.load_model(path)
    moe.configure(m, routing_replay=False)
    eng = Engine(m, kv_budget_bytes=1 << 20, block_size=4)
    samples = rollout(eng, [[1, 2, 3]], [{}], SamplingParams(n=2, max_tokens=3), 0, seed=1)
    assert all(s.routing is None for s in samples)
    part = pack(samples, "cpu")
    attach_routing(m, [part], [samples])
    assert part.routing is None and pack_routing(part, samples) is None
    assert replay_check(m, [part], 1.0, step=0, every=1) == {}


def test_pack_routing_places_each_token(hf_dirs):
    """Each packed token gets its own sample's record at its position; the shared prompt
    copy gets a member's prompt record; padding gets -1."""
    from orbitrl.rl.types import Sample

    def rec(tag, n):  # [1 layer, n, 1 slot]: tag * 100 + position
        return torch.tensor([[[tag * 100 + p] for p in range(n)]], dtype=torch.int16)

    s = [Sample(0, [1, 2], [3, 4], [0.0, 0.0], "length", "", routing=rec(1, 4)),
         Sample(0, [1, 2], [5], [0.0], "length", "", routing=rec(2, 3)),
         Sample(1, [7], [8, 9], [0.0, 0.0], "length", "", routing=rec(3, 3))]
    b = pack(s, "cpu", row_tokens=8)
    r = pack_routing(b, s)[0, :, 0]
    sid, pos = b.seq_ids.reshape(-1), b.positions.reshape(-1)
    for j in range(sid.numel()):
        i = int(sid[j])
        if i < 0:
            assert r[j] == -1
        else:
            tag = 1 if i >= 3 else i + 1  # the shared prompt (id >= B): sample 0's record
            assert r[j] == tag * 100 + int(pos[j]) or (i >= 3 and r[j] == 200 + int(pos[j]))


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "deepseek_v3"])
def test_engine_logprobs_equal_the_trainers_without_any_nudge(hf_dirs, family):
    """Same weights, replay on: the engine's sampled-token logprobs (paged attention over
    each sequence's own keys, decode steps of down to 1 token) equal the trainer's packed
    recomputation to the bit where this CPU's GEMMs round a row alike at the padded row
    counts (MKL's AVX-512 kernels: a gap of 0), and within the target 1e-5 on every ISA
    (AVX2: 4.8e-7 and 9.5e-7 measured). Before attention went through fp64 on CPUs and
    short GEMMs were padded, this check gave 9.5e-7 on AVX-512 (and learning runs' worst
    steps 1e-4)."""
    path, _ = hf_dirs[family]
    m = orbitrl.load_model(path)
    # built as an RL run's rollout engine is (rl/rollout.py): the trainer's GEMMs, no
    # oneDNN-packed copies (with those, a standalone engine rounds differently)
    eng = Engine(m, kv_budget_bytes=1 << 20, block_size=4, packed_bytes=0)
    prompts = [[5, 6, 7, 8, 9], [20, 21, 22], [40, 41, 42, 43, 44, 45, 46], [3]]
    samples = rollout(eng, prompts, [{}] * 4, SamplingParams(n=5, max_tokens=12), 0, seed=7)
    part = pack(samples, "cpu")
    attach_routing(m, [part], [samples])
    with torch.no_grad():
        got = score(m, part, 1.0)
    gap = float((got - part.rollout_logp).abs()[part.mask.bool()].max())
    print(f"{family}: engine-vs-trainer logprob gap {gap:.2e}")
    cfg = m.config
    e = cfg.moe.expert_intermediate
    shapes = [(cfg.hidden_size, e), (e, cfg.hidden_size), (cfg.hidden_size, cfg.vocab_size)]
    assert gap == 0.0 if all(gemm_rows_invariant(k, n) for k, n in shapes) else gap < 1e-5
