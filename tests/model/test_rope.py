"""Rope scaling types yarn, longrope and dynamic NTK (and Phi-3's partial rotary) against
transformers: logits within 1e-5 on sequences that cross each type's switch length, and
the same checks failing when the scaling is dropped; the engine's and the trainer's
logprobs agreeing past the switch (check-alignment). The engine's greedy decoding against
transformers' generate is in tests/engine/test_engine.py.

longrope and dynamic choose frequencies by sequence length in transformers (per forward:
``max(position_ids) + 1``); orbitrl chooses per token (``position + 1``), which is what
transformers computes when it decodes one token at a time (rope.py). So the reference past
the switch is transformers run incrementally: a prefill within the switch, then one token
per forward over its KV cache."""

import json
import shutil

import pytest
import torch

import orbitrl
from hf_helpers import PHI3_SWITCH, ROPE_CONFIGS, ROPE_SWITCH, make_hf_model
from orbitrl.cli import main
from orbitrl.errors import OrbitError
from orbitrl.model.builtin import resolve_model_path
from orbitrl.model.config import ModelConfig

ROPES = list(ROPE_CONFIGS)


@pytest.fixture(scope="module")
def rope_dirs(tmp_path_factory):
    out = {}
    for rope in ROPES + ["phi3"]:
        d = tmp_path_factory.mktemp(rope)
        m = make_hf_model(rope, **PHI3_SWITCH if rope == "phi3" else {})
        m.save_pretrained(d)
        out[rope] = (d, m)
    return out


def _incremental_logits(hf, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """transformers' logits for ``ids`` [1, T]: ``prefill`` tokens in one forward, then one
    token per forward over the cache (what generate computes)."""
    with torch.no_grad():
        out = hf(ids[:, :prefill], use_cache=True)
        logits, cache = [out.logits], out.past_key_values
        for t in range(prefill, ids.shape[1]):
            out = hf(ids[:, t:t + 1], cache=cache, use_cache=True)
            logits.append(out.logits)
            cache = out.past_key_values
    return torch.cat(logits, 1)


def _dropped_scaling(path, tmp_path):
    """The same checkpoint with its rope scaling removed from config.json."""
    cfg = json.loads((path / "config.json").read_text())
    for k in ("rope_scaling", "rope_parameters"):
        if isinstance(cfg.get(k), dict):
            cfg[k] = {"rope_type": "default", **{x: cfg[k][x] for x in (
                "rope_theta", "partial_rotary_factor") if x in cfg[k]}}
    out = tmp_path / "dropped"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "model.safetensors").symlink_to(path / "model.safetensors")
    return orbitrl.load_model(out)


@pytest.mark.parametrize("rope", ROPES + ["phi3"])
def test_logits_across_the_switch_match_transformers(rope_dirs, rope, tmp_path):
    path, hf = rope_dirs[rope]
    ours = orbitrl.load_model(path)
    assert ours.config.rope_type == ("longrope" if rope == "phi3" else rope)
    assert ours.config.num_params == sum(p.numel() for p in hf.parameters())
    g = torch.Generator().manual_seed(4)
    short = torch.randint(0, 97, (2, 11), generator=g)  # within the switch: one forward
    long = torch.randint(0, 97, (1, 3 * ROPE_SWITCH), generator=g)
    want_long = _incremental_logits(hf, long, ROPE_SWITCH - 3)
    with torch.no_grad():
        want_short = hf(short).logits
        assert (ours(short) - want_short).abs().max().item() < 1e-5
        assert (ours(long) - want_long).abs().max().item() < 1e-5
        # a packed row (positions restarting per sequence, as the trainer packs) gives
        # each sequence its own positions' frequencies
        seqs = [long[0, :40].tolist(), short[0].tolist(), long[0, :25].tolist()]
        ids, pos, sid = ours.packed_inputs(seqs)
        packed = ours(ids, positions=pos, seq_ids=sid)[0]
        assert (packed[:40] - want_long[0, :40]).abs().max().item() < 1e-5
        assert (packed[51:] - want_long[0, :25]).abs().max().item() < 1e-5
        # the checks fail without the scaling: at the long length for every type, and
        # within the switch too for those that scale there (not dynamic NTK)
        plain = _dropped_scaling(path, tmp_path)
        assert (plain(long) - want_long).abs().max().item() > 1e-3
        if rope != "dynamic":
            assert (plain(short) - want_short).abs().max().item() > 1e-3


@pytest.mark.parametrize("rope", ["yarn", "longrope", "phi3"])
def test_attention_factor_matters(rope_dirs, rope, monkeypatch):
    """yarn and longrope scale cos and sin by an attention factor: without it the logits
    leave transformers'."""
    from orbitrl.model import rope as rope_mod

    path, hf = rope_dirs[rope]
    ours = orbitrl.load_model(path)
    assert ours.rotary.scale > 1.05
    monkeypatch.setattr(rope_mod, "attention_factor", lambda cfg: 1.0)
    unscaled = orbitrl.load_model(path)
    ids = torch.randint(0, 97, (1, 11), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = hf(ids).logits
        assert (ours(ids) - want).abs().max().item() < 1e-5
        assert (unscaled(ids) - want).abs().max().item() > 1e-4


def test_dynamic_frequencies_per_token():
    """Dynamic NTK past max_position_embeddings: each token's frequencies are transformers'
    for seq_len = position + 1 (its growth branch) to an fp32 ulp, within it the init ones
    exactly; and a position's tables are the same bits whatever batch it is computed in
    (an engine step against a trainer row)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from orbitrl.model.rope import Rotary

    kw = dict(ROPE_CONFIGS["dynamic"])
    hf_cfg = AutoConfig.for_model(kw.pop("model_type"), vocab_size=97, hidden_size=64,
                                  num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=96, num_hidden_layers=1, **kw)
    rot = Rotary(ModelConfig.from_hf(hf_cfg.to_dict()))
    pos = torch.arange(300)[None]
    inv = rot._beyond(pos)[0]
    init, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf_cfg, "cpu")
    assert torch.equal(rot._inv_cpu, init)
    for p in range(16, 300):
        want = ROPE_INIT_FUNCTIONS["dynamic"](hf_cfg, "cpu", seq_len=torch.tensor(p + 1))[0]
        assert ((inv[p] - want).abs() / want).max().item() < 2.5e-7  # an fp32 ulp
    cos, sin = rot(pos, torch.float32)
    for rows in ([0, 17, 40], [299, 16], list(range(5, 300, 7))):
        c, s = rot(torch.tensor([rows]), torch.float32)
        assert torch.equal(c[0], cos[0, rows]) and torch.equal(s[0], sin[0, rows])


BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)


def test_phi3_config_rules_follow_transformers():
    """Phi-3's older rope names (``su``, ``yarn``) are its longrope; the top-level
    original_max_position_embeddings wins (4096 when absent); partial_rotary_factor from
    beside the rotary parameters or inside them; no biases; a sliding window on every
    layer."""
    lr = {"short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
    for kind in ("su", "yarn", "longrope"):
        c = ModelConfig.from_hf(dict(BASE, model_type="phi3", rope_scaling=dict(lr, type=kind)))
        assert c.rope_type == "longrope"
        assert c.rope_params["original_max_position_embeddings"] == 4096
    c = ModelConfig.from_hf(dict(BASE, model_type="phi3", original_max_position_embeddings=64,
                                 attention_bias=True, sliding_window=7,
                                 partial_rotary_factor=0.5,
                                 rope_scaling=dict(lr, rope_type="longrope",
                                                   original_max_position_embeddings=8,
                                                   short_factor=[1.0] * 2,
                                                   long_factor=[2.0] * 2)))
    assert c.rope_params["original_max_position_embeddings"] == 64
    assert c.rotary_dim == 4 and c.fused_proj and not c.qkv_bias and not c.o_bias
    assert c.sliding_windows == [7, 7]
    c = ModelConfig.from_hf(dict(BASE, model_type="phi3",
                                 rope_parameters={"rope_type": "default",
                                                  "partial_rotary_factor": 0.75}))
    assert c.rotary_dim == 6 and c.rope_type == "default"


@pytest.mark.parametrize("over,match", [
    (dict(model_type="phi3", rope_scaling={"type": "su", "long_factor": [2.0] * 4}),
     r"rope_scaling\.short_factor is missing"),
    (dict(model_type="phi3", rope_scaling={"type": "longrope", "short_factor": [1.0] * 3,
                                           "long_factor": [2.0] * 4}),
     r"rope_scaling\.short_factor must be a list of 4 numbers"),
    (dict(model_type="llama", rope_parameters={"rope_type": "yarn"}),
     r"rope_parameters\.factor is missing"),
    (dict(model_type="llama", rope_scaling={"rope_type": "dynamic"}),
     r"rope_scaling\.factor is missing"),
    (dict(model_type="llama", rope_scaling={"rope_type": "proportional", "factor": 2.0}),
     r"unsupported rope type 'proportional'"),
    (dict(model_type="phi3", partial_rotary_factor=0.2), r"partial_rotary_factor 0\.2"),
])
def test_bad_rope_configs_name_the_key(over, match):
    with pytest.raises(OrbitError, match=match):
        ModelConfig.from_hf(dict(BASE, **over))


def test_yarn_truncate_and_attention_factor_keys():
    """yarn's optional keys: truncate false keeps the fractional correction range, mscale /
    mscale_all_dim set the attention factor, an explicit attention_factor wins."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from orbitrl.model.rope import attention_factor, inv_frequencies

    for extra in [dict(truncate=False), dict(mscale=1.0, mscale_all_dim=0.5),
                  dict(attention_factor=1.3, beta_fast=16, beta_slow=2)]:
        rope = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, **extra)
        hf_cfg = AutoConfig.for_model("llama", **dict(BASE, rope_scaling=rope,
                                                      max_position_embeddings=128))
        want, af = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
        ours = ModelConfig.from_hf(hf_cfg.to_dict())
        assert torch.equal(inv_frequencies(ours), want) and attention_factor(ours) == af


@pytest.mark.parametrize("rope", ROPES + ["phi3"])
def test_engine_and_trainer_agree_past_the_switch(rope, tmp_path):
    """``orbitrl check-alignment`` over sequences longer than the switch (16 tokens): the
    engine's prefill chunks and decode steps and the trainer's packed rows rotate each
    token alike."""
    make_hf_model(rope, vocab_size=128,
                  **PHI3_SWITCH if rope == "phi3" else {}).save_pretrained(tmp_path)
    tok = resolve_model_path("builtin:tiny-arith")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tok / f, tmp_path / f)
    out = tmp_path / "a.json"
    assert main(["check-alignment", "--model", str(tmp_path), "--json", str(out)]) == 0
    m = json.loads(out.read_text())
    assert m["aligned"] and m["positions"] >= 3 * ROPE_SWITCH
    assert m["logprob_gap_max"] <= 1e-5 and m["topk_agreement"] == 1.0
