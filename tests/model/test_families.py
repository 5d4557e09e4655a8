"""The families added beside Llama/Qwen (SmolLM3's NoPE layers, OLMo 2/3's post-norm blocks
and whole-projection q/k norms, Gemma 2/3's (1+w) sandwich norms, soft-capping, scaled
embeddings and per-layer-kind rotaries, Phi-3's fused projections, gpt-oss's attention sinks
and biased, clamped mixture, DeepSeek-V3's latent attention and grouped sigmoid routing)
through the paths a run takes: the engine's and the trainer's logprobs agree (`orbitrl
check-alignment`), and a GRPO step runs in adapter and full mode. Logits, engine greedy
decoding, peft adapters and exports against transformers are in test_parity.py,
tests/engine/test_engine.py and test_adapters_peft.py."""

import json
import math
import shutil

import pytest
import torch

import orbitrl
from hf_helpers import make_hf_model
from orbitrl.cli import main
from orbitrl.errors import OrbitError
from orbitrl.ledger.models import from_config
from orbitrl.model.builtin import resolve_model_path
from orbitrl.model.config import ModelConfig
from orbitrl.model.decoder import _embed_scale

FAMILIES = ["smollm3", "olmo2", "olmo3", "gemma2", "gemma3_text", "phi3", "gpt_oss",
            "deepseek_v3"]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """family -> a random tiny checkpoint with the built-in character tokenizer."""
    out = {}
    tok = resolve_model_path("builtin:tiny-arith")
    for fam in FAMILIES:
        d = tmp_path_factory.mktemp(fam)
        make_hf_model(fam, vocab_size=128).save_pretrained(d)
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(tok / f, d / f)
        out[fam] = d
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_and_trainer_logprobs_agree(family_dirs, family, tmp_path):
    out = tmp_path / "a.json"
    assert main(["check-alignment", "--model", str(family_dirs[family]),
                 "--json", str(out)]) == 0
    m = json.loads(out.read_text())
    assert m["aligned"] and m["positions"] >= 8
    assert m["logprob_gap_max"] <= 1e-5 and m["topk_agreement"] == 1.0


@pytest.mark.parametrize("family,mode", [("smollm3", "adapter"), ("olmo2", "full"),
                                         ("olmo3", "adapter"), ("gemma2", "full"),
                                         ("gemma3_text", "adapter"), ("phi3", "adapter"),
                                         ("phi3", "full"), ("gpt_oss", "adapter"),
                                         ("gpt_oss", "full"), ("deepseek_v3", "adapter"),
                                         ("deepseek_v3", "full")])
def test_a_grpo_step_runs(family_dirs, family, mode, tmp_path):
    assert main(["train", "--set", f"model.path={family_dirs[family]}",
                 "--set", f"train.mode={mode}", "--set", "train.max_steps=2",
                 "--set", "rollout.prompts_per_step=2", "--set", "rollout.n=2",
                 "--set", "rollout.max_tokens=6", "--set", "data.heldout_size=2",
                 "--set", "log.progress=false", "--set", "checkpoint.every=0",
                 "--out", str(tmp_path / "run")]) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["skipped_nonfinite"] == 0 for r in rows)


def test_config_defaults_follow_transformers():
    """Keys a config may leave out take transformers' defaults: SmolLM3 makes every 4th layer
    NoPE and ties its head; an OLMo 3 flat rope scaling (full-attention layers only) is
    refused rather than applied to every layer."""
    from orbitrl.errors import OrbitError
    from orbitrl.model.config import ModelConfig

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                num_attention_heads=4, num_key_value_heads=2)
    c = ModelConfig.from_hf(dict(base, model_type="smollm3"))
    assert c.rope_layers == [True, True, True, False] * 2 and c.tie_word_embeddings
    assert ModelConfig.from_hf(dict(base, model_type="olmo3")).post_norm
    with pytest.raises(OrbitError, match="OLMo 3 rope scaling"):
        ModelConfig.from_hf(dict(base, model_type="olmo3",
                                 rope_scaling={"rope_type": "yarn", "factor": 8.0}))


@pytest.mark.parametrize("family", ["olmo2", "gemma2", "gemma3_text"])
def test_param_count_matches_transformers(hf_dirs, family):
    """ModelConfig.num_params (what the ledger's step figures use) counts every norm these
    blocks add (Gemma: four per block, q/k norms) as transformers' model holds them."""
    path, ref = hf_dirs[family]
    ours = orbitrl.load_model(path)
    n = sum(p.numel() for p in ref.parameters())
    assert ours.config.num_params == n == sum(p.numel() for p in ours.parameters())


def test_gemma_config_defaults_follow_transformers():
    """Keys a Gemma config may leave out take transformers' defaults (Gemma 2: caps 50 / 30,
    every other layer sliding; Gemma 3: no caps, every 6th layer global, rotary bases 1e6 and
    1e4 from the older keys, a flat rope_scaling on the global layers only); what orbitrl
    cannot run stops with one line naming the key."""
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    g2 = ModelConfig.from_hf(dict(base, model_type="gemma2"))
    assert (g2.attn_softcap, g2.final_softcap, g2.query_pre_attn_scalar) == (50.0, 30.0, 256.0)
    assert g2.sliding_windows == [4096, None] * 3 and g2.tie_word_embeddings
    assert g2.attn_scale == 256 ** -0.5 and g2.local_rope is None
    g3 = ModelConfig.from_hf(dict(base, model_type="gemma3_text", rope_theta=1e6,
                                  rope_local_base_freq=1e4, sliding_window=512,
                                  rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert g3.attn_softcap is None and g3.final_softcap is None and g3.qk_norm
    assert g3.sliding_windows == [512] * 5 + [None]
    assert g3.local_rope_layers == [True] * 5 + [False]
    assert (g3.rope_theta, g3.rope_type) == (1e6, "linear")
    local = g3.local_rope_config()
    assert (local.rope_theta, local.rope_type) == (1e4, "default")
    # the ledger reads the same defaults
    shape = from_config(dict(base, model_type="gemma2", head_dim=None))
    assert shape.tie_embeddings and shape.head_dim == 256
    for bad, match in [(dict(model_type="gemma2", hidden_activation="gelu"), "hidden_activation"),
                       (dict(model_type="gemma3_text", use_bidirectional_attention=True),
                        "use_bidirectional_attention"),
                       (dict(model_type="gemma2", layer_types=["full_attention"]),
                        "layer_types"),
                       (dict(model_type="gemma3", text_config={}), "gemma3_text")]:
        with pytest.raises(OrbitError, match=match):
            ModelConfig.from_hf(dict(base, **bad))


def test_gpt_oss_config_defaults_follow_transformers():
    """Keys a gpt-oss config may leave out take transformers' defaults (every other layer
    sliding, from the first, with a 128-token window; yarn on base 150000 with truncate
    false; biases; SwiGLU alpha 1.702 and limit 7); a checkpoint quantized otherwise than
    MXFP4 (read dequantized: test_quantized_checkpoints.py) stops with one line naming
    config.json and the way out, and so does a SwiGLU limit that is not positive."""
    from transformers import GptOssConfig

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                num_local_experts=4, num_experts_per_tok=2)
    c = ModelConfig.from_hf(dict(base, model_type="gpt_oss"))
    t = GptOssConfig(**base)
    assert c.sliding_windows == [t.sliding_window if k == "sliding_attention" else None
                                 for k in t.layer_types] == [128, None] * 2
    assert {**c.rope_params, "rope_theta": c.rope_theta} == t.rope_parameters
    assert (c.rope_type, c.rope_theta) == ("yarn", 150000.0)
    assert c.attn_sinks and c.qkv_bias and c.o_bias and not c.tie_word_embeddings
    assert (c.moe.swiglu, c.moe.bias, c.moe.softmax_topk) == ((1.702, 7.0), True, True)
    assert (c.moe.num_experts, c.moe.expert_intermediate, c.moe.top_k) == (4, 32, 2)
    for bad, match in [({"quantization_config": {"quant_method": "bitsandbytes"}},
                        r"quantization_config \(bitsandbytes\).*dequantized bf16"),
                       ({"swiglu_limit": 0}, "swiglu_limit")]:
        with pytest.raises(OrbitError, match=match) as e:
            ModelConfig.from_hf(dict(base, model_type="gpt_oss", **bad), "x/config.json")
        assert "\n" not in str(e.value) and str(e.value).startswith("x/config.json")


def test_dropping_a_gemma_feature_breaks_the_logits(hf_dirs):
    """The parity test can fail for the right reasons: each Gemma feature, switched off in
    our model alone, moves the logits far past its 1e-5 bound."""
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(3))
    for family, off in [("gemma2", "embed_scale"), ("gemma2", "attn_softcap"),
                        ("gemma2", "final_softcap"), ("gemma2", "query_pre_attn_scalar"),
                        ("gemma2", "norm_plus_one"), ("gemma2", "sliding_windows"),
                        ("gemma3_text", "local_rope")]:
        path, ref = hf_dirs[family]
        ours = orbitrl.load_model(path)
        with torch.no_grad():
            want = ref(ids).logits
            assert (ours(ids) - want).abs().max().item() < 1e-5
            cfg = ours.config
            if off == "embed_scale":
                cfg.embed_scale = False
            elif off == "final_softcap":
                cfg.final_softcap = None
            elif off == "local_rope":
                ours.rotary_local = ours.rotary
            for layer in ours.model.layers:
                a = layer.self_attn
                if off == "attn_softcap":
                    a.softcap = None
                elif off == "query_pre_attn_scalar":
                    a.scale = cfg.head_dim ** -0.5
                elif off == "sliding_windows":
                    a.window = None
            if off == "norm_plus_one":
                for m in ours.modules():
                    if hasattr(m, "plus_one"):
                        m.plus_one = False
            assert (ours(ids) - want).abs().max().item() > 1e-3, off


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_gemma_in_bf16_follows_transformers(family, tmp_path):
    """In bf16 the embedding multiplier is sqrt(hidden_size) rounded to bf16 (sqrt(72) ->
    8.5), as transformers casts it; the logits then follow transformers' bf16 model (equal
    on the machines checked; bounded here by bf16 noise)."""
    from transformers import AutoModelForCausalLM

    make_hf_model(family, hidden_size=72).save_pretrained(tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    ours = orbitrl.load_model(tmp_path, dtype="bf16")
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(0))
    assert _embed_scale(72, torch.bfloat16) == 8.5
    with torch.no_grad():
        assert torch.equal(ours.model.embed_tokens(ids) * 8.5, ref.model.embed_tokens(ids))
        got, want = ours(ids).float(), ref(ids).logits.float()
    assert got.dtype == torch.float32 and (got - want).abs().max().item() < 2e-2


def test_gemma3_recompute_and_offload_keep_both_rotaries_shared(hf_dirs):
    """Recompute with activation offload over Gemma 3's two rotaries: only each layer's
    hidden state moves to the host (both cos / sin pairs stay shared), the gradients are
    those of a plain backward to the bit."""
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(6))
    grads = []
    for recompute in (False, True):
        m = orbitrl.load_model(hf_dirs["gemma3_text"][0])
        m.recompute = m.offload_activations = recompute
        m(ids).float().logsumexp(-1).sum().backward()
        grads.append([p.grad for p in m.parameters()])
    off = m.activation_offload
    assert off.tensors_stored == off.tensors_restored == m.config.num_layers
    assert off.bytes_to_host == m.config.num_layers * ids.numel() * m.config.hidden_size * 4
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_phi3_ledger_prices_fused_projections(hf_dirs):
    """Phi-3/4's fused qkv_proj / gate_up_proj: one LoRA pair each (as peft puts them), which
    the ledger's adapter count follows, as its parameter total follows the model's."""
    from orbitrl.model.lora import adapter_parameters, apply_lora, lora_modules

    path, _ = hf_dirs["phi3"]
    shape = from_config(json.loads((path / "config.json").read_text()))
    model = orbitrl.load_model(path)
    assert shape.fused_projections and shape.total_params == model.config.num_params
    apply_lora(model, rank=4)
    leaves = {n.rpartition(".")[2] for n in lora_modules(model)}
    assert leaves == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert shape.adapter_params(4) == sum(p.numel() for p in adapter_parameters(model))


def test_deepseek_v3_config_defaults_follow_transformers():
    """Keys a DeepSeek-V3 config may leave out take transformers' defaults (q through
    q_a/q_b of rank 1536, latent 512 + rope 64, interleaved rope pairs, 3 dense layers,
    8 groups keeping 4, scale 2.5, one shared expert); yarn's mscale_all_dim scales the
    softmax; an fp8 checkpoint other than e4m3 blocks and groups that cannot hold the top-k
    stop with one line."""
    from transformers import DeepseekV3Config

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=5,
                num_attention_heads=4, n_routed_experts=16, num_experts_per_tok=4)
    c = ModelConfig.from_hf(dict(base, model_type="deepseek_v3"))
    t = DeepseekV3Config(**base)
    m = c.mla
    assert (m.q_lora_rank, m.kv_lora_rank, m.nope, m.rope, m.v_dim, m.interleave) == (
        t.q_lora_rank, t.kv_lora_rank, t.qk_nope_head_dim, t.qk_rope_head_dim, t.v_head_dim,
        t.rope_interleave)
    assert (c.head_dim, c.rotary_dim, c.kv_layout) == (192, 64, (1, 576, False))
    assert c.attn_scale == 192 ** -0.5 and c.moe.sparse_layers == (3, 4)
    assert c.moe.grouped == (8, 4, 2.5) and c.moe.norm_topk_prob
    assert c.moe.shared_intermediate == t.moe_intermediate_size * t.n_shared_experts
    yarn = {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096}
    scaled = ModelConfig.from_hf(dict(base, model_type="deepseek_v3", rope_scaling=yarn))
    assert scaled.attn_scale == 192 ** -0.5 * (0.1 * math.log(40.0) + 1) ** 2
    for bad, match in [({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}},
                        r"quantization_config \(fp8\)"),
                       ({"n_group": 3}, "n_group 3"),
                       ({"topk_group": 1, "n_group": 8}, "topk_group 1"),
                       ({"kv_lora_rank": 0}, "kv_lora_rank"),
                       ({"qk_rope_head_dim": 7}, "qk_rope_head_dim 7")]:
        with pytest.raises(OrbitError, match=match) as e:
            ModelConfig.from_hf(dict(base, model_type="deepseek_v3", **bad), "x/config.json")
        assert "\n" not in str(e.value) and str(e.value).startswith("x/config.json")


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v3_plain_q"])
def test_dropping_a_deepseek_feature_breaks_the_logits(hf_dirs, family):
    """The parity test can fail for the right reasons: the correction bias (it moves which
    experts run), the routed scaling factor, rope's channel order and the mscale'd softmax
    scale each matter past the 1e-5 bound."""
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(3))
    path, ref = hf_dirs[family]
    with torch.no_grad():
        want = ref(ids).logits
        for off in ("bias", "scale", "interleave", "softmax_scale"):
            ours = orbitrl.load_model(path)
            assert (ours(ids) - want).abs().max().item() < 1e-5
            for layer in ours.model.layers:
                a, ffn = layer.self_attn, layer.mlp
                if off == "interleave":
                    a.interleave = not a.interleave
                elif off == "softmax_scale":
                    a.scale = ours.config.attn_scale * 2
                elif off == "bias" and hasattr(ffn, "gate"):
                    ffn.gate.e_score_correction_bias.zero_()
                elif off == "scale" and hasattr(ffn, "gate"):
                    ffn.grouped = ffn.grouped[:2] + (1.0,)
            assert (ours(ids) - want).abs().max().item() > 1e-3, off
