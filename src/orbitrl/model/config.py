"""Decoder shape read from a Hugging Face ``config.json`` (Llama, Mistral, Qwen2, Qwen3,
SmolLM3, OLMo 2 / OLMo 3, Gemma 2 / Gemma 3 text, Phi-3 / Phi-4, and the mixture-of-experts
families Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss: see ``moe.py``; docs/models.md).

Gemma 2 (``gemma2``) and Gemma 3's text model (``gemma3_text``; not the multimodal
``gemma3``) add: (1 + w) RMSNorms in fp32, embeddings scaled by sqrt(hidden_size), the
attention scale ``query_pre_attn_scalar ** -0.5``, four norms per block, tanh GELU,
interleaved sliding and global layers (``layer_types`` or ``sliding_window_pattern``),
soft-capping of attention scores (Gemma 2's ``attn_logit_softcapping``) and of the output
logits (``final_logit_softcapping``), and for Gemma 3 per-head q/k norms and a second
rotary for the sliding layers (``rope_parameters.sliding_attention``, or
``rope_local_base_freq`` in older configs).

Phi-3 / Phi-4 (``phi3``) keep their fused ``qkv_proj`` (q, k, v rows stacked) and
``gate_up_proj`` (gate rows, then up rows) as one linear each, as transformers and peft
name them, so weights, LoRA adapters and exports map one to one; only the first
``partial_rotary_factor`` share of each head rotates (Phi-4-mini: 0.75); no biases; a
``sliding_window`` applies to every layer; ``su`` and ``yarn`` rope types are its longrope.

gpt-oss (``gpt_oss``): a learned logit per query head (``sinks``) joins each softmax's
denominator, sliding and full layers alternate (``layer_types``), q/k/v/o carry biases, yarn
rotary; its experts (biased, clamped SwiGLU) and router are in ``moe.py``. Its MXFP4
checkpoints (``quantization_config``) are dequantized at load (``weights.py``).

DeepSeek-V3 (``deepseek_v3``): multi-head latent attention (:class:`MLAConfig`, ``mla.py``:
the KV cache keeps one compressed row per token and layer), the first
``first_k_dense_replace`` layers dense and the rest a mixture with sigmoid, group-limited
routing and shared experts (``moe.py``). Its fp8 block-quantized checkpoints are
dequantized at load (``weights.py``); other quantized checkpoints are refused.

Rope types (``rope_parameters`` / ``rope_scaling``, computed in ``rope.py``): default,
linear, llama3, yarn, longrope, dynamic. llama3 / yarn / longrope read
``original_max_position_embeddings`` from the top level of config.json where it is there
(Phi-3 always, 4096 by default), else from the rotary parameters, else
``max_position_embeddings`` (transformers' rule). longrope and dynamic switch frequencies
per token past a length (``rope.py``: where this differs from transformers)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from orbitrl.errors import OrbitError
from orbitrl.model.moe import MoEConfig

# model_type -> (qkv bias default, q/k RMSNorm)
FAMILIES = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
    "mixtral": (False, False),
    "qwen2_moe": (True, False),
    "qwen3_moe": (False, True),
    "smollm3": (False, False),  # llama with rotary skipped on some layers (no_rope_layers)
    "olmo2": (False, False),  # post-norm blocks, q/k norm over the whole projection
    "olmo3": (False, False),  # olmo2 with sliding-window layers
    "phi3": (False, False),  # fused qkv_proj / gate_up_proj, partial rotary, longrope
    "gemma2": (False, False),  # (1+w) norms around both sublayers, soft-capping, scaled embeddings
    "gemma3_text": (False, True),  # gemma2 with q/k norms and a rotary per layer kind
    "gpt_oss": (True, False),  # attention sinks, alternating sliding layers, biased MoE
    "deepseek_v3": (False, False),  # latent attention (MLAConfig), grouped sigmoid routing
}
# families whose o_proj bias follows attention_bias (the others have none)
O_BIAS = ("llama", "qwen3", "qwen3_moe", "smollm3", "olmo2", "olmo3", "gemma2", "gemma3_text",
          "gpt_oss")
POST_NORM = ("olmo2", "olmo3")
GEMMA = ("gemma2", "gemma3_text")
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
# gpt-oss's rotary when config.json names none (transformers' GptOssConfig default)
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}


@dataclass
class MLAConfig:
    """DeepSeek-V3's multi-head latent attention (``mla.py``). q comes from ``q_proj``, or
    with ``q_lora_rank`` from ``q_b_proj(norm(q_a_proj(x)))``; ``kv_a_proj_with_mqa`` gives
    a latent ``c`` [kv_lora_rank] (normed) and one rotary key ``k_pe`` [rope] shared by the
    heads; ``kv_b_proj`` expands ``c`` into each head's k_nope [nope] and v [v_dim]. q/k heads
    are nope + rope wide (rope last); ``interleave``: the rope channels come in pairs
    (transformers' ``rope_interleave``); ``scale``: the softmax scale (yarn's mscale
    squared where ``mscale_all_dim`` is set)."""
    q_lora_rank: int
    kv_lora_rank: int
    nope: int
    rope: int
    v_dim: int
    interleave: bool
    scale: float
    bias: bool = False  # attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj

    @property
    def latent_dim(self) -> int:
        """Values the KV cache keeps per token and layer: c, then the rotated k_pe."""
        return self.kv_lora_rank + self.rope

    def params(self, hidden: int, heads: int) -> int:
        """One layer's attention parameters (projections, their biases, the two norms)."""
        qk, ql, kl = self.nope + self.rope, self.q_lora_rank, self.kv_lora_rank
        q = hidden * ql + ql + ql * heads * qk if ql else hidden * heads * qk
        kv = hidden * (kl + self.rope) + kl + kl * heads * (self.nope + self.v_dim)
        bias = (ql + kl + self.rope + hidden) if self.bias else 0
        return q + kv + heads * self.v_dim * hidden + bias

    @classmethod
    def from_hf(cls, hf: dict, rope: dict, rope_type: str, source: str) -> "MLAConfig":
        need = {k: hf.get(k, d) for k, d in (("kv_lora_rank", 512), ("qk_nope_head_dim", 128),
                                             ("qk_rope_head_dim", 64), ("v_head_dim", 128))}
        ql = hf.get("q_lora_rank", 1536)
        if ql is not None:
            need["q_lora_rank"] = ql
        for k, v in need.items():
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise OrbitError(f"{source}: key {k!r} must be a positive integer, got {v!r}")
        if need["qk_rope_head_dim"] % 2:
            raise OrbitError(f"{source}: qk_rope_head_dim {need['qk_rope_head_dim']} must be even")
        scale = (need["qk_nope_head_dim"] + need["qk_rope_head_dim"]) ** -0.5
        if rope_type != "default" and rope.get("mscale_all_dim"):  # transformers' yarn_apply_mscale
            m = 0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1.0 \
                if rope["factor"] > 1 else 1.0
            scale = scale * m * m
        return cls(ql or 0, need["kv_lora_rank"], need["qk_nope_head_dim"],
                   need["qk_rope_head_dim"], need["v_head_dim"],
                   bool(hf.get("rope_interleave", True)), scale,
                   bool(hf.get("attention_bias", False)))


class NotNative(OrbitError):
    """A causal LM that transformers knows and orbitrl has no native code for: the caller
    loads it through the transformers-backed policy (``model/hf_fallback.py``)."""


def _not_native(hf: dict, mt, source: str) -> OrbitError:
    """``NotNative`` for a causal LM transformers knows, else the one-line error: a model
    that is not a causal LM (by its ``architectures``, else by transformers' causal-LM
    table for its ``model_type``), or one transformers does not know."""
    import transformers  # start-up: only a config outside FAMILIES pays the import
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES  # as above
    from transformers.models.auto.modeling_auto import (  # as above
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)

    archs = list(hf.get("architectures") or [])
    named = f"model_type {mt!r} (architecture {archs[0] if archs else '?'})"
    if mt not in CONFIG_MAPPING_NAMES:
        return OrbitError(f"{source}: {named} is not known to transformers "
                          f"{transformers.__version__} (native model_type: "
                          f"{', '.join(FAMILIES)})")
    causal = (any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs) if archs
              else mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if not causal:
        return OrbitError(f"{source}: {named} is not a causal language model")
    return NotNative(f"{source}: {named} has no native code: `orbitrl train` runs it through "
                     f"transformers (docs/models.md); this needs a native model_type "
                     f"({', '.join(FAMILIES)})")


# checkpoint quantizations read by dequantizing at load (weights.py iter_checkpoint)
DEQUANTIZED = ("fp8", "mxfp4")


def is_native(path) -> bool:
    """Whether the causal LM at ``path`` has native code; False for one that runs through
    transformers (``model/hf_fallback.py``). Anything else stops with one line (not a causal
    LM, unknown to transformers) before weights load."""
    try:
        ModelConfig.from_dir(path)
    except NotNative:
        return False
    return True


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_params: dict = field(default_factory=dict)
    max_position_embeddings: int = 2048
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # OLMo 2/3: q/k RMSNorm over the whole projection (heads x head_dim), before the split
    qk_norm_full: bool = False
    # OLMo 2/3: each block norms the attention and MLP outputs (post_attention_layernorm,
    # post_feedforward_layernorm) before the residual add; no input norm
    post_norm: bool = False
    # Phi-3/4: one qkv_proj (q, k, v rows stacked) and one gate_up_proj (gate, up rows)
    fused_proj: bool = False
    # channels of each head that rotate (Phi-3/4's partial_rotary_factor); 0: head_dim
    rotary_dim: int = 0
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    # per layer: None (full attention) or a window length in tokens
    sliding_windows: list = field(default_factory=list)
    # per layer: whether the layer rotates q and k (SmolLM3's no_rope_layers: 0 = NoPE)
    rope_layers: list = field(default_factory=list)
    # Gemma 2/3: RMSNorms scale by (1 + weight) in fp32; blocks norm each sublayer's input
    # and output (input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
    # post_feedforward_layernorm); embeddings times sqrt(hidden_size) in their dtype
    norm_plus_one: bool = False
    sandwich_norm: bool = False
    embed_scale: bool = False
    # attention scale query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5)
    query_pre_attn_scalar: float | None = None
    # cap * tanh(x / cap) on the attention scores / the output logits (None: off)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # gpt-oss: each attention layer holds a learned logit per query head (``sinks``) that
    # joins the softmax's denominator and attends to nothing; its norms multiply by their
    # weight in fp32 and round once (transformers' GptOssRMSNorm)
    attn_sinks: bool = False
    norm_fp32_product: bool = False
    # Gemma 3: the rotary parameters of the sliding layers (local_rope_layers), the others
    # taking rope_theta / rope_type / rope_params; None: one rotary for every layer
    local_rope: dict | None = None
    local_rope_layers: list = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    moe: object = None  # MoEConfig (model/moe.py) for the mixture-of-experts families
    # DeepSeek-V3: latent attention (head_dim: the q/k head, nope + rope; rotary_dim: rope)
    mla: MLAConfig | None = None
    hf: dict = field(default_factory=dict, repr=False)  # the raw config.json, for export

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise OrbitError(f"num_attention_heads {self.num_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_kv_heads}")
        if not self.sliding_windows:
            self.sliding_windows = [None] * self.num_layers
        if not self.rope_layers:
            self.rope_layers = [True] * self.num_layers
        if not self.rotary_dim:
            self.rotary_dim = self.head_dim
        if not self.local_rope_layers:
            self.local_rope_layers = [False] * self.num_layers

    @property
    def attn_scale(self) -> float:
        """The attention scores' scale (transformers': ``query_pre_attn_scalar ** -0.5``
        where the family has it, else ``head_dim ** -0.5``)."""
        if self.mla is not None:
            return self.mla.scale
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def kv_layout(self) -> tuple[int, int, bool]:
        """One token's paged KV per layer: (heads, channels, whether V is stored apart).
        K and V per kv head, or MLA's one latent row (c and the rotated k_pe, no V)."""
        if self.mla is not None:
            return 1, self.mla.latent_dim, False
        return self.num_kv_heads, self.head_dim, True

    def local_rope_config(self) -> "ModelConfig":
        """This config with the sliding layers' rotary parameters (Gemma 3), for a Rotary."""
        r = self.local_rope
        return replace(self, rope_theta=float(r["rope_theta"]), rope_params=r,
                       rope_type=r.get("rope_type", r.get("type", "default")), local_rope=None)

    @property
    def context_length(self) -> int:
        """The context the engine and evals allow by default: max_position_embeddings, which
        dynamic NTK scaling stretches by its factor (its base grows past that length)."""
        if self.rope_type == "dynamic":
            return int(self.max_position_embeddings * self.rope_params["factor"])
        return self.max_position_embeddings

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0)
        attn += (2 * d if self.qk_norm else 0) + (h if self.o_bias else 0)
        attn += (q + kv if self.qk_norm_full else 0) + (self.num_heads if self.attn_sinks else 0)
        if self.mla is not None:
            attn = self.mla.params(h, self.num_heads)
        mlp = 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)
        ffn = self.num_layers * mlp
        if self.moe is not None:  # sparse layers hold experts, a router (and a shared expert)
            ffn = sum(self.moe.ffn_params(j, h, mlp) for j in range(self.num_layers))
        emb = self.vocab_size * h
        norms = 4 if self.sandwich_norm else 2
        return self.num_layers * (attn + norms * h) + ffn + emb * (
            1 if self.tie_word_embeddings else 2) + h

    @classmethod
    def from_hf(cls, hf: dict, source: str = "config.json") -> "ModelConfig":
        mt = hf.get("model_type")
        if mt == "gemma3":
            raise OrbitError(f"{source}: the multimodal Gemma 3 (model_type 'gemma3', vision "
                             "tower beside the language model) is not supported; its "
                             "text-only checkpoints (model_type 'gemma3_text') are")
        if mt not in FAMILIES:
            raise _not_native(hf, mt, source)
        if hf.get("quantization_config"):
            q = hf["quantization_config"] or {}
            method = q.get("quant_method", "?")
            # fp8 blocks (DeepSeek-V3) and MXFP4 experts (gpt-oss) are dequantized at load
            # (model/weights.py iter_checkpoint); model.base_dtype quantizes them again
            if method not in DEQUANTIZED or (method == "fp8" and q.get("fmt", "e4m3")
                                                  != "e4m3"):
                raise OrbitError(f"{source}: quantization_config ({method}) is not supported: "
                                 "orbitrl reads unquantized weights, fp8 e4m3 blocks and "
                                 "MXFP4 experts; use the dequantized bf16 checkpoint "
                                 "(model.base_dtype quantizes it at load)")
        qkv_default, qk_norm = FAMILIES[mt]
        try:
            heads = hf["num_attention_heads"]
            hidden = hf["hidden_size"]
            n_layers = hf["num_hidden_layers"]
            kw = dict(vocab_size=hf["vocab_size"], hidden_size=hidden,
                      intermediate_size=hf["intermediate_size"], num_layers=n_layers)
        except KeyError as e:
            raise OrbitError(f"{source}: missing key {e.args[0]!r}") from None
        act = _activation(hf, mt, source)
        gemma = _gemma(hf, mt, n_layers, source)  # {} for the other families
        rope = _one_rope(gemma.pop("rope", None) or
                         dict(hf.get("rope_parameters") or hf.get("rope_scaling") or
                              (GPT_OSS_ROPE if mt == "gpt_oss" else {})), source, mt)
        theta = rope.get("rope_theta", hf.get("rope_theta",
                                              150000.0 if mt == "gpt_oss" else 10000.0))
        rope, rope_type = _rope_scaling(hf, mt, rope)
        if rope_type not in ROPE_TYPES:
            raise OrbitError(f"{source}: unsupported rope type {rope_type!r} "
                             f"(supported: {', '.join(ROPE_TYPES)})")
        phi = _phi3(hf, mt, rope, source)  # {} for the other families
        if mt == "deepseek_v3":  # q/k heads nope + rope wide, rope the rotary part
            mla = MLAConfig.from_hf(hf, rope, rope_type, source)
            phi = dict(mla=mla, head_dim=mla.nope + mla.rope, rotary_dim=mla.rope)
        _check_rope(hf, rope, rope_type, phi.get("rotary_dim") or
                    hf.get("head_dim") or hidden // heads, source)
        if mt in ("qwen2", "qwen2_moe"):
            qkv_bias = bool(hf.get("qkv_bias", True))
        elif mt == "phi3":  # no biases (transformers' Phi-3 reads no attention_bias)
            qkv_bias = False
        else:
            qkv_bias = bool(hf.get("attention_bias", qkv_default))
        windows = gemma.pop("sliding_windows", None) or _sliding_windows(hf, mt, n_layers)
        head_dim = phi.pop("head_dim", None) or hf.get("head_dim") or \
            (256 if mt in GEMMA else hidden // heads)

        moe = MoEConfig.from_hf(hf, mt, n_layers, source)
        return cls(
            model_type=mt, num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            rope_type=rope_type, rope_params=rope,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            qkv_bias=qkv_bias,
            o_bias=bool(hf.get("attention_bias", qkv_default)) if mt in O_BIAS else False,
            mlp_bias=bool(hf.get("mlp_bias", False)) if mt in ("llama", "smollm3") else False,
            qk_norm=qk_norm, qk_norm_full=mt in POST_NORM, post_norm=mt in POST_NORM,
            rope_layers=_rope_layers(hf, mt, n_layers, source),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings",
                                            mt in ("smollm3",) + GEMMA)),
            hidden_act=act, sliding_windows=windows, attn_sinks=mt == "gpt_oss",
            norm_fp32_product=mt == "gpt_oss",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"), moe=moe, hf=hf, **gemma, **phi, **kw)

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        f = Path(path) / "config.json"
        if not Path(path).is_dir():
            raise OrbitError(f"{path}: not a model directory")
        if not f.exists():
            raise OrbitError(f"{f}: missing (a model directory needs config.json)")
        try:
            hf = json.loads(f.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise OrbitError(f"{f}: not valid JSON ({e})") from None
        return cls.from_hf(hf, str(f))


def _activation(hf: dict, mt: str, source: str) -> str:
    """The MLP's activation: SiLU, or Gemma's tanh GELU (transformers reads Gemma 2/3's
    ``hidden_activation`` and ignores a ``hidden_act`` beside it)."""
    if mt in GEMMA:
        act = hf.get("hidden_activation") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise OrbitError(f"{source}: unsupported hidden_activation {act!r} (Gemma: only "
                             "gelu_pytorch_tanh)")
        return act
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise OrbitError(f"{source}: unsupported hidden_act {act!r} (only silu)")
    return act


def _gemma(hf: dict, mt: str, n_layers: int, source: str) -> dict:
    """Gemma 2 / Gemma 3 fields of ModelConfig (the per-layer windows among them),
    transformers' defaults for keys left out; for Gemma 3 also ``rope``: the
    full-attention layers' rotary parameters."""
    if mt not in GEMMA:
        return {}
    if hf.get("use_bidirectional_attention"):
        raise OrbitError(f"{source}: use_bidirectional_attention is not supported (causal "
                         "attention only)")

    def cap(key: str, default):
        v = hf.get(key, default)
        if v is not None and not v > 0:
            raise OrbitError(f"{source}: {key} must be positive or null, got {v!r}")
        return None if v is None else float(v)

    out = dict(norm_plus_one=True, sandwich_norm=True, embed_scale=True,
               query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
               # Gemma 3's attention never reads attn_logit_softcapping (transformers)
               attn_softcap=cap("attn_logit_softcapping", 50.0) if mt == "gemma2" else None,
               final_softcap=cap("final_logit_softcapping",
                                 30.0 if mt == "gemma2" else None))
    types = _gemma_layer_types(hf, mt, n_layers, source)
    window = hf.get("sliding_window", 4096)
    out["sliding_windows"] = [window if t == "sliding_attention" else None for t in types]
    if mt == "gemma3_text":
        full, local = _gemma3_ropes(hf)
        kind = local["rope_type"]
        if kind not in ROPE_TYPES:
            raise OrbitError(f"{source}: unsupported rope type {kind!r} for the sliding layers "
                             f"(rope_parameters.sliding_attention; supported: "
                             f"{', '.join(ROPE_TYPES)})")
        out.update(rope=full, local_rope=local,
                   local_rope_layers=[t == "sliding_attention" for t in types])
    return out


def _gemma_layer_types(hf: dict, mt: str, n_layers: int, source: str) -> list:
    """Gemma's per-layer attention kinds: ``layer_types``, else transformers' pattern (every
    ``sliding_window_pattern``-th layer global: 2 for Gemma 2, 6 by default for Gemma 3)."""
    types = hf.get("layer_types")
    if not types:
        every = 2 if mt == "gemma2" else int(hf.get("sliding_window_pattern") or 6)
        types = ["sliding_attention" if (i + 1) % every else "full_attention"
                 for i in range(n_layers)]
    if len(types) != n_layers:
        raise OrbitError(f"{source}: layer_types has {len(types)} entries for {n_layers} layers")
    return list(types)


def _gemma3_ropes(hf: dict) -> tuple[dict, dict]:
    """Gemma 3's rotary parameters: (full-attention layers', sliding layers'). transformers 5
    keys them by layer type (``rope_parameters``); older configs give ``rope_theta``, a flat
    ``rope_scaling`` that applies to the full-attention layers and ``rope_local_base_freq``
    for the sliding ones."""
    p = hf.get("rope_parameters")
    by_type = isinstance(p, dict) and bool(p) and all(isinstance(v, dict) for v in p.values())
    if by_type:
        full, local = dict(p.get("full_attention") or {}), dict(p.get("sliding_attention") or {})
    else:
        full, local = dict((p if isinstance(p, dict) else None) or hf.get("rope_scaling") or {}), {}
    for r in (full, local):
        r["rope_type"] = r.get("rope_type", r.pop("type", "default"))
    full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
    return full, local


def _one_rope(rope: dict, source: str, mt: str = "") -> dict:
    """The rotary parameters; OLMo 3 (and Gemma 3) key them by layer type, accepted here when
    every type has the same ones. A flat scaling in an OLMo 3 config applies to its
    full-attention layers only (transformers), which one rotary for every layer cannot
    express: refused unless it is the default rotary."""
    if rope and all(isinstance(v, dict) for v in rope.values()):  # keyed by layer type
        kinds = list(rope.values())
        if any(k != kinds[0] for k in kinds[1:]):
            raise OrbitError(f"{source}: rotary parameters that differ by layer type "
                             f"({', '.join(rope)}) are not supported yet")
        return dict(kinds[0])
    kind = rope.get("rope_type", rope.get("type", "default"))
    if mt == "olmo3" and kind != "default":
        raise OrbitError(f"{source}: an OLMo 3 rope scaling on the full-attention layers only "
                         f"({kind!r}) is not supported yet")
    return rope


def _rope_scaling(hf: dict, mt: str, rope: dict) -> tuple[dict, str]:
    """(rotary parameters, rope type) as transformers standardises them: the old key
    ``type``; Phi-3's ``su`` and ``yarn`` are its longrope; llama3 / yarn / longrope take
    ``original_max_position_embeddings`` from the top level of config.json where it is
    there (Phi-3 always: 4096 by default), else from the rotary parameters, else
    ``max_position_embeddings``."""
    rope = dict(rope)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if mt == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"
    if kind in ("llama3", "yarn", "longrope"):
        if mt == "phi3" or "original_max_position_embeddings" in hf:
            rope["original_max_position_embeddings"] = hf.get(
                "original_max_position_embeddings", 4096)
        else:
            rope.setdefault("original_max_position_embeddings",
                            hf.get("max_position_embeddings", 2048))
    rope["rope_type"] = kind
    return rope, kind


# rope type -> the keys its rotary parameters must carry
_ROPE_KEYS = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
              "longrope": ("short_factor", "long_factor")}


def _check_rope(hf: dict, rope: dict, kind: str, rotary_dim: int, source: str):
    """The keys a rope type needs (longrope's factor lists one per rotary frequency)."""
    where = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    for key in _ROPE_KEYS.get(kind, ()):
        if rope.get(key) is None:
            raise OrbitError(f"{source}: {where}.{key} is missing (rope type {kind!r})")
    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            if not isinstance(rope[key], list) or len(rope[key]) != rotary_dim // 2:
                raise OrbitError(f"{source}: {where}.{key} must be a list of "
                                 f"{rotary_dim // 2} numbers (rotary dim {rotary_dim} / 2)")


def _phi3(hf: dict, mt: str, rope: dict, source: str) -> dict:
    """Phi-3 / Phi-4 fields of ModelConfig: fused projections, and the channels of each head
    that rotate (``partial_rotary_factor``, in the rotary parameters or beside them)."""
    if mt != "phi3":
        return {}
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    rotary = int(head_dim * factor)
    if not 0 < rotary <= head_dim or rotary % 2:
        raise OrbitError(f"{source}: partial_rotary_factor {factor} gives {rotary} rotary "
                         f"channels of a {head_dim}-channel head (need an even count, > 0)")
    return dict(fused_proj=True, rotary_dim=rotary)


def _rope_layers(hf: dict, mt: str, n_layers: int, source: str) -> list:
    """Per layer, whether it applies rotary embeddings (SmolLM3's ``no_rope_layers``)."""
    if mt != "smollm3":
        return [True] * n_layers
    flags = hf.get("no_rope_layers")
    if flags is None:  # transformers' default: every no_rope_layer_interval-th layer is NoPE
        every = int(hf.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % every != 0) for i in range(n_layers)]
    if len(flags) != n_layers:
        raise OrbitError(f"{source}: no_rope_layers has {len(flags)} entries for "
                         f"{n_layers} layers")
    return [bool(f) for f in flags]


def _sliding_windows(hf: dict, mt: str, n_layers: int) -> list:
    """Per-layer sliding window, following each family's rule in transformers (Gemma's:
    ``_gemma``)."""
    window = hf.get("sliding_window", 128 if mt == "gpt_oss" else None)
    layer_types = hf.get("layer_types")
    if mt == "gpt_oss" and not layer_types:  # transformers' default: every other layer
        layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                       for i in range(n_layers)]
    if mt == "smollm3" and not hf.get("use_sliding_window"):
        return [None] * n_layers  # its layer_types apply only with use_sliding_window
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    if mt in ("mistral", "mixtral", "phi3"):
        return [window] * n_layers
    if mt in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and hf.get("use_sliding_window") and window:
        first = hf.get("max_window_layers", n_layers)
        return [window if i >= first else None for i in range(n_layers)]
    return [None] * n_layers
