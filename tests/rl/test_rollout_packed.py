"""Training rollouts on the engine's packed CPU path (``rollout.packed_weights``): the ledger
prices the copies in the rollout phase, ``auto`` takes what the rollout phase leaves below
the training peak, the step's rollout runs through the packed GEMMs and frees them after,
and the trainer multiplies the same weights on oneDNN: the rollout/trainer logprob gap is 0."""

import threading

import pytest

from orbitrl.config import load_config
from orbitrl.engine.packed import available, packable_bytes
from orbitrl.ledger import runtime
from orbitrl.model import gemm
from orbitrl.rl import rollout as rollout_mod
from trainer_helpers import make_trainer

pytestmark = pytest.mark.skipif(not available(), reason="this torch build has no oneDNN")

SMALL = ["rollout.prompts_per_step=2", "rollout.n=4", "rollout.max_tokens=6",
         "data.heldout_size=4", "model.base_dtype=fp32", "model.device=cpu"]
SMOL = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
            num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
            max_position_embeddings=8192, tie_word_embeddings=True)


def test_the_ledger_prices_the_copies_in_the_rollout_phase_only():
    cfg = load_config(None, ["model.path=x", "rollout.n=8", "rollout.prompts_per_step=4",
                             "rollout.max_tokens=16", "model.base_dtype=fp32"])
    plain = runtime.runtime_prediction(cfg, SMOL, 47, kv_blocks=64)
    packed = runtime.runtime_prediction(cfg, SMOL, 47, kv_blocks=64, packed_bytes=123456789)
    # oneDNN's state, kept after the copies, in every phase: SmolLM2's 4 projection shapes
    # (q and o are both 576 x 576), its head, and LoRA's 2 A and 3 B (all linear layers),
    # at 32 decode row counts and 4 of a step's
    shape = runtime.from_config(SMOL)
    assert runtime.routed_shapes(shape, 16) == 10 and runtime.routed_shapes(shape) == 5
    # (and the trainer's 8192-wide tiles of the 49,152-token head at the step's 4 counts)
    state = runtime.onednn_state_bytes(shape, 16, 32)
    assert state == runtime.ONEDNN_PRIMITIVE_BYTES * (10 * (32 + 4) + 1 * 4)
    # past 64 rows a rollout's decode counts are bucketed (model/gemm.py): 64 + 16 up to 128
    assert runtime.onednn_state_bytes(shape, 0, 128) == runtime.ONEDNN_PRIMITIVE_BYTES * (
        5 * (64 + 16 + 4) + 1 * 4)
    # a vocabulary whose last tile is narrower: two tile shapes; one within a tile: none
    odd = runtime.from_config({**SMOL, "vocab_size": 32000})
    assert runtime.onednn_state_bytes(odd, 0, 8) == runtime.ONEDNN_PRIMITIVE_BYTES * (
        5 * (8 + 4) + 2 * 4)
    small = runtime.from_config({**SMOL, "vocab_size": 8000})
    assert runtime.onednn_state_bytes(small, 0, 8) == runtime.ONEDNN_PRIMITIVE_BYTES * 5 * (
        8 + 4)
    assert packed["rollout"] - plain["rollout"] == 123456789 + state
    assert packed["terms"]["rollout"]["actor:packed_copy"] == 123456789
    for phase in ("score", "train"):
        assert packed[phase] == plain[phase] + state


@pytest.mark.parametrize("mode", ["adapter", "full"])
def test_a_training_rollout_runs_packed_and_frees_the_copies(mode, monkeypatch):
    made = []
    real_engine = rollout_mod.Engine

    def spy(*a, **kw):
        made.append(real_engine(*a, **kw))
        return made[-1]

    monkeypatch.setattr(rollout_mod, "Engine", spy)
    tr = make_trainer(*SMALL, f"train.mode={mode}", "rollout.packed_weights=on")
    engine = made[0]
    assert engine is tr.engine
    want = packable_bytes(tr.policy.model)
    assert want > 0 and engine.packed.planned_bytes == want
    held, served = [], set()
    real_generate, real_packed = engine.generate, engine.packed.packed

    def generate(*a, **kw):  # the packed path is what the step's rollout runs
        out = real_generate(*a, **kw)
        held.append(engine.packed.bytes)
        return out

    def packed(unit):  # a projection's GEMM asks for its unit's packed copy
        served.add(id(unit))
        return real_packed(unit)

    engine.generate, engine.packed.packed = generate, packed
    trainer_gemms = []
    real_apply = gemm.OneDNNLinear.apply
    monkeypatch.setattr(gemm.OneDNNLinear, "apply",
                        lambda *a: trainer_gemms.append(a[1].shape) or real_apply(*a))
    row = tr.step()
    assert held and held[-1] == want  # every copy made in the rollout
    assert served == {id(u) for u in engine.packed.units}  # and every unit's GEMM ran on it
    assert engine.packed.bytes == 0  # freed after the rollout: not in the train phase
    # the trainer multiplied the same weights on oneDNN (model/gemm.py), LoRA's A and B
    # too, and the rollout attended in fp64: the logprobs are the trainer's to the bit
    assert set(map(id, tr.policy.model.rollout_gemms)) >= set(map(id, engine.packed.mods))
    assert trainer_gemms and row["logprob_mismatch_max"] == 0
    # the copies and one unit's staging while it is packed (the built-in model's fused
    # q/k/v and gate/up groups are concatenated first)
    ws = engine.packed.workspace_bytes
    assert 0 < ws < want
    assert tr.mem.prediction["terms"]["rollout"]["actor:packed_copy"] == want + ws


def test_what_the_budget_leaves_out_runs_on_onednn_over_its_plain_weight(monkeypatch):
    """A rollout packs what fits its budget (SmolLM2's head stays out under auto); the rest
    multiplies on oneDNN over its plain weights in the engine, and in the trainer too, so
    the logprobs are still the trainer's to the bit (on MKL at a decode step's rows they
    were not: SmolLM2's gap up to 1.9e-5 with the head left out)."""
    real_budget = rollout_mod.packed_budget
    monkeypatch.setattr(rollout_mod, "packed_budget",
                        lambda *a: real_budget(*a) // 2)  # half of every unit's bytes
    tr = make_trainer(*SMALL, "rollout.packed_weights=on")
    packed = tr.engine.packed
    assert packed.mods and packed.plain  # some packed, the rest left out
    plain = {id(m.weight) for m in packed.plain}
    in_engine, in_trainer = set(), set()
    real_mm = gemm.onednn_mm

    def spy(x, w, b=None):  # who multiplied which weight on oneDNN
        (in_engine if threading.get_ident() == packed._thread else in_trainer).add(id(w))
        return real_mm(x, w, b)

    monkeypatch.setattr(gemm, "onednn_mm", spy)
    row = tr.step()
    assert plain <= in_engine  # the left-out weights ran on oneDNN in the rollout
    assert plain - {id(tr.policy.model.lm_head.weight)} <= in_trainer  # (the head in tiles)
    routed = set(map(id, tr.policy.model.rollout_gemms))
    assert {id(m) for m in packed.plain} <= routed
    assert row["logprob_mismatch_max"] == 0


def _prompt_len(tr) -> int:
    """The longest prompt as the trainer measured it (rl/trainer.py)."""
    return max(len(tr.encode(x[tr.cfg.data.prompt_field])) for x in tr.data.rows[:256])


def test_auto_packs_what_the_rollout_phase_leaves_below_the_training_peak(monkeypatch):
    small = make_trainer(*SMALL, "train.mode=full")  # rollout.packed_weights: auto
    assert packable_bytes(small.policy.model) < rollout_mod.PACKED_MIN_BYTES
    assert small.engine.packed.planned_bytes == 0  # the built-in model: too small to pack
    monkeypatch.setattr(rollout_mod, "PACKED_MIN_BYTES", 1)  # as if it were large
    tr = make_trainer(*SMALL, "train.mode=full")
    model, cfg, blocks = tr.policy.model, tr.cfg, tr.engine.pool.num_blocks
    planned = tr.engine.packed.planned_bytes
    assert planned > 0
    pred = tr.mem.prediction  # the run's own prediction, copies included
    ws = tr.engine.packed.workspace_bytes
    assert pred["terms"]["rollout"]["actor:packed_copy"] == planned + ws
    assert pred["rollout"] <= pred["train"] == pred["peak"]  # the copies never raise it
    prompt_len = _prompt_len(tr)
    plain = runtime.runtime_prediction(cfg, model.config.hf, prompt_len, kv_blocks=blocks,
                                       device="cpu", recompute=bool(model.recompute))
    budget = rollout_mod.packed_budget(cfg, model, prompt_len, blocks, tr.device, 1)
    assert budget == min(packable_bytes(model), plain["train"] - plain["rollout"] - ws)
    assert planned <= budget
    # a budget smaller than the whole model packs the units that fit, in turn
    monkeypatch.setattr(rollout_mod, "runtime_prediction", lambda *a, **kw: {
        "train": plain["rollout"] + packable_bytes(model) // 2 + ws,
        "rollout": plain["rollout"]})
    assert rollout_mod.packed_budget(cfg, model, prompt_len, blocks, tr.device, 1) == \
        packable_bytes(model) // 2
    # beside training (overlap) and with off: none
    for sets in (["rollout.overlap=true"], ["rollout.packed_weights=off"]):
        c = load_config(None, SMALL + sets)
        assert rollout_mod.packed_budget(c, model, prompt_len, blocks, tr.device, 1) == 0


def test_a_packed_rollout_alone_takes_every_core(monkeypatch):
    """rollout.threads auto: every core for a rollout that runs alone on packed weights
    (train.threads 1: the process runs one intra-op thread), the thread count restored
    after; the key's own value wins; the overlapped rollout (beside training), an unpacked
    engine and a process already on more threads keep theirs."""
    import torch

    from orbitrl.rl.parallel import intra_op_threads

    monkeypatch.setattr(rollout_mod, "cores", lambda: 4)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        packed = make_trainer(*SMALL, "rollout.packed_weights=on")
        seen = []
        real = packed.engine.generate
        packed.engine.generate = lambda *a, **kw: seen.append(torch.get_num_threads()) or \
            real(*a, **kw)
        assert packed.source.refill.rollouts.threads == 4
        packed.step()
        assert seen and set(seen) == {4} and torch.get_num_threads() == 1
        r = load_config(None, ["rollout.threads=3"]).rollout
        assert rollout_mod.rollout_threads(r, packed.engine, False) == 3
        auto = load_config(None, []).rollout
        assert rollout_mod.rollout_threads(auto, packed.engine, True) == 0  # torchrun
        over = load_config(None, ["rollout.overlap=true"]).rollout
        assert rollout_mod.rollout_threads(over, packed.engine, False) == 0
        plain = make_trainer(*SMALL, "rollout.packed_weights=off")
        assert plain.source.refill.rollouts.threads == 0
        with intra_op_threads(2):
            assert rollout_mod.rollout_threads(auto, packed.engine, False) == 0
    finally:
        torch.set_num_threads(before)
