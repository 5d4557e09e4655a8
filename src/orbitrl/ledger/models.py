"""Model shapes for the ledgers: from a config.json dict, a known family/size, or a bare count.

The ledgers need only a handful of integers (layers, widths, heads, vocabulary, experts) to
price weights, gathered layers, activations and KV. A bare parameter count (``--params 1e12``)
is turned into a plausible shape by the usual aspect ratios, and its total is kept exact, so
that "1e12 parameters at 16 B" is 16e12 bytes and not a rounding of a synthetic shape.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape (Llama/Qwen/Mistral style; optional MoE feed-forward).

    ``num_experts == 0`` means dense. For MoE, ``expert_intermediate`` is one expert's
    feed-forward width, ``experts_per_token`` how many run per token, ``shared_experts``
    the always-on experts. ``total_override`` pins the parameter count of a shape synthesized
    from a bare count (the per-layer share then absorbs the rounding).
    """

    name: str
    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    tie_embeddings: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_experts: int = 0
    total_override: int | None = None
    fused_projections: bool = False  # Phi-3/4: one qkv_proj and one gate_up_proj per layer
    # gpt-oss: biases on q/k/v/o, the router and every expert projection, a sink per head
    biases: bool = False
    # multi-head latent attention (DeepSeek-V3): (q_lora_rank (0: one q_proj), kv_lora_rank,
    # qk_nope_head_dim, qk_rope_head_dim, v_head_dim); head_dim is then nope + rope
    mla: tuple = ()
    # MoE: the first dense_layers layers have a dense MLP (DeepSeek-V3's first_k_dense_replace)
    dense_layers: int = 0

    def __post_init__(self):
        for f in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "vocab"):
            if getattr(self, f) <= 0:
                raise ValueError(f"model shape: {f} must be positive")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def attn_params(self) -> int:
        """q, k, v, o projections of one layer (biases and sinks with ``biases`` only;
        elsewhere they are noise at this scale). MLA: q_a / q_b (or q_proj),
        kv_a_proj_with_mqa, kv_b_proj, o_proj and the two latent norms."""
        if self.mla:
            ql, kl, nope, rope, v = self.mla
            h, nh = self.hidden, self.num_heads
            q = h * ql + ql + ql * nh * (nope + rope) if ql else h * nh * (nope + rope)
            return q + h * (kl + rope) + kl + kl * nh * (nope + v) + nh * v * h
        q = self.hidden * self.num_heads * self.head_dim
        kv = 2 * self.hidden * self.num_kv_heads * self.head_dim
        extra = self.num_heads * (self.head_dim + 1) + self.kv_dim * 2 + self.hidden \
            if self.biases else 0
        return 2 * q + kv + extra

    @property
    def dense_mlp_params(self) -> int:
        """A SwiGLU MLP (gate, up, down) of one dense layer, or the shared experts of a MoE one."""
        if self.is_moe:
            return 3 * self.hidden * self.expert_intermediate * self.shared_experts
        return 3 * self.hidden * self.intermediate

    @property
    def expert_params(self) -> int:
        """All routed experts of one layer plus the router (0 for dense)."""
        if not self.is_moe:
            return 0
        bias = 2 * self.expert_intermediate + self.hidden + 1 if self.biases else 0
        return self.num_experts * (3 * self.hidden * self.expert_intermediate + self.hidden
                                   + bias)

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tie_embeddings else 2)

    @property
    def _dense_excess(self) -> int:
        """What the dense layers of a mixture (``dense_layers``) hold beyond sparse ones'
        feed-forwards, in all."""
        if not self.dense_layers:
            return 0
        ffn = self.dense_mlp_params + self.expert_params
        return self.dense_layers * (3 * self.hidden * self.intermediate - ffn)

    @property
    def _dense_layer_excess(self) -> int:
        """:attr:`_dense_excess` spread over all layers (``layer_params`` is an average)."""
        return self._dense_excess // self.num_layers

    @property
    def _computed_layer_params(self) -> int:
        return self.attn_params + self.dense_mlp_params + self.expert_params + 2 * self.hidden \
            + self._dense_layer_excess

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (what a per-layer gather or offload moves)."""
        if self.total_override is None:
            return self._computed_layer_params
        return max(1, (self.total_override - self.embed_params) // self.num_layers)

    @property
    def gathered_layer_params(self) -> int:
        """Parameters gathered whole per layer: routed experts stay expert-parallel."""
        scale = self.layer_params / self._computed_layer_params
        return int((self.attn_params + self.dense_mlp_params + 2 * self.hidden
                    + max(0, self._dense_layer_excess)) * scale) \
            if self.is_moe else self.layer_params

    @property
    def total_params(self) -> int:
        if self.total_override is not None:
            return self.total_override
        rest = self._dense_excess - self.num_layers * self._dense_layer_excess  # (rounding)
        return self.embed_params + self.num_layers * self.layer_params + self.hidden + rest

    @property
    def active_params(self) -> int:
        """Parameters touched per token (sets compute: about 2 flops each forward)."""
        if not self.is_moe:
            return self.total_params
        routed = self.experts_per_token * 3 * self.hidden * self.expert_intermediate
        routed += self.dense_layers * (3 * self.hidden * self.intermediate - routed
                                       - self.dense_mlp_params) // self.num_layers
        per_layer = self.attn_params + self.dense_mlp_params + routed
        scale = self.layer_params / self._computed_layer_params
        return int(self.num_layers * per_layer * scale) + self.embed_params

    @property
    def changed_fraction(self) -> float:
        """Share of the weights a step changes, for a delta weight sync: about 1-3% of a
        dense model's parameters and 0.02-0.05% of a mixture's (most of its experts see few
        tokens, and most bf16 updates round away); the upper ends, measured on large runs."""
        return 5e-4 if self.is_moe else 0.03

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def kv_latent(self) -> int:
        """MLA: values the KV cache keeps per token and layer (kv_lora_rank + rope); 0
        otherwise (K and V per kv head)."""
        return self.mla[1] + self.mla[3] if self.mla else 0

    def adapter_params(self, rank: int) -> int:
        """LoRA parameters at ``rank`` on attention and dense/shared MLP projections.

        Routed experts get no adapters (the usual choice; they would cost ``num_experts``
        times more). About 0.1% of a large dense model at rank 16.
        """
        h, q, kv = self.hidden, self.num_heads * self.head_dim, self.kv_dim
        attn = rank * ((h + q) + 2 * (h + kv) + (q + h))
        f = self.expert_intermediate * self.shared_experts if self.is_moe else self.intermediate
        mlp = rank * 3 * (h + f) if f else 0
        if self.fused_projections:  # one adapter on qkv_proj, one on gate_up_proj
            attn = rank * ((h + q + 2 * kv) + (q + h))
            mlp = rank * ((h + 2 * f) + (f + h))
        if self.mla:  # q_a, q_b (or q_proj), kv_a_proj_with_mqa, kv_b_proj, o_proj
            ql, kl, nope, rope, v = self.mla
            qk = self.num_heads * (nope + rope)
            attn = rank * ((h + ql) + (ql + qk) if ql else h + qk)
            attn += rank * ((h + kl + rope) + (kl + self.num_heads * (nope + v))
                            + (self.num_heads * v + h))
        dense = self.dense_layers * (rank * 3 * (h + self.intermediate) - mlp)  # (MoE)
        return self.num_layers * (attn + mlp) + dense


def from_config(cfg: dict, name: str = "config") -> ModelShape:
    """Shape from a Hugging Face ``config.json`` dict (Llama, Qwen2/3, Mistral, Mixtral,
    Qwen2/3-MoE, gpt-oss, DeepSeek-ish). A Qwen2-MoE shared expert of width S counts as
    S / (expert width) shared experts."""
    c = cfg.get("text_config", cfg)
    try:
        hidden = int(c["hidden_size"])
        layers = int(c["num_hidden_layers"])
        heads = int(c["num_attention_heads"])
        vocab = int(c["vocab_size"])
    except KeyError as e:
        raise ValueError(f"{name}: config.json lacks {e.args[0]}") from None
    kv_heads = int(c.get("num_key_value_heads") or heads)
    gemma = c.get("model_type") in ("gemma2", "gemma3_text")  # transformers' defaults below
    head_dim = int(c.get("head_dim") or (256 if gemma else hidden // heads))
    experts = int(c.get("num_local_experts") or c.get("n_routed_experts") or c.get("num_experts") or 0)
    width = int(c.get("moe_intermediate_size") or c.get("intermediate_size", 0)) if experts else 0
    shared = int(c.get("n_shared_experts") or 0)
    mla, dense = (), 0
    if c.get("model_type") == "deepseek_v3":  # transformers' defaults for what is left out
        mla = (int(c.get("q_lora_rank", 1536) or 0), int(c.get("kv_lora_rank", 512)),
               int(c.get("qk_nope_head_dim", 128)), int(c.get("qk_rope_head_dim", 64)),
               int(c.get("v_head_dim", 128)))
        head_dim, kv_heads = mla[2] + mla[3], heads
        shared = int(c.get("n_shared_experts", 1) or 0)
        dense = min(layers, int(c.get("first_k_dense_replace", 3)))
    if experts and c.get("shared_expert_intermediate_size"):  # Qwen2-MoE: one wide shared expert
        shared = max(1, round(int(c["shared_expert_intermediate_size"]) / width))
    return ModelShape(
        name=name, num_layers=layers, hidden=hidden, intermediate=int(c.get("intermediate_size", 4 * hidden)),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, vocab=vocab,
        tie_embeddings=bool(c.get("tie_word_embeddings", gemma)), num_experts=experts,
        experts_per_token=int(c.get("num_experts_per_tok") or (2 if experts else 0)),
        expert_intermediate=width, shared_experts=shared,
        fused_projections=c.get("model_type") == "phi3",
        biases=c.get("model_type") == "gpt_oss", mla=mla, dense_layers=dense,
    )


def load_model_dir(path: str) -> ModelShape:
    """Shape from a checkpoint directory's ``config.json`` (read as JSON; nothing else loaded)."""
    cfg_path = os.path.join(path, "config.json") if os.path.isdir(path) else path
    with open(cfg_path) as f:
        return from_config(json.load(f), name=os.path.basename(os.path.normpath(path)))


def from_params(total: float, moe_experts: int = 0, moe_active: int = 8, name: str | None = None) -> ModelShape:
    """A plausible shape for ``total`` parameters, dense or MoE, with the total kept exact.

    Dense: about 12 h^2 per layer (attention 4 h^2, SwiGLU 8 h^2) and h/L about 128 (Llama 3),
    so h = (128 P / 12)^(1/3). MoE: expert width h/4 and h/L about 118 (DeepSeek-V3, Kimi K2),
    so h = (118 P / (4 + 0.75 E))^(1/3).
    """
    total = int(total)
    if total <= 0:
        raise ValueError("parameter count must be positive")
    step = 1024 if total > 5e10 else 512 if total > 3e8 else 64
    if moe_experts:
        h = _round_to((118 * total / (4 + 0.75 * moe_experts)) ** (1 / 3), step)
        f = _round_to(h / 4, 128)
        per_layer = 4 * h * h + moe_experts * 3 * h * f
    else:
        h = _round_to((128 * total / 12) ** (1 / 3), step)
        f = _round_to(8 * h / 3, 64)
        per_layer = 12 * h * h
    vocab = 128_256 if total > 5e8 else max(256, min(32_000, int(total / (8 * h))))
    layers = max(1, round((total - 2 * vocab * h) / per_layer))
    heads = max(1, h // 128) if h >= 128 else max(1, h // 64)
    shape = ModelShape(
        name=name or f"{total:.3g}-params{'-moe' if moe_experts else ''}", num_layers=layers,
        hidden=h, intermediate=f, num_heads=heads, num_kv_heads=max(1, heads // 8),
        head_dim=h // heads,
        vocab=vocab, num_experts=moe_experts,
        experts_per_token=moe_active if moe_experts else 0,
        expert_intermediate=f if moe_experts else 0, shared_experts=1 if moe_experts else 0)
    return replace(shape, total_override=total)


def _round_to(x: float, m: int) -> int:
    return max(m, int(round(x / m)) * m) if x >= m else max(8, int(round(x / 8)) * 8)


# Known family/size shapes, from the published config.json files.
KNOWN: dict[str, ModelShape] = {s.name: s for s in [
    ModelShape("qwen2.5-0.5b", 24, 896, 4864, 14, 2, 64, 151_936, tie_embeddings=True),
    ModelShape("qwen2.5-1.5b", 28, 1536, 8960, 12, 2, 128, 151_936, tie_embeddings=True),
    ModelShape("qwen2.5-7b", 28, 3584, 18944, 28, 4, 128, 152_064),
    ModelShape("qwen2.5-32b", 64, 5120, 27648, 40, 8, 128, 152_064),
    ModelShape("qwen2.5-72b", 80, 8192, 29568, 64, 8, 128, 152_064),
    ModelShape("llama3-8b", 32, 4096, 14336, 32, 8, 128, 128_256),
    ModelShape("llama3-70b", 80, 8192, 28672, 64, 8, 128, 128_256),
    ModelShape("llama3-405b", 126, 16384, 53248, 128, 8, 128, 128_256),
    ModelShape("mistral-7b", 32, 4096, 14336, 32, 8, 128, 32_768),
    ModelShape("mixtral-8x7b", 32, 4096, 14336, 32, 8, 128, 32_000, num_experts=8,
               experts_per_token=2, expert_intermediate=14336),
    ModelShape("deepseek-v3", 61, 7168, 18432, 128, 128, 192, 129_280, num_experts=256,
               experts_per_token=8, expert_intermediate=2048, shared_experts=1,
               mla=(1536, 512, 128, 64, 128), dense_layers=3),
    ModelShape("kimi-k2", 61, 7168, 18432, 64, 64, 192, 163_840, num_experts=384,
               experts_per_token=8, expert_intermediate=2048, shared_experts=1,
               mla=(1536, 512, 128, 64, 128), dense_layers=1),
]}


def known(name: str) -> ModelShape:
    """A known shape by name (case-insensitive); ValueError listing the names otherwise."""
    key = name.lower()
    if key not in KNOWN:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN))}")
    return KNOWN[key]


def parse_count(text: str) -> int:
    """'1e12', '1.6T', '70B', '7e9', '500M' -> an int count; ValueError if not positive."""
    t = str(text).strip().upper().replace("_", "")
    mult = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(t[-1:], None)
    try:
        value = float(t[:-1]) * mult if mult else float(t)
    except ValueError:
        raise ValueError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"must be positive, got {text!r}")
    return int(value)
