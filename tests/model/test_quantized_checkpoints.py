"""Quantized checkpoints as the Hub ships them, dequantized at load (model/weights.py):
gpt-oss's MXFP4 experts and DeepSeek-V3's fp8 blocks. Tiny random models are quantized here
the way those checkpoints are laid out (``*_blocks`` / ``*_scales`` beside the biases,
``*.weight`` in float8_e4m3fn beside ``*.weight_scale_inv``), loaded by orbitrl and by
transformers (which dequantizes them on a CPU), and compared."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

import orbitrl
from hf_helpers import make_hf_model
from orbitrl.errors import OrbitError
from orbitrl.model.config import ModelConfig
from orbitrl.model.weights import FP4_E2M1, dequantize_fp8, dequantize_mxfp4, save_pretrained

IDS = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(0))


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K, R] (the bf16 checkpoint's expert layout) -> (blocks [..., R, K/32, 16] uint8,
    scales [..., R, K/32] uint8): groups of 32 along K share a power-of-two scale, each value
    the nearest e2m1."""
    x = w.transpose(-1, -2).float()
    *lead, R, K = x.shape
    g = x.reshape(*lead, R, K // 32, 32)
    amax = g.abs().amax(-1).clamp_min(1e-30)
    e = torch.ceil(torch.log2(amax / 6.0)).to(torch.int32)
    lut = torch.tensor(FP4_E2M1)
    idx = ((g / torch.ldexp(torch.ones(()), e)[..., None])[..., None] - lut).abs().argmin(-1)
    idx = idx.to(torch.uint8)
    blocks = idx[..., 0::2] | (idx[..., 1::2] << 4)
    return blocks, (e + 127).to(torch.uint8)


def quantize_fp8(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D weight -> (float8_e4m3fn weight, fp32 scale_inv per block x block tile)."""
    rows, cols = w.shape
    gr, gc = math.ceil(rows / block), math.ceil(cols / block)
    pad = torch.zeros(gr * block, gc * block)
    pad[:rows, :cols] = w
    tiles = pad.reshape(gr, block, gc, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    q = (tiles / scale[:, None, :, None]).reshape(gr * block, gc * block)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale


def _write(model, tmp_path, name, convert, quant: dict):
    src = tmp_path / f"{name}-plain"
    model.save_pretrained(src)
    sd = load_file(src / "model.safetensors")
    out = tmp_path / name
    out.mkdir()
    save_file(convert(sd), out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quant
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_mxfp4_dequantization_is_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(117, 132, (3, 8, 2), generator=g, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(dequantize_mxfp4(blocks, scales), want)
    with pytest.raises(ValueError, match="do not pair"):
        dequantize_mxfp4(blocks, scales[..., :1])


def test_fp8_dequantization_by_partial_blocks():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(20, 13, generator=g).to(torch.float8_e4m3fn)
    s = torch.rand(3, 2, generator=g) + 0.5
    want = torch.empty(20, 13)
    for i in range(20):
        for j in range(13):
            want[i, j] = w[i, j].float() * s[i // 8, j // 8]
    assert torch.equal(dequantize_fp8(w, s, (8, 8)), want)
    with pytest.raises(ValueError, match="expected \\(3, 2\\)"):
        dequantize_fp8(w, s[:2], (8, 8))


def test_gpt_oss_mxfp4_checkpoint_loads_dequantized(tmp_path):
    """gpt-oss's MXFP4 experts: orbitrl's logits equal transformers' on the same quantized
    checkpoint, and equal those of the dequantized weights written unquantized; an export
    says nothing of the quantization it no longer has."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    hf = make_hf_model("gpt_oss", intermediate_size=64)

    def convert(sd):
        out = {}
        for k, v in sd.items():
            if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
                out[k + "_blocks"], out[k + "_scales"] = quantize_mxfp4(v)
            else:
                out[k] = v
        return out

    path = _write(hf, tmp_path, "mxfp4", convert, {
        "quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]})
    ours = orbitrl.load_model(path)
    # (dequantize=True: no kernel fetched from the Hub)
    ref = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)).eval()
    with torch.no_grad():
        got, want = ours(IDS), ref(input_ids=IDS).logits
        assert (got - want).abs().max().item() < 1e-5
        # the dequantized experts, through orbitrl's plain path: the same logits
        sd = load_file(path / "model.safetensors")
        plain = {k: v for k, v in sd.items() if not k.endswith(("_blocks", "_scales"))}
        for k in [k for k in sd if k.endswith("_blocks")]:
            name = k[: -len("_blocks")]
            plain[name] = dequantize_mxfp4(sd[k], sd[name + "_scales"])
        assert not torch.equal(plain["model.layers.0.mlp.experts.down_proj"],
                               hf.state_dict()["model.layers.0.mlp.experts.down_proj"])
        again = tmp_path / "plain"
        again.mkdir()
        save_file(plain, again / "model.safetensors", metadata={"format": "pt"})
        cfg = json.loads((path / "config.json").read_text())
        cfg.pop("quantization_config")
        (again / "config.json").write_text(json.dumps(cfg))
        assert torch.equal(orbitrl.load_model(again)(IDS), got)
    exported = tmp_path / "export"
    save_pretrained(ours, exported)
    assert "quantization_config" not in json.loads((exported / "config.json").read_text())
    with torch.no_grad():
        assert torch.equal(orbitrl.load_model(exported)(IDS), got)


def test_deepseek_fp8_checkpoint_loads_dequantized(tmp_path):
    """DeepSeek-V3's fp8 e4m3 blocks (weight_block_size): every projection of the layers
    (attention, dense, shared and routed experts) stored in fp8 with its scale_inv grid;
    orbitrl's logits equal transformers' on the same checkpoint."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    hf = make_hf_model("deepseek_v3")

    def convert(sd):
        out = {}
        for k, v in sd.items():
            if ".layers." in k and k.endswith("proj.weight") or k.endswith("proj_with_mqa.weight"):
                out[k], out[k + "_scale_inv"] = quantize_fp8(v, 8)
            else:
                out[k] = v
        return out

    path = _write(hf, tmp_path, "fp8", convert, {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [8, 8]})
    ours = orbitrl.load_model(path)
    ref = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32,
        quantization_config=FineGrainedFP8Config(weight_block_size=(8, 8), dequantize=True)).eval()
    with torch.no_grad():
        got, want = ours(IDS), ref(input_ids=IDS).logits
        plain = hf(input_ids=IDS).logits
    assert (got - want).abs().max().item() < 1e-5
    assert (got - plain).abs().max().item() > 1e-4  # fp8 moved them: the scales were read


def test_other_quantizations_stop_with_one_line():
    base = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                num_hidden_layers=1, num_attention_heads=4)
    for q in ({"quant_method": "gptq"}, {"quant_method": "fp8", "fmt": "e5m2"}):
        with pytest.raises(OrbitError, match=r"x/config.json: quantization_config") as e:
            ModelConfig.from_hf(dict(base, quantization_config=q), "x/config.json")
        assert "\n" not in str(e.value)
    ModelConfig.from_hf(dict(base, quantization_config={"quant_method": "fp8"}))
