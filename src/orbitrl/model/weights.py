"""Load and save Hugging Face model directories with our decoder.

Loading builds the model on the meta device, then assigns each tensor from the
memory-mapped safetensors shards one at a time (converted to the target dtype and device):
the full weights never exist twice. ``on_tensor`` lets a caller transform a tensor as it
streams by (e.g. quantize a frozen linear weight shard by shard).

gpt-oss checkpoints hold each layer's experts as four fused tensors (transformers'
``GptOssExperts``): ``gate_up_proj`` [E, H, 2I] with the gate and up columns interleaved
(gate at even columns), ``gate_up_proj_bias`` [E, 2I], ``down_proj`` [E, I, H] and
``down_proj_bias`` [E, H], applied as ``x @ W + b``. Loading splits them into each expert's
``gate_proj`` / ``up_proj`` / ``down_proj`` linears ([out, in] weights, ``split_experts``);
export fuses them back (``fuse_experts``).
"""

from __future__ import annotations

import json
import math
import os
import re
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from orbitrl.errors import OrbitError
from orbitrl.model import quant
from orbitrl.model.config import ModelConfig
from orbitrl.model.decoder import Decoder
from orbitrl.model.moe import pack_experts
from orbitrl.model.tokenizer import save_tokenizer

# Hugging Face name -> ours. Our module tree mirrors HF's, so the map is the identity on
# the names it accepts; it exists to reject what we do not understand, explicitly.
_HF_NAMES = [
    r"model\.embed_tokens\.weight",
    r"model\.norm\.weight",
    r"lm_head\.weight",
    r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm|pre_feedforward_layernorm"
    r"|post_feedforward_layernorm)\.weight",
    r"model\.layers\.\d+\.self_attn\.(q|k|v|o|qkv)_proj\.(weight|bias)",  # qkv: Phi-3/4
    r"model\.layers\.\d+\.self_attn\.(q|k)_norm\.weight",
    r"model\.layers\.\d+\.mlp\.(gate|up|down|gate_up)_proj\.(weight|bias)",
    # mixtures (moe.py): router, routed experts (Mixtral: w1 gate, w3 up, w2 down), shared expert
    r"model\.layers\.\d+\.(mlp|block_sparse_moe)\.gate\.weight",
    r"model\.layers\.\d+\.(mlp|block_sparse_moe)\.experts\.\d+\.((gate|up|down)_proj|w1|w2|w3)\.weight",
    r"model\.layers\.\d+\.mlp\.shared_expert\.(gate|up|down)_proj\.weight",
    r"model\.layers\.\d+\.mlp\.shared_expert_gate\.weight",
    # gpt-oss: attention sinks, a router with a bias, fused experts (split_experts)
    r"model\.layers\.\d+\.self_attn\.sinks",
    r"model\.layers\.\d+\.mlp\.router\.(weight|bias)",
    r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?",
    # DeepSeek-V3: latent attention (mla.py), the router's correction bias (a buffer),
    # ungated shared experts
    r"model\.layers\.\d+\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.(weight|bias)",
    r"model\.layers\.\d+\.self_attn\.(q_b_proj|kv_b_proj)\.weight",
    r"model\.layers\.\d+\.self_attn\.(q_a|kv_a)_layernorm\.weight",
    r"model\.layers\.\d+\.mlp\.gate\.e_score_correction_bias",
    r"model\.layers\.\d+\.mlp\.shared_experts\.(gate|up|down)_proj\.weight",
]
_HF_RE = re.compile("|".join(f"(?:{p})" for p in _HF_NAMES))
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def to_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise OrbitError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    return DTYPES[dtype]


def hf_to_ours(name: str) -> Optional[str]:
    """Our parameter name for an HF checkpoint key; None for keys we deliberately skip."""
    if _IGNORED.match(name):
        return None
    if not _HF_RE.fullmatch(name):
        raise KeyError(name)
    return name


_FUSED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?")


def split_experts(cfg: ModelConfig, key: str, t: torch.Tensor, source) -> list | None:
    """gpt-oss: a fused expert tensor as (our name, tensor) per expert projection, weights
    [out, in] and contiguous; None for any other key. A shape other than config.json's
    is a one-line OrbitError."""
    m = _FUSED.fullmatch(key) if cfg.model_type == "gpt_oss" else None
    if m is None:
        return None
    base, proj, bias = m.groups()
    e, h, w = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.expert_intermediate
    want = {"gate_up_proj": (e, h, 2 * w), "down_proj": (e, w, h)}[proj]
    want = (want[0], want[2]) if bias else want
    if tuple(t.shape) != want:
        raise OrbitError(f"{source}: weight {key!r} has shape {tuple(t.shape)}, config.json "
                         f"implies {want}")
    leaf = "bias" if bias else "weight"
    out = []
    for i in range(e):
        x = t[i] if bias else t[i].t()  # [2I] / [2I, H], or [H] / [H, I]
        parts = {"down_proj": x} if proj == "down_proj" else {"gate_proj": x[0::2],
                                                                "up_proj": x[1::2]}
        out += [(f"{base}.{i}.{p}.{leaf}", y.contiguous()) for p, y in parts.items()]
    return out


def fuse_experts(cfg: ModelConfig, sd: dict) -> dict:
    """gpt-oss: each layer's per-expert tensors in ``sd`` replaced by the checkpoint's four
    fused ones (the inverse of :func:`split_experts`); ``sd`` as it is for other families."""
    if cfg.model_type != "gpt_oss":
        return sd
    for layer in cfg.moe.sparse_layers:
        base = f"model.layers.{layer}.mlp.experts"
        for leaf, suffix in (("weight", ""), ("bias", "_bias")):
            def take(p):
                ts = [sd.pop(f"{base}.{i}.{p}.{leaf}") for i in range(cfg.moe.num_experts)]
                return torch.stack(ts if leaf == "bias" else [x.t() for x in ts])
            gate, up = take("gate_proj"), take("up_proj")  # [E, (H,) I]
            sd[f"{base}.gate_up_proj{suffix}"] = torch.stack((gate, up), -1).flatten(-2)
            sd[f"{base}.down_proj{suffix}"] = take("down_proj")
    return sd


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory, checked to exist."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise OrbitError(f"{index}: not a valid safetensors index ({e})") from None
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.exists():
                raise OrbitError(f"{f}: shard listed in {index.name} is missing")
        return files
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    others = sorted(path.glob("*.safetensors"))
    if others:
        return others
    raise OrbitError(f"{path}: no model.safetensors or model.safetensors.index.json "
                     "(only safetensors weights are supported)")


FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_fp8(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A block-quantized fp8 weight (DeepSeek-V3's ``weight_block_size``, e.g. [128, 128])
    in fp32: each ``block`` tile of ``w`` times its entry of ``scale_inv`` (the grid of
    ``ceil(rows / bm) x ceil(cols / bn)`` scales; the last tiles may be partial)."""
    rows, cols = w.shape[-2:]
    bm, bn = block
    want = (math.ceil(rows / bm), math.ceil(cols / bn))
    if tuple(scale_inv.shape[-2:]) != want:
        raise ValueError(f"scale grid {tuple(scale_inv.shape)} for a {tuple(w.shape)} weight "
                         f"in {bm}x{bn} blocks (expected {want})")
    s = scale_inv.float().repeat_interleave(bm, -2).repeat_interleave(bn, -1)
    return w.float() * s[..., :rows, :cols]


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss's MXFP4 expert weights in fp32: ``blocks`` [..., R, G, 16] bytes of two e2m1
    values each (low nibble first), ``scales`` [..., R, G] biased exponents (value - 127)
    shared by each group of 32; returned [..., G * 32, R], the bf16 checkpoint's layout
    (``gate_up_proj`` [experts, hidden, 2 x intermediate])."""
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales "
                         f"{tuple(scales.shape)} do not pair (blocks [..., G, 16], scales [..., G])")
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    b = blocks.to(torch.uint8)
    vals = torch.stack([lut[(b & 0x0F).long()], lut[(b >> 4).long()]], dim=-1)
    vals = torch.ldexp(vals.flatten(-2), (scales.to(torch.int32) - 127)[..., None])
    return vals.flatten(-2).transpose(-1, -2).contiguous()


def _partner(key: str, method: str) -> str | None:
    """The scale tensor a quantized checkpoint stores beside ``key``, if any."""
    if method == "fp8" and key.endswith(".weight"):
        return key + "_scale_inv"
    if method == "mxfp4" and key.endswith("_blocks"):
        return key[: -len("_blocks")] + "_scales"
    return None


def iter_checkpoint(path: str | Path, quant: dict | None = None
                    ) -> Iterator[tuple[str, Path, torch.Tensor]]:
    """Yield (HF name, file, tensor) one tensor at a time from memory-mapped shards.

    ``quant``: config.json's ``quantization_config`` (``fp8`` block-quantized as
    DeepSeek-V3 ships, ``mxfp4`` experts as gpt-oss ships): each quantized tensor is yielded
    dequantized to fp32 under the name of the unquantized checkpoint, its scales
    (``*.weight_scale_inv``, ``*_scales``) not yielded; tensors stored unquantized pass."""
    files = weight_files(Path(path))
    method = (quant or {}).get("quant_method")
    block = tuple((quant or {}).get("weight_block_size") or (128, 128))
    with ExitStack() as stack:
        opened = {}
        for f in files:
            try:
                opened[f] = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            except SafetensorError as e:
                raise OrbitError(f"{f}: unreadable or truncated safetensors file ({e})") from None
        where = {k: sf for sf in opened.values() for k in sf.keys()} if method else {}
        for f, sf in opened.items():
            try:
                for key in sf.keys():
                    if method and key.endswith(("_scale_inv", "_scales")):
                        continue
                    t = sf.get_tensor(key)
                    scale_key = _partner(key, method) if method else None
                    if scale_key is None or scale_key not in where:
                        if method == "mxfp4" and key.endswith("_blocks"):
                            raise OrbitError(f"{f}: {key} has no {scale_key} beside it")
                        yield key, f, t
                        continue
                    scale = where[scale_key].get_tensor(scale_key)
                    try:
                        if method == "fp8":
                            yield key, f, dequantize_fp8(t, scale, block)
                        else:
                            yield key[: -len("_blocks")], f, dequantize_mxfp4(t, scale)
                    except ValueError as e:
                        raise OrbitError(f"{f}: {key}: {e}") from None
            except SafetensorError as e:
                raise OrbitError(f"{f}: unreadable or truncated safetensors file ({e})") from None


def _assign(model: nn.Module, name: str, tensor: torch.Tensor | nn.Module):
    mod_name, _, leaf = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    if isinstance(tensor, nn.Module):  # a transformed (e.g. quantized) replacement module
        parent_name, _, child = mod_name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, tensor)
    else:
        mod._parameters[leaf] = nn.Parameter(tensor, requires_grad=tensor.is_floating_point())


_INITS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
          "xavier_uniform_", "xavier_normal_", "zeros_", "ones_", "constant_")


@contextmanager
def empty_modules():
    """Build modules on the meta device without running their initialisers (every weight
    is assigned from a checkpoint next). ``nn.Linear`` and ``nn.Embedding`` initialise
    in their constructors; on the meta device ``normal_`` goes through torch's reference
    implementations, whose first call imports ``torch._dynamo``: 1.1 s of every command's
    start-up, measured. The switch is process-wide: no other thread may build modules
    meanwhile (they would skip their initialisers too); loads run on the main thread."""
    saved = {n: getattr(nn.init, n) for n in _INITS}
    try:
        for n in _INITS:
            setattr(nn.init, n, lambda tensor, *a, **k: tensor)
        with torch.device("meta"):
            yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)


def load_model(path: str | Path, dtype="float32", device="cpu",
               on_tensor: Optional[Callable] = None, base_format: Optional[str] = None,
               group_size: Optional[int] = None, extra: Optional[dict] = None,
               column_major_head: bool = True) -> Decoder:
    """Load an HF model directory (Llama, Mistral, Qwen2/2.5, Qwen3, SmolLM3, OLMo 2/3,
    Gemma 2/3 text, Phi-3/4; Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss, DeepSeek-V3) into our
    decoder.

    Args:
        path: directory with config.json and model.safetensors (or an index + shards).
        dtype: compute/storage dtype of the weights (torch dtype or "float32", "bf16", ...).
        device: where the weights live.
        on_tensor: optional ``(model, name, tensor) -> tensor | nn.Module | None`` applied
            to each tensor as it streams by, after dtype conversion; returning a module
            replaces the owning linear layer, None keeps the tensor as is.
        base_format: store the decoder layers' projections frozen in this format ("fp32",
            "bf16", "int8", "nf4", "int4"; see orbitrl.model.quant), quantized one tensor
            at a time as it streams by; None keeps plain trainable ``nn.Linear`` layers.
        group_size: int4 group size (default orbitrl.ledger.formats.INT4_GROUP).
        extra: a dict that receives the checkpoint's tensors outside ``model.*`` and
            ``lm_head`` (a sequence classifier's ``score.weight``) as stored, instead of
            refusing them; a checkpoint without ``lm_head.weight`` (untied) then loads as
            a backbone: ``lm_head`` is None (hidden states only, no logits).
        column_major_head: lay an fp32 CPU head out column-major
            (:meth:`Decoder.head_column_major`); False for a caller whose every head GEMM
            runs over a packed copy (``orbitrl generate``), which is made from the
            row-major weight (re-laying it out cost 0.1 s of SmolLM2's start, and packing
            a column-major head another staging copy).
    Returns:
        The model in eval mode.
    """
    path = Path(path)
    dtype = to_dtype(dtype)
    if base_format is not None:
        quant.check_format(base_format, device)
        kw = {} if group_size is None else {"group_size": group_size}
        on_tensor = quant.quantizing_hook(base_format, then=on_tensor, **kw)
    cfg = ModelConfig.from_dir(path)
    with empty_modules():
        model = Decoder(cfg)
    expected = dict(model.named_parameters())  # tied lm_head appears once, as embed
    # buffers a checkpoint holds (DeepSeek-V3's correction bias): kept in their fp32
    buffers = {n: b for n, b in model.named_buffers() if hf_to_ours_safe(n)}
    expected.update(buffers)
    replaced: set[str] = set()
    seen: set[str] = set()
    for key, f, t in iter_checkpoint(path, cfg.hf.get("quantization_config")):
        try:
            name = hf_to_ours(key)
        except KeyError:
            if extra is not None and not key.startswith("model."):
                extra[key] = t
                continue
            raise OrbitError(f"{f}: unexpected weight {key!r} for a {cfg.model_type} model"
                             ) from None
        if name is None or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        layer = _LAYER.match(name)
        if layer and int(layer.group(1)) >= cfg.num_layers and cfg.mla is not None:
            continue  # DeepSeek-V3's multi-token-prediction layers (not run here)
        for name, t in split_experts(cfg, key, t, f) or [(name, t)]:
            if name not in expected:
                raise OrbitError(f"{f}: weight {key!r} does not exist in this "
                                 f"{cfg.model_type} configuration (check attention_bias / "
                                 "qk-norm / layers)")
            want = tuple(expected[name].shape)
            if tuple(t.shape) != want:
                raise OrbitError(f"{f}: weight {key!r} has shape {tuple(t.shape)}, "
                                 f"config.json implies {want}")
            if name in buffers:
                model.get_submodule(name.rpartition(".")[0])._buffers[
                    name.rpartition(".")[2]] = t.to(device, buffers[name].dtype)
                seen.add(name)
                continue
            t = t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
            if on_tensor is not None:
                out = on_tensor(model, name, t)
                if out is not None:
                    t = out
            if isinstance(t, nn.Module):
                replaced.add(name.rpartition(".")[0])
            _assign(model, name, t)
            seen.add(name)
    headless = extra is not None and "lm_head.weight" not in seen \
        and not cfg.tie_word_embeddings
    missing = [n for n in expected if n not in seen
               and n.rpartition(".")[0] not in replaced
               and not (headless and n == "lm_head.weight")]
    if missing:
        raise OrbitError(f"{path}: checkpoint lacks {len(missing)} weight(s), first "
                         f"{missing[0]!r}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if headless:
        model.lm_head = None
    if base_format is not None:
        quant.finish_frozen(model, path)
    if model.lm_head is not None and column_major_head:
        model.head_column_major()
    if cfg.moe is not None:  # few rows per expert per call: see moe.pack_experts

        pack_experts(model)
    return model.eval()


def export_state_dict(model: Decoder) -> dict[str, torch.Tensor]:
    """HF-named tensors of the model; modules that store weights in another format export
    through their ``dequantized_state()`` method (name suffix -> tensor)."""
    out: dict[str, torch.Tensor] = {}
    for mod_name, mod in model.named_modules():
        if hasattr(mod, "dequantized_state"):
            for k, v in mod.dequantized_state().items():
                out[f"{mod_name}.{k}"] = v
            continue
        for leaf, p in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]:
            out[f"{mod_name}.{leaf}" if mod_name else leaf] = p.detach()
    if model.config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    out = fuse_experts(model.config, out)
    return {k: v for k, v in out.items() if hf_to_ours_safe(k)}


def hf_to_ours_safe(name: str) -> bool:
    try:
        return hf_to_ours(name) is not None
    except KeyError:
        return False


def save_pretrained(model: Decoder, out_dir: str | Path, tokenizer=None, dtype=None,
                    max_shard_bytes: int = 2 << 30) -> Path:
    """Write an HF directory (config.json + safetensors, sharded with an index past
    ``max_shard_bytes``) that transformers loads. Files are written under temporary
    names and renamed, so an interrupted export leaves no half-written file. A model without
    native code (``model/hf_fallback.py``) is written by transformers, adapters merged."""
    if not isinstance(model, Decoder):
        return model.save_pretrained(out_dir, tokenizer=tokenizer, dtype=dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = export_state_dict(model)
    dt = to_dtype(dtype) if dtype is not None else None
    sd = {k: (v.to(dt) if dt is not None and v.is_floating_point() else v)
          .detach().to("cpu").contiguous() for k, v in sd.items()}
    shards, cur, size = [], {}, 0
    for k, v in sd.items():
        nbytes = v.numel() * v.element_size()
        if cur and size + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = v
        size += nbytes
    shards.append(cur)
    hf = dict(model.config.hf)
    hf.pop("quantization_config", None)  # the weights written are dequantized
    hf["architectures"] = hf.get("architectures") or [_ARCH[model.config.model_type]]
    some = next(iter(sd.values()))
    hf["dtype"] = str(some.dtype).replace("torch.", "")
    hf["torch_dtype"] = hf["dtype"]
    _write_atomic(out / "config.json", lambda p: Path(p).write_text(json.dumps(hf, indent=2)))
    if len(shards) == 1:
        _write_atomic(out / "model.safetensors",
                      lambda p: save_file(shards[0], p, metadata={"format": "pt"}))
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            _write_atomic(out / fname, lambda p, s=shard: save_file(s, p, metadata={"format": "pt"}))
            weight_map.update({k: fname for k in shard})
        total = sum(v.numel() * v.element_size() for v in sd.values())
        idx = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_atomic(out / "model.safetensors.index.json",
                      lambda p: Path(p).write_text(json.dumps(idx, indent=2)))
    if tokenizer is not None:
        save_tokenizer(tokenizer, out)
    return out


_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
         "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
         "qwen3_moe": "Qwen3MoeForCausalLM", "smollm3": "SmolLM3ForCausalLM",
         "olmo2": "Olmo2ForCausalLM", "olmo3": "Olmo3ForCausalLM", "phi3": "Phi3ForCausalLM",
         "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
         "gpt_oss": "GptOssForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


def _write_atomic(path: Path, write: Callable[[str], None]):
    tmp = path.with_name(path.name + ".tmp")
    write(str(tmp))
    os.replace(tmp, path)
