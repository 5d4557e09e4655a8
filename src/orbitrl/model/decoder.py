"""The one decoder (Llama / Mistral / Qwen2 / Qwen3 / SmolLM3 / OLMo 2-3 / Gemma 2-3 / Phi-3,
and the mixture-of-experts families Mixtral / Qwen2-MoE / Qwen3-MoE / gpt-oss / DeepSeek-V3
through ``moe.py``; DeepSeek-V3's latent attention in ``mla.py``) that rolls out, scores
and trains. What sets the families apart is read from ``ModelConfig``: norm placement
(pre-norm, OLMo's post-norm, Gemma's sandwich), Gemma's (1 + w) norms, scaled embeddings,
attention scale and soft-capping (``attention.soft_cap``, in every attention path and in
``Decoder.head``), gpt-oss's attention sinks (handed to every attention path), and which
rotary each layer takes.

Module names follow Hugging Face's (``model.layers.3.self_attn.q_proj``) so that weights
and PEFT adapter names map one to one (see ``weights.py``); Phi-3/4 keep their fused
``qkv_proj`` and ``gate_up_proj`` (``ModelConfig.fused_proj``), split after the GEMM as
transformers does. Projections are plain ``nn.Linear`` modules; adapters and frozen
quantized formats replace them in place.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from orbitrl.model import gemm
from orbitrl.model.attention import build_mask, dense_attention, soft_cap
from orbitrl.model.config import ModelConfig
from orbitrl.model.dtensor import is_dtensor
from orbitrl.model.mla import MLAttention
from orbitrl.model.moe import Routing, make_ffn
from orbitrl.model.rope import Rotary, apply_rotary

# (layer_idx, q [B,T,Hq,D], k [B,T,Hkv,D], v [B,T,Hkv,D]) -> [B,T,Hq,D]; rope already applied;
# a layer with attention sinks (gpt-oss) also passes ``sinks=`` its [Hq] logits
AttentionBackend = Callable[..., torch.Tensor]


class RMSNorm(nn.Module):
    """``plus_one`` (Gemma): the weight is stored as an offset, ``x_normed * (1 + w)``, both
    in fp32 and the product rounded to x's dtype (transformers' Gemma RMSNorm).
    ``fp32_product`` (gpt-oss): ``w * x_normed`` in fp32, rounded once to x's dtype (the
    other families round x_normed first)."""

    def __init__(self, dim: int, eps: float, plus_one: bool = False,
                 fp32_product: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))
        self.eps = eps
        self.plus_one, self.fp32_product = plus_one, fp32_product

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if self.plus_one:
            xf = x.float()
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return (xf * (1.0 + self.weight.float())).to(dtype)
        if x.is_cpu:
            # on a CPU, F.rms_norm runs transformers' ``x * rsqrt(mean(x^2) + eps)`` (and
            # the weight's product) as one call from Python instead of six: the same bits,
            # values and gradients (a decode step calls this 2 * layers + 1 times); a CUDA
            # build may run a fused kernel that sums in another order
            d = (x.shape[-1],)
            if dtype == torch.float32 and self.weight.dtype == torch.float32:
                if not torch.is_grad_enabled():
                    # no graph to record (rollout, reference passes): the same products
                    # and sums as five ops, two in place, where F.rms_norm dispatches
                    # eight (about 11 against 18 us on 4 rows x 512)
                    v = torch.mean(x * x, -1, keepdim=True).add_(self.eps).rsqrt_()
                    return (x * v).mul_(self.weight)
                return F.rms_norm(x, d, self.weight, self.eps)
            x = F.rms_norm(x.float(), d, None, self.eps)
        else:
            if dtype != torch.float32:
                x = x.float()
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.fp32_product and dtype != torch.float32:
            return (self.weight.float() * x).to(dtype)
        return self.weight * (x if dtype == torch.float32 else x.to(dtype))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.attn_scale  # head_dim ** -0.5, or Gemma's query_pre_attn_scalar
        self.softcap = cfg.attn_softcap  # Gemma 2: cap * tanh(scores / cap)
        self.window = cfg.sliding_windows[layer_idx]
        h = cfg.hidden_size
        self.fused = cfg.fused_proj  # Phi-3/4: one qkv_proj, its output split into q, k, v
        if self.fused:
            self.qkv_proj = nn.Linear(h, (self.nh + 2 * self.nkv) * self.hd, bias=cfg.qkv_bias)
        else:
            self.q_proj = nn.Linear(h, self.nh * self.hd, bias=cfg.qkv_bias)
            self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=cfg.qkv_bias)
            self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=cfg.o_bias)
        # gpt-oss: a logit per query head in the softmax's denominator (attends to nothing)
        self.sinks = nn.Parameter(torch.empty(self.nh)) if cfg.attn_sinks else None
        self.rotary = cfg.rope_layers[layer_idx]  # False: a NoPE layer (SmolLM3)
        self.full_norm = cfg.qk_norm_full  # OLMo 2/3: norms over the whole projection
        if cfg.qk_norm or cfg.qk_norm_full:
            w = (self.nh * self.hd, self.nkv * self.hd) if cfg.qk_norm_full else (self.hd,) * 2
            self.q_norm = RMSNorm(w[0], cfg.rms_norm_eps, cfg.norm_plus_one)
            self.k_norm = RMSNorm(w[1], cfg.rms_norm_eps, cfg.norm_plus_one)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, masks, attn: Optional[AttentionBackend]):
        B, T, _ = x.shape
        if self.fused:
            q, k, v = self.qkv_proj(x).split((self.nh * self.hd, self.nkv * self.hd,
                                              self.nkv * self.hd), -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), None
        if self.full_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(B, T, self.nh, self.hd), k.view(B, T, self.nkv, self.hd)
        v = (self.v_proj(x) if v is None else v).view(B, T, self.nkv, self.hd)
        if self.q_norm is not None and not self.full_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        qk = None if torch.is_grad_enabled() or not self.rotary else _side_by_side(q, k)
        if qk is not None:  # one rotation of both (it acts on each head alone)
            q, k = apply_rotary(qk, cos, sin).split((self.nh, self.nkv), 2)
        elif self.rotary:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if attn is not None:
            out = attn(self.layer_idx, q, k, v) if self.sinks is None else \
                attn(self.layer_idx, q, k, v, sinks=self.sinks)
        else:
            out = dense_attention(q, k, v, masks(self.window), self.scale, masks.exact,
                                  self.softcap, self.sinks)
        return self.o_proj(out.reshape(B, T, self.nh * self.hd))


def _side_by_side(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q [B, T, Hq, D] and k [B, T, Hkv, D] as one [B, T, Hq + Hkv, D] view where each
    row's k heads follow its q heads in memory (one GEMM's output for the q/k/v
    projections, as the engine's packed CPU projections give), else None."""
    st = q.stride()
    if k.stride() != st or k.dtype != q.dtype or st[-1] != 1 or st[-2] != q.shape[-1] or \
            k.shape[:2] != q.shape[:2] or k.shape[-1] != q.shape[-1] or \
            k.data_ptr() != q.data_ptr() + q.shape[2] * q.shape[3] * q.element_size() or \
            k.untyped_storage().data_ptr() != q.untyped_storage().data_ptr():
        return None
    return q.as_strided((*q.shape[:2], q.shape[2] + k.shape[2], q.shape[3]), st)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.fused = cfg.fused_proj  # Phi-3/4: gate and up rows in one gate_up_proj
        if self.fused:
            self.gate_up_proj = nn.Linear(h, 2 * i, bias=b)
        else:
            self.gate_proj = nn.Linear(h, i, bias=b)
            self.up_proj = nn.Linear(h, i, bias=b)
        self.down_proj = nn.Linear(i, h, bias=b)
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"  # Gemma: GELU, tanh approximation

    def forward(self, x):
        if self.fused:  # transformers' chunk(2): gate first
            gate, up = self.gate_up_proj(x).chunk(2, -1)
            return self.down_proj(F.silu(gate) * up)
        if self.gelu:
            return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh")
                                  * self.up_proj(x))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        # DeepSeek-V3: multi-head latent attention (mla.py)
        self.self_attn = MLAttention(cfg, layer_idx, RMSNorm) if cfg.mla is not None \
            else Attention(cfg, layer_idx)
        # "mlp" (Mixtral: "block_sparse_moe"): a dense MLP or a sparse mixture (moe.py)
        self.ffn_name, ffn = make_ffn(cfg, layer_idx, lambda: MLP(cfg))
        setattr(self, self.ffn_name, ffn)
        self.post_norm, self.sandwich = cfg.post_norm, cfg.sandwich_norm

        def norm():
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_plus_one,
                           cfg.norm_fp32_product)

        if cfg.post_norm:  # OLMo 2/3: x + norm(attn(x)), then x + norm(mlp(x))
            self.post_feedforward_layernorm = norm()
        else:
            self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        if cfg.sandwich_norm:  # Gemma 2/3: x + norm(attn(norm(x))), then x + norm(mlp(norm(x)))
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def forward(self, x, cos, sin, masks, attn=None, routing: Routing | None = None):
        if self.sandwich:
            h = self.self_attn(self.input_layernorm(x), cos, sin, masks, attn)
            x = x + self.post_attention_layernorm(h)
            h = self._ffn(self.pre_feedforward_layernorm(x), routing)
            return x + self.post_feedforward_layernorm(h)
        if self.post_norm:
            x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, masks, attn))
            return x + self.post_feedforward_layernorm(self._ffn(x, routing))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, masks, attn)
        return x + self._ffn(self.post_attention_layernorm(x), routing)

    def _ffn(self, h, routing: Routing | None):
        ffn = getattr(self, self.ffn_name)
        return ffn(h) if isinstance(ffn, MLP) else ffn(h, routing)


class Backbone(nn.Module):
    """Embeddings, layers, final norm (Hugging Face's ``model.`` prefix)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_plus_one,
                            cfg.norm_fp32_product)


class _Masks:
    """Builds the dense mask once per distinct sliding window within one forward."""

    def __init__(self, seq_ids, positions, parent_ids=None, exact: bool = True):
        self.seq_ids, self.positions, self.parent_ids = seq_ids, positions, parent_ids
        self.exact = exact  # attention.sdpa: fp32 CPU attention computed in fp64
        self.cache = {}

    def __call__(self, window):
        if window not in self.cache:
            self.cache[window] = build_mask(self.seq_ids, self.positions, window,
                                            self.parent_ids)
        return self.cache[window]


_EMBED_SCALES: dict = {}


def _embed_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """Gemma's embedding multiplier: sqrt(hidden_size) as an fp32 tensor cast to the
    embeddings' dtype (transformers; bf16 makes sqrt(3072) 55.5), as a Python number, which
    multiplies exactly like that 0-d tensor and needs no device copy (CUDA graphs)."""
    key = (hidden_size, dtype)
    if key not in _EMBED_SCALES:
        root = torch.tensor(hidden_size ** 0.5, dtype=torch.float32)
        _EMBED_SCALES[key] = root.to(dtype).item()
    return _EMBED_SCALES[key]


_OFFLOAD_LOCK = threading.Lock()  # side-by-side workers (rl/parallel.py) share the counters


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape
                      and a.stride() == b.stride() and a.dtype == b.dtype
                      and a.device == b.device)


class ActivationOffload:
    """``Decoder.offload_activations``: the saved input of each recomputed decoder layer
    (all that recompute keeps for backward) copied into a host buffer of its own in forward,
    pinned when it comes from a CUDA device, and copied back to its device when backward
    recomputes the layer.

    It is a pair of saved-tensor hooks around each checkpointed layer. Checkpoint saves the
    layer's tensor arguments outside its own hooks, so the hooks see exactly the hidden
    state ``x`` and the rotary ``cos`` / ``sin``; those two are one pair shared by every
    layer of the forward (Gemma 3: two pairs, global and sliding layers') and stay as they
    are (``shared``), so only the hidden states move:
    layers x tokens x hidden x element size bytes per forward. On a CPU the host buffer is
    still a separate copy, so a CPU run takes the path a GPU run takes, at the cost of the
    copies (host and device being one memory, nothing is saved there).

    Counters, cumulative until ``reset()``: ``tensors_stored`` and ``bytes_to_host``
    (forward), ``tensors_restored`` and ``bytes_from_host`` (backward).
    """

    def __init__(self):
        self.reset()

    def reset(self):
        self.tensors_stored = self.bytes_to_host = 0
        self.tensors_restored = self.bytes_from_host = 0

    def hooks(self, *shared: torch.Tensor):
        """The saved-tensor hooks for a forward's checkpointed layers (a context manager,
        entered once per layer); ``shared``: tensors saved as they are."""

        def pack(t: torch.Tensor):
            if any(_same_tensor(t, s) for s in shared):
                return t, None
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu",
                               pin_memory=t.device.type == "cuda")
            host.copy_(t)
            with _OFFLOAD_LOCK:
                self.tensors_stored += 1
                self.bytes_to_host += host.numel() * host.element_size()
            return host, t.device

        def unpack(packed):
            host, device = packed
            if device is None:  # a shared tensor, never moved
                return host
            with _OFFLOAD_LOCK:
                self.tensors_restored += 1
                self.bytes_from_host += host.numel() * host.element_size()
            return host.to(device, non_blocking=host.is_pinned())

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


class Decoder(nn.Module):
    """Causal LM. ``forward`` returns logits [B, T, V] or, with ``return_hidden``, the final
    normed hidden states [B, T, H] (the trainer projects those chunk by chunk instead of
    materialising [tokens, vocab] logits).

    Attributes:
        recompute: recompute each decoder layer's activations in backward (saves the layer
            inputs only); used when training.
        offload_activations: with ``recompute``, keep those saved layer inputs in host
            memory (pinned on CUDA) until backward needs them (``ActivationOffload``; its
            byte and tensor counters are ``activation_offload``); without ``recompute``
            nothing is offloaded. The config key ``train.offload_activations`` sets it.
        attention_fp64: fp32 attention on a CPU computed in fp64 and rounded back, by this
            forward and by the engine's paged attention (``model.attention.sdpa``).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(cfg)
        # Gemma 3: the sliding layers' own rotary (another base; config.local_rope_layers)
        self.rotary_local = Rotary(cfg.local_rope_config()) if cfg.local_rope else None
        self.recompute = False
        self.offload_activations = False
        self.activation_offload = ActivationOffload()  # what offload_activations moved
        # mixtures: record/replay routing, router loss weights (moe.configure sets them)
        self.routing_replay = cfg.moe is not None
        self.router_aux_coef = self.router_z_coef = 0.0
        # fp32 CPU attention in fp64, here and in the engine (attention.sdpa; the config
        # key model.attention_fp64 sets it): rollout logprobs equal the trainer's
        self.attention_fp64 = True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                seq_ids: torch.Tensor | None = None, attn: AttentionBackend | None = None,
                return_hidden: bool = False,
                parent_ids: torch.Tensor | None = None,
                routing: Routing | None = None) -> torch.Tensor:
        """
        Args:
            input_ids: [B, T] token ids.
            positions: [B, T] position of each token within its own sequence; default
                0..T-1 per row. Packed rows restart positions at each sequence start.
            seq_ids: [B, T] sequence index of each token within its row, -1 for padding;
                default one sequence per row. Tokens attend within their sequence only.
            parent_ids: [B, T] optional: the sequence each token also attends to as its
                prefix (a shared prompt laid out once before its completions); see
                ``model.attention.build_mask``.
            attn: optional attention backend (the engine's paged KV cache); when given,
                ``positions`` must be given and ``seq_ids`` is ignored.
            return_hidden: return final hidden states [B, T, H] instead of logits.
            routing: mixtures only: record the experts each token chose, replay given ones,
                collect router logits for the router losses (``moe.Routing``).
        """
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        if seq_ids is None:
            seq_ids = torch.zeros_like(input_ids)
        x = self.model.embed_tokens(input_ids)
        if self.config.embed_scale:  # Gemma: times sqrt(hidden_size), rounded to x's dtype
            x = x * _embed_scale(self.config.hidden_size, x.dtype)
        cos, sin = self.rotary(positions, x.dtype)
        local = None if self.rotary_local is None else self.rotary_local(positions, x.dtype)
        masks = _Masks(seq_ids, positions, parent_ids, self.attention_fp64)
        if routing is not None:
            routing.valid = seq_ids.reshape(-1) >= 0
        recompute = self.recompute and torch.is_grad_enabled() and attn is None
        # checkpoint saves the layer inputs outside its own hooks, so these hooks see
        # exactly those: x moves to the host, the shared cos / sin stay
        offload = self.activation_offload.hooks(cos, sin, *(local or ())) \
            if recompute and self.offload_activations else nullcontext()
        sliding = self.config.local_rope_layers
        for i, layer in enumerate(self.model.layers):
            c, s = local if local is not None and sliding[i] else (cos, sin)
            if recompute:
                with offload:
                    x = checkpoint(layer, x, c, s, masks, None, routing,
                                   use_reentrant=False,
                                   context_fn=gemm.checkpoint_contexts)
            else:
                x = layer(x, c, s, masks, attn, routing)
        x = self.model.norm(x)
        return x if return_hidden else self.head(x)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits from final hidden states: ``lm_head``, then the final soft-capping where
        the family has it (Gemma's ``final_logit_softcapping``). The engine's samplers take
        their logits from here; the trainer's chunked logprobs apply the same cap
        (``train.logprobs.token_logprobs``)."""
        return soft_cap(self.lm_head(hidden), self.config.final_softcap)

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def head_column_major(self) -> bool:
        """Store an fp32 output head's weight column-major (``[V, H]`` with strides
        ``(1, V)``), on the CPU only. Returns whether it did.

        ``nn.Linear`` computes ``x @ W.T``; with ``W`` row-major that is a GEMM over a
        transposed operand, which MKL streams well under the machine's bandwidth for the few
        rows of a decode step: a 32k x 512 head took 6.0 ms at one row and 12 ms at two,
        against 2.4 and 4.6 ms with ``W.T`` contiguous (one thread). The head is the largest
        matrix of a small model. bf16 heads gained nothing in the same test and are left
        as they are.

        No extra memory at rest: the one Parameter is re-laid out (a tied embedding follows).
        Converting holds two copies of the head for a moment, and so does a safetensors
        export (written contiguous). Costs elsewhere: a tied embedding lookup gathers
        columns (about 0.5 ms for 128 tokens, 10 ms for 2048); gradients take the
        parameter's layout (``train/logprobs.py`` builds the head's gradient in it).
        Sharding (``distributed.fsdp``) makes the head row-major again. A model moved to a GPU
        afterwards keeps the layout, which cuBLAS takes as it is.
        """
        w = self.lm_head.weight
        if (w.device.type != "cpu" or w.dtype != torch.float32 or not w.is_contiguous()
                or w.shape[0] == 1):
            return False

        if is_dtensor(w):
            return False
        with torch.no_grad():
            w.data = w.data.t().contiguous().t()  # the one Parameter: a tied embedding follows
        return True

    @staticmethod
    def packed_inputs(sequences: list[list[int]], device=None):
        """Pack token lists into one row: (input_ids, positions, seq_ids), each [1, sum(T)]."""
        ids, pos, sid = [], [], []
        for i, s in enumerate(sequences):
            ids += s
            pos += range(len(s))
            sid += [i] * len(s)
        mk = lambda v: torch.tensor([v], dtype=torch.long, device=device)  # noqa: E731
        return mk(ids), mk(pos), mk(sid)


def inference_safe(model) -> bool:
    """Whether a no-grad forward of ``model`` may run under ``torch.inference_mode`` (less
    dispatch work per op): nothing it creates may outlive it into a forward with
    gradients. True for a dense model whose layers have no forward hooks; a mixture's
    recorded routing (replayed by the trainer) and layers whose hooks swap their weights
    in (tiers, sharding) need ``no_grad``. (A frozen base's dequantized cache is made
    outside inference mode either way: ``quant.FrozenLinear.compute_weight``.)"""
    return getattr(model.config, "moe", None) is None and \
        not any(layer._forward_pre_hooks for layer in model.model.layers)
