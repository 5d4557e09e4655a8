"""Frozen-base formats: per-call dequantization, error bounds, library parity, and resident
bytes measured against the ledger's bytes-per-parameter formula."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import orbitrl
from hf_helpers import make_hf_model
from orbitrl.errors import OrbitError
from orbitrl.ledger import formats
from orbitrl.model import quant
from orbitrl.model.quant import FrozenLinear, frozen_linears

FMTS = ["fp32", "bf16", "int8", "nf4", "int4"]  # (nf4mix: nf4 and int8 by weight, below)


def _w(out=96, inp=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, inp, generator=g) * 0.05, torch.randn(out, generator=g) * 0.1


def error_bound(fmt: str, w: torch.Tensor) -> torch.Tensor:
    """Elementwise worst-case |dequantized - w| of each format, [out, in]."""
    if fmt == "fp32":
        return torch.zeros_like(w)
    if fmt == "bf16":
        return w.abs() * 2.0 ** -8
    if fmt == "int8":  # scale = row absmax / 127.5, error <= scale / 2
        return (w.abs().amax(1, keepdim=True) / 127.5 * 0.5 * 1.001).expand_as(w)
    if fmt == "int4":  # scale = group absmax / 7.5 (bf16-rounded), error <= ~scale / 2
        g = w.reshape(w.shape[0], -1, formats.INT4_GROUP)
        b = g.abs().amax(-1, keepdim=True) / 7.5 * 0.53
        return b.expand_as(g).reshape_as(w)
    # nf4: half the widest gap of the code book (1 - 0.7230) times the block absmax, plus
    # the int8 double quantization of that absmax
    blocks = w.reshape(-1, formats.NF4_BLOCK)
    b = blocks.abs().amax(-1, keepdim=True) * (0.277 / 2 + 0.02)
    return b.expand_as(blocks).reshape_as(w)


@pytest.mark.parametrize("fmt", FMTS)
def test_forward_is_linear_over_dequantized_weight(fmt):
    w, b = _w()
    fl = FrozenLinear(w, b, fmt)
    x = torch.randn(3, 5, 64)
    want = F.linear(x, fl.dequantize(torch.float32), b)
    assert (fl(x) - want).abs().max().item() < 1e-6
    err = (fl.dequantize() - w).abs()
    assert (err <= error_bound(fmt, w) + 1e-9).all(), f"{fmt}: max error {err.max().item()}"
    if fmt != "fp32":
        assert err.max() > 0  # it is really stored in the lower format


@pytest.mark.parametrize("fmt", FMTS)
def test_backward_keeps_no_dequantized_weight(fmt):
    """Autograd must not keep the full-precision weight alive until backward."""
    w, b = _w()
    fl = FrozenLinear(w, b, fmt)
    x = torch.randn(4, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t,
                                                  lambda t: t):
        y = fl(x)
    assert all(n < w.numel() for n in saved), saved
    y.pow(2).sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    F.linear(x2, fl.dequantize(), b).pow(2).sum().backward()
    assert torch.allclose(x.grad, x2.grad, atol=1e-6)
    assert fl.bias.grad is None and not fl.bias.requires_grad


@pytest.mark.parametrize("fmt", FMTS)
def test_forward_without_grad_is_the_same_and_records_nothing(fmt):
    """An input that needs no gradient (rollout, scoring) skips the autograd node: the
    output is bit for bit the one the differentiable path computes."""
    w, b = _w()
    fl = FrozenLinear(w, b, fmt)
    x = torch.randn(4, 64)
    y_grad = fl(x.clone().requires_grad_(True))
    assert y_grad.grad_fn is not None
    y = fl(x)
    with torch.no_grad():
        y_nograd = fl(x.clone().requires_grad_(True))
    assert y.grad_fn is None and y_nograd.grad_fn is None
    assert torch.equal(y, y_grad.detach()) and torch.equal(y_nograd, y)


def test_int4_matches_torchao_affine_quantization():
    """Our group-wise int4 is torchao's symmetric affine int4 (scale absmax/7.5, [-8, 7]),
    packed two codes per byte."""
    from torchao.quantization.quant_primitives import (MappingType, choose_qparams_affine,
                                                       dequantize_affine, quantize_affine)
    w, _ = _w(64, 128, seed=3)
    G = formats.INT4_GROUP
    packed, scales = quant.quantize_int4(w, G)
    assert packed.dtype == torch.uint8 and packed.shape == (64, 64)
    assert scales.dtype == torch.bfloat16 and scales.shape == (64, 128 // G)
    s_ref, zp = choose_qparams_affine(w, MappingType.SYMMETRIC, [1, G], torch.int8,
                                      quant_min=-8, quant_max=7)
    assert torch.allclose(scales.float(), s_ref.reshape(scales.shape), rtol=2 ** -8)
    s = scales.float().reshape(s_ref.shape)  # the stored (bf16-rounded) scale
    codes = quantize_affine(w, [1, G], s, zp, torch.int8, -8, 7)
    ours = torch.stack([packed & 0xF, packed >> 4], -1).reshape(64, 128).to(torch.int8) - 8
    assert torch.equal(ours, codes)
    ref = dequantize_affine(codes, [1, G], s, zp, torch.int8, -8, 7, output_dtype=torch.float32)
    assert torch.equal(quant.dequantize_int4(packed, scales), ref)


def _to_nf4():
    try:
        from torchao.quantization import to_nf4
    except ImportError:  # torchao < 0.18 (what quant._torchao falls back to)
        from torchao.dtypes import to_nf4
    return to_nf4


def test_nf4_and_int8_are_torchao():
    ao = quant._torchao()
    Int8Tensor, NF4Tensor, to_nf4 = ao.Int8Tensor, ao.NF4Tensor, _to_nf4()
    w, _ = _w()
    nf = FrozenLinear(w, None, "nf4")
    assert isinstance(nf.weight, NF4Tensor)
    # 96*64/64 = 96 blocks: the scaler block shrinks to gcd(96, 256) = 32
    assert torch.equal(nf.dequantize(), to_nf4(w, 64, 32).get_original_weight())
    assert isinstance(FrozenLinear(w, None, "int8").weight, Int8Tensor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(96, 64), (384, 128), (128, 384), (256, 256)])
def test_nf4_dequantize_is_torchao_bit_for_bit(shape, dtype):
    """The one-gather NF4 dequantization equals torchao's, value for value and dtype."""
    to_nf4 = _to_nf4()

    w = (torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 0.05).to(dtype)
    ref = to_nf4(w, 64, 32)
    out = quant.dequantize_nf4(ref)
    assert out.dtype == ref.get_original_weight().dtype
    assert torch.equal(out, ref.get_original_weight())
    layer = FrozenLinear(w.float(), None, "nf4")
    assert torch.equal(layer.dequantize(), layer.weight.get_original_weight())


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    """A llama with hidden 256 (per-tensor constants amortised as in real models)."""
    d = tmp_path_factory.mktemp("wide")
    m = make_hf_model("llama", hidden_size=256, intermediate_size=512)
    m.save_pretrained(d)
    return d, m


@pytest.mark.parametrize("fmt", FMTS)
def test_resident_bytes_match_ledger(wide_dir, fmt):
    path, _ = wide_dir
    model = orbitrl.load_model(path, base_format=fmt)
    fls = frozen_linears(model)
    assert len(fls) == 2 * 7
    measured = sum(f.weight_bytes() for f in fls.values())
    params = sum(f.in_features * f.out_features for f in fls.values())
    exact = sum(formats.linear_bytes(fmt, f.out_features, f.in_features) for f in fls.values())
    assert measured == exact
    per_param = sum(formats.bytes_per_param(fmt, f.in_features) * f.in_features * f.out_features
                    for f in fls.values()) / params
    assert abs(measured / params - per_param) / per_param < 0.05, (measured / params, per_param)
    # and the planner's table (typical row length) is within 5% too
    assert abs(measured / params - formats.PARAM_BYTES[fmt]) / formats.PARAM_BYTES[fmt] < 0.05


def test_nf4mix_is_nf4_for_the_mlp_inputs_and_int8_elsewhere(wide_dir, hf_dirs):
    """nf4mix stores gate/up in nf4 and attention and down in int8, each weight's bytes what
    the ledger prices for its own format; the ledger's per-parameter price (half the
    projections in nf4) within 10% of this model's (40% of them gate/up)."""
    path, _ = wide_dir
    model = orbitrl.load_model(path, base_format="nf4mix")
    fls = frozen_linears(model)
    kinds = {n.rsplit(".", 1)[-1]: f.fmt for n, f in fls.items()}
    assert kinds == {"gate_proj": "nf4", "up_proj": "nf4", "down_proj": "int8",
                     "q_proj": "int8", "k_proj": "int8", "v_proj": "int8", "o_proj": "int8"}
    measured = sum(f.weight_bytes() for f in fls.values())
    assert measured == sum(formats.linear_bytes(f.fmt, f.out_features, f.in_features)
                           for f in fls.values())
    params = sum(f.in_features * f.out_features for f in fls.values())
    assert abs(measured / params / formats.PARAM_BYTES["nf4mix"] - 1) < 0.1
    assert formats.PARAM_BYTES["nf4"] < formats.PARAM_BYTES["nf4mix"] < \
        formats.PARAM_BYTES["int8"]
    path, ref = hf_dirs["qwen3"]
    model = orbitrl.load_model(path, base_format="nf4mix")
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        assert (model(ids) - ref(ids).logits).abs().max().item() < 0.2
    with pytest.raises(OrbitError, match="nf4mix needs the weight's name"):
        from orbitrl.model.lora import LoRALinear

        LoRALinear(nn.Linear(64, 64), 4, 8, base_format="nf4mix")


def test_quantized_while_streaming(hf_dirs):
    """No full-precision projection is ever materialised next to the others: when each tensor
    streams by, every projection already loaded is in the frozen format."""
    path, _ = hf_dirs["llama_bias"]
    seen = []

    def spy(model, name, t):
        plain = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)
                 and n.startswith("model.layers.") and not m.weight.is_meta]
        seen.append(len(plain))

    model = orbitrl.load_model(path, base_format="nf4", on_tensor=spy)
    assert len(seen) > 20 and max(seen) == 0
    for f in frozen_linears(model).values():  # biases streamed in after or before their weight
        assert f.bias is not None and not f.bias.is_meta and not f.bias.requires_grad


@pytest.mark.parametrize("fmt", FMTS)
def test_quantized_model_close_to_fp32(hf_dirs, fmt):
    path, ref = hf_dirs["qwen3"]
    model = orbitrl.load_model(path, base_format=fmt)
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        err = (model(ids) - ref(ids).logits).abs().max().item()
    tol = {"fp32": 1e-5, "bf16": 1e-2, "int8": 2e-2, "nf4": 0.2, "int4": 0.2}[fmt]
    assert err < tol


def _err(fn, *a, **k) -> str:
    with pytest.raises(OrbitError) as e:
        fn(*a, **k)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_format_errors(hf_dirs, monkeypatch):
    path, _ = hf_dirs["llama"]
    msg = _err(orbitrl.load_model, path, base_format="fp4")
    assert "base_format" in msg and "fp4" in msg
    msg = _err(orbitrl.load_model, path, base_format="nf4", device="meta")
    assert "base_format" in msg and "nf4" in msg and "meta" in msg

    def missing():
        raise ImportError("No module named 'torchao'")

    monkeypatch.setattr(quant, "_torchao", missing)
    msg = _err(orbitrl.load_model, path, base_format="int8")
    assert "base_format" in msg and "torchao" in msg
    monkeypatch.undo()
    # int4 groups must divide the row: hidden 64 and intermediate 96 with group 64 fail
    msg = _err(orbitrl.load_model, path, base_format="int4", group_size=64)
    assert "down_proj.weight" in msg and "group" in msg


def test_formulas_are_pure_arithmetic():
    assert formats.bytes_per_param("bf16") == 2.0
    assert formats.bytes_per_param("int4", group=32) == 0.5 + 2 / 32
    assert formats.bytes_per_param("nf4") == 0.5 + 1 / 64 + 4 / (64 * 256)
    assert formats.bytes_per_param("int8", 4096) == 1 + 5 / 4096
    assert formats.linear_bytes("nf4", 4096, 4096) == 4096 * 4096 // 2 + 4096 * 64 + 4 * 1024 + 68
    with pytest.raises(ValueError):
        formats.bytes_per_param("fp4")


@pytest.mark.parametrize("fmt", ["bf16", "int8", "nf4", "int4"])
def test_dequantized_cache_same_results_one_dequantization(fmt, monkeypatch):
    """Within budget: forward and backward give bit-equal results with one dequantization
    in all; a replaced stored weight is dequantized again; over budget nothing is kept."""
    w, b = _w()
    model = nn.Sequential(FrozenLinear(w, b, fmt), FrozenLinear(w[:, :64].T.contiguous(), None, fmt))
    x = torch.randn(4, 64, requires_grad=True)
    y0 = model(x)
    y0.pow(2).sum().backward()
    g0, x.grad = x.grad.clone(), None
    size = sum(m.out_features * m.in_features for m in model) * 4
    assert quant.cache_dequantized(model, size - 1) == 0  # over budget: per call
    assert quant.cache_dequantized(model, size) == size
    calls = []
    real = FrozenLinear.dequantize
    monkeypatch.setattr(FrozenLinear, "dequantize",
                        lambda self, dtype=torch.float32: calls.append(self) or real(self, dtype))
    for _ in range(3):
        y = model(x)
        y.pow(2).sum().backward()
        assert torch.equal(y, y0) and torch.equal(x.grad, g0)
        x.grad = None
    with torch.no_grad():
        assert torch.equal(model(x), y0)
    assert len(calls) == 2  # once per layer, forward and backward included
    first = model[0]
    key = "qweight" if fmt == "int4" else "weight"
    setattr(first, key, getattr(FrozenLinear(w, b, fmt), key))  # a replaced stored weight
    model(x)
    assert len(calls) == 3
    quant.cache_dequantized(model, 0)
    model(x)
    assert len(calls) == 5 and first._cached is None


def test_dequantized_cache_is_in_the_ledger(tmp_path):
    """The run's predicted memory holds the kept copies when they fit the budget and the
    per-call workspace otherwise."""
    from orbitrl.config import load_config
    from orbitrl.ledger.memory import projection_params
    from orbitrl.ledger.runtime import runtime_prediction
    from orbitrl.ledger.models import from_config
    from orbitrl.model.builtin import resolve_model_path
    import json

    hf = json.loads((resolve_model_path("builtin:tiny-arith") / "config.json").read_text())
    on = runtime_prediction(load_config(None, ["model.device=cpu"]), hf, 8)["terms"]["rollout"]
    off = runtime_prediction(load_config(None, ["model.device=cpu", "model.dequant_cache_mb=0"]),
                             hf, 8)["terms"]["rollout"]
    assert on["weights:dequant_cache"] == projection_params(from_config(hf)) * 4
    assert "activations:dequant" in off and "weights:dequant_cache" not in off
