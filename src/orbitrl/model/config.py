"""Decoder shape read from a Hugging Face ``config.json`` (Llama, Mistral, Qwen2, Qwen3,
SmolLM3, OLMo 2 / OLMo 3, and the mixture-of-experts families Mixtral, Qwen2-MoE, Qwen3-MoE:
see ``moe.py``; docs/models.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
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
}
# families whose o_proj bias follows attention_bias (the others have none)
O_BIAS = ("llama", "qwen3", "qwen3_moe", "smollm3", "olmo2", "olmo3")
POST_NORM = ("olmo2", "olmo3")
ROPE_TYPES = ("default", "linear", "llama3")


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
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    # per layer: None (full attention) or a window length in tokens
    sliding_windows: list = field(default_factory=list)
    # per layer: whether the layer rotates q and k (SmolLM3's no_rope_layers: 0 = NoPE)
    rope_layers: list = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    moe: object = None  # MoEConfig (model/moe.py) for the mixture-of-experts families
    hf: dict = field(default_factory=dict, repr=False)  # the raw config.json, for export

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise OrbitError(f"num_attention_heads {self.num_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_kv_heads}")
        if not self.sliding_windows:
            self.sliding_windows = [None] * self.num_layers
        if not self.rope_layers:
            self.rope_layers = [True] * self.num_layers

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0)
        attn += (2 * d if self.qk_norm else 0) + (h if self.o_bias else 0)
        attn += (q + kv if self.qk_norm_full else 0)
        mlp = 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)
        ffn = self.num_layers * mlp
        if self.moe is not None:  # sparse layers hold experts, a router (and a shared expert)
            ffn = sum(self.moe.ffn_params(j, h, mlp) for j in range(self.num_layers))
        emb = self.vocab_size * h
        return self.num_layers * (attn + 2 * h) + ffn + emb * (1 if self.tie_word_embeddings
                                                               else 2) + h

    @classmethod
    def from_hf(cls, hf: dict, source: str = "config.json") -> "ModelConfig":
        mt = hf.get("model_type")
        if mt not in FAMILIES:
            arch = hf.get("architectures") or [mt]
            raise OrbitError(f"{source}: unsupported architecture {arch[0]!r} (model_type "
                             f"{mt!r}); supported model_type: {', '.join(FAMILIES)}")
        qkv_default, qk_norm = FAMILIES[mt]
        try:
            heads = hf["num_attention_heads"]
            hidden = hf["hidden_size"]
            n_layers = hf["num_hidden_layers"]
            kw = dict(vocab_size=hf["vocab_size"], hidden_size=hidden,
                      intermediate_size=hf["intermediate_size"], num_layers=n_layers)
        except KeyError as e:
            raise OrbitError(f"{source}: missing key {e.args[0]!r}") from None
        act = hf.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise OrbitError(f"{source}: unsupported hidden_act {act!r} (only silu)")
        rope = _one_rope(dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {}),
                         source, mt)
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise OrbitError(f"{source}: unsupported rope type {rope_type!r} "
                             f"(supported: {', '.join(ROPE_TYPES)})")
        if mt in ("qwen2", "qwen2_moe"):
            qkv_bias = bool(hf.get("qkv_bias", True))
        else:
            qkv_bias = bool(hf.get("attention_bias", qkv_default))
        windows = _sliding_windows(hf, mt, n_layers)

        moe = MoEConfig.from_hf(hf, mt, n_layers, source)
        return cls(
            model_type=mt, num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hidden // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            rope_type=rope_type, rope_params=rope,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            qkv_bias=qkv_bias,
            o_bias=bool(hf.get("attention_bias", False)) if mt in O_BIAS else False,
            mlp_bias=bool(hf.get("mlp_bias", False)) if mt in ("llama", "smollm3") else False,
            qk_norm=qk_norm, qk_norm_full=mt in POST_NORM, post_norm=mt in POST_NORM,
            rope_layers=_rope_layers(hf, mt, n_layers, source),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", mt == "smollm3")),
            hidden_act=act, sliding_windows=windows, bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"), moe=moe, hf=hf, **kw)

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
    """Per-layer sliding window, following each family's rule in transformers."""
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    if mt == "smollm3" and not hf.get("use_sliding_window"):
        return [None] * n_layers  # its layer_types apply only with use_sliding_window
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    if mt in ("mistral", "mixtral"):
        return [window] * n_layers
    if mt in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and hf.get("use_sliding_window") and window:
        first = hf.get("max_window_layers", n_layers)
        return [window if i >= first else None for i in range(n_layers)]
    return [None] * n_layers
