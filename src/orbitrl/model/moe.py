"""Mixture-of-experts feed-forward layers (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss,
DeepSeek-V3) and routing I/O.

A sparse layer holds a router (``gate``: one logit per expert), ``num_experts`` SwiGLU
experts and, for Qwen2-MoE, a shared expert scaled by ``sigmoid(shared_expert_gate(x))``.
Every token runs its top-k experts, weighted by the router's softmax at those experts
(renormalised over the k for Mixtral, and for Qwen when ``norm_topk_prob``). Module names are
the checkpoints' (``mlp.experts.3.up_proj``, Mixtral's ``block_sparse_moe.experts.3.w3``), so
loading, export, frozen formats and LoRA treat each expert projection as one more linear.

gpt-oss: the router (``router``) has a bias and its weights are a softmax over the k largest
logits; experts have biases and a clamped SwiGLU (:func:`clamped_swiglu`). Its checkpoints
store each layer's experts fused (``mlp.experts.gate_up_proj`` and the rest); the loader
splits them into the same per-expert projections (``mlp.experts.3.gate_proj``) and export
fuses them back (``weights.py``).

DeepSeek-V3: sigmoid scores; the experts are chosen on the scores plus a correction bias
(``gate.e_score_correction_bias``, a buffer), within the ``topk_group`` of ``n_group``
expert groups whose two best corrected scores sum highest; the weights are the uncorrected
scores at the chosen experts, renormalised when ``norm_topk_prob``, times
``routed_scaling_factor`` (:func:`route`). Its shared experts (``mlp.shared_experts``, one
SwiGLU ``n_shared_experts`` experts wide) are added ungated.

Experts are computed grouped: the (token, slot) pairs are sorted by expert once, and each
active expert runs one matmul chain over its contiguous slice; inactive experts are never
called, so a quantized base dequantizes only the active experts' weights.

Routing replay. A :class:`Routing` passed to ``Decoder.forward`` records each token's chosen
expert ids per sparse layer (the engine, during rollout), or replays given ids (the trainer):
the forward then uses those experts, with their weights recomputed from the current router,
so the gradient still reaches the router and the sampled token's logprob is the one the
engine computed, even where a weight update or rounding would flip a near-tied choice. The
same object collects what the router losses need (load balancing, z-loss).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from orbitrl.errors import OrbitError
from orbitrl.model.quant import FrozenLinear

MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3")
# projection names (gate, up, down) of one expert, per family (gpt-oss: ours, see weights.py)
_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
                 "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
                 "gpt_oss": ("gate_proj", "up_proj", "down_proj"),
                 "deepseek_v3": ("gate_proj", "up_proj", "down_proj")}
# a routed expert's projection, by module name (LoRA leaves these out unless asked)
ROUTED_EXPERT = re.compile(r".*\.(mlp|block_sparse_moe)\.experts\.\d+\.\w+$")


@dataclass
class MoEConfig:
    """The sparse layers' shape, read from an HF ``config.json``.

    ``sparse_layers``: indices of the layers whose feed-forward is a mixture (Qwen's
    ``decoder_sparse_step`` / ``mlp_only_layers`` leave others dense)."""
    family: str
    num_experts: int
    top_k: int
    expert_intermediate: int
    norm_topk_prob: bool
    shared_intermediate: int = 0
    sparse_layers: tuple = ()
    bias: bool = False  # gpt-oss: the router and every expert projection have biases
    swiglu: tuple | None = None  # gpt-oss: (alpha, limit) of its clamped SwiGLU
    softmax_topk: bool = False  # gpt-oss: the weights are a softmax over the k chosen logits
    # DeepSeek-V3: sigmoid scores, a correction bias, group-limited choice (route's
    # ``grouped``): (n_group, topk_group, routed_scaling_factor)
    grouped: tuple | None = None

    @classmethod
    def from_hf(cls, hf: dict, mt: str, n_layers: int, source: str) -> "MoEConfig | None":
        """None for dense families; a one-line OrbitError naming the key otherwise."""
        if mt not in MOE_FAMILIES:
            return None
        local = mt in ("mixtral", "gpt_oss")  # num_local_experts, as wide as intermediate_size
        deep = mt == "deepseek_v3"
        if deep:  # transformers' defaults for the keys a config leaves out
            hf = {"n_routed_experts": 256, "num_experts_per_tok": 8,
                  "moe_intermediate_size": 2048, **hf}
        key = "num_local_experts" if local else "n_routed_experts" if deep else "num_experts"
        experts = hf.get(key, hf.get("num_local_experts"))
        width = hf.get("intermediate_size") if local else hf.get("moe_intermediate_size")
        need = {key: experts, "num_experts_per_tok": hf.get("num_experts_per_tok"),
                "intermediate_size" if local else "moe_intermediate_size": width}
        if mt == "qwen2_moe":
            need["shared_expert_intermediate_size"] = hf.get("shared_expert_intermediate_size")
        if deep:
            need.update((k, hf.get(k, d)) for k, d in (("n_group", 8), ("topk_group", 4)))
            if hf.get("n_shared_experts", 1):
                need["n_shared_experts"] = hf.get("n_shared_experts", 1)
            first = hf.get("first_k_dense_replace", 3)
            if not isinstance(first, int) or isinstance(first, bool) or first < 0:
                raise OrbitError(f"{source}: key 'first_k_dense_replace' must be an integer "
                                 f">= 0, got {first!r}")
        for k, v in need.items():
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise OrbitError(f"{source}: key {k!r} must be a positive integer, got {v!r}")
        if need["num_experts_per_tok"] > experts:
            raise OrbitError(f"{source}: num_experts_per_tok {need['num_experts_per_tok']} "
                             f"exceeds {key} {experts}")
        grouped, shared = None, need.get("shared_expert_intermediate_size", 0)
        if deep:
            g, tg = need["n_group"], need["topk_group"]
            if experts % g or tg > g or experts // g < 2 or tg * experts // g < need[
                    "num_experts_per_tok"]:
                raise OrbitError(f"{source}: n_group {g} / topk_group {tg} do not fit {key} "
                                 f"{experts} with num_experts_per_tok "
                                 f"{need['num_experts_per_tok']} (groups of 2 or more experts "
                                 "that hold the top-k)")
            grouped = (g, tg, float(hf.get("routed_scaling_factor", 2.5)))
            shared = width * need.get("n_shared_experts", 0)
        if hf.get("router_jitter_noise"):
            raise OrbitError(f"{source}: router_jitter_noise {hf['router_jitter_noise']} is not "
                             "supported (set it to 0)")
        step = hf.get("decoder_sparse_step", 1) or 1
        dense = set(hf.get("mlp_only_layers") or [])
        sparse = tuple(i for i in range(n_layers) if i not in dense and (i + 1) % step == 0)
        if deep:  # the first first_k_dense_replace layers are dense
            sparse = tuple(range(first, n_layers))
        gpt = mt == "gpt_oss"
        swiglu = None
        if gpt:
            swiglu = (hf.get("swiglu_alpha", 1.702), hf.get("swiglu_limit", 7.0))
            for k, v in zip(("swiglu_alpha", "swiglu_limit"), swiglu):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                    raise OrbitError(f"{source}: key {k!r} must be a positive number, got {v!r}")
            swiglu = tuple(float(v) for v in swiglu)
        return cls(mt, experts, need["num_experts_per_tok"], width,
                   local or bool(hf.get("norm_topk_prob", deep)), shared, sparse, bias=gpt,
                   swiglu=swiglu, softmax_topk=gpt, grouped=grouped)

    @property
    def ffn_attr(self) -> str:
        """The layer attribute holding the feed-forward (Mixtral's checkpoints name it so)."""
        return "block_sparse_moe" if self.family == "mixtral" else "mlp"

    @property
    def router_attr(self) -> str:
        """The sparse layer attribute holding the router (the checkpoints' name)."""
        return "router" if self.family == "gpt_oss" else "gate"

    @property
    def shared_attr(self) -> str:
        """The sparse layer attribute holding the shared expert(s) (DeepSeek-V3: plural,
        and no gate)."""
        return "shared_experts" if self.family == "deepseek_v3" else "shared_expert"

    def ffn_params(self, layer: int, hidden: int, dense_params: int) -> int:
        """Parameters of layer ``layer``'s feed-forward (router, biases and shared expert
        included)."""
        if layer not in self.sparse_layers:
            return dense_params
        shared = 3 * hidden * self.shared_intermediate + (self.grouped is None) * hidden \
            if self.shared_intermediate else 0
        w = self.expert_intermediate
        bias = 2 * w + hidden + 1 if self.bias else 0  # gate, up, down and a router logit
        return self.num_experts * (3 * hidden * w + hidden + bias) + shared


# ---- routing I/O ------------------------------------------------------------------------

@dataclass
class Routing:
    """Routing input/output of one forward call (pass as ``Decoder.forward(routing=...)``).

    Args:
        replay: [S, N, k] expert ids per sparse layer for the call's N = B * T tokens (row
            major), -1 where a token routes freely (e.g. the last sampled token, which the
            engine never fed back). None: the router chooses.
        record: keep the ids each sparse layer used in ``chosen`` (layer -> [N, k]).
        aux: keep each sparse layer's router logits [N, E] for :func:`router_losses`.
    ``valid`` [N] (set by the decoder from ``seq_ids``) excludes padding from the losses.
    Entries are keyed by sparse-layer index, so a recomputed layer (activation
    checkpointing) overwrites rather than appends.
    """
    replay: torch.Tensor | None = None
    record: bool = False
    aux: bool = False
    chosen: dict = field(default_factory=dict)
    logits: dict = field(default_factory=dict)
    valid: torch.Tensor | None = None

    def chosen_tensor(self) -> torch.Tensor:
        """The recorded ids [S, N, k] in sparse-layer order."""
        return torch.stack([self.chosen[i] for i in sorted(self.chosen)])


class RoutingLog:
    """A sequence's recorded routing in the engine: chunks of positions [start, start + n)
    with their ids [S, n, k]; later chunks win (a preempted sequence is recomputed)."""

    def __init__(self):
        self.chunks: list[tuple[int, torch.Tensor]] = []

    def write(self, start: int, ids: torch.Tensor) -> None:
        self.chunks.append((start, ids))

    def copy(self) -> "RoutingLog":
        out = RoutingLog()
        out.chunks = list(self.chunks)
        return out

    def tensor(self, length: int) -> torch.Tensor | None:
        """[S, length, k] int16, -1 at positions never computed here (a prefix-cache hit,
        the last sampled token)."""
        if not self.chunks:
            return None
        S, _, k = self.chunks[0][1].shape
        out = torch.full((S, length, k), -1, dtype=torch.int16)
        for start, ids in self.chunks:
            n = min(ids.shape[1], length - start)
            out[:, start:start + n] = ids[:, :n]
        return out


def record_routing(items, routing: Routing) -> None:
    """Engine side: split one step's recorded ids over its sequences. ``items``: the
    (sequence, n) pairs in the order their tokens were laid out in the row; each sequence's
    ``routing`` (a :class:`RoutingLog`, created here) gets positions
    [num_computed, num_computed + n)."""
    ids = routing.chosen_tensor().to("cpu", torch.int16)  # [S, N, k], one copy per step
    off = 0
    for seq, n in items:
        if seq.routing is None:
            seq.routing = RoutingLog()
        seq.routing.write(seq.num_computed, ids[:, off:off + n])
        off += n


def wants_routing(model) -> bool:
    """Whether ``model`` is a mixture with routing replay switched on."""
    return (getattr(model.config, "moe", None) is not None
            and getattr(model, "routing_replay", False))


def replay_routing(model, replay: torch.Tensor | None, aux: bool = False) -> Routing | None:
    """The Routing for one trainer forward: replays ``replay`` when the model replays, and
    collects router logits when ``aux`` and a router loss is configured; None for a dense
    model (nothing to pass)."""
    if getattr(model.config, "moe", None) is None:
        return None
    use = replay if wants_routing(model) else None
    want_aux = aux and (getattr(model, "router_aux_coef", 0.0) > 0
                        or getattr(model, "router_z_coef", 0.0) > 0)
    return Routing(replay=use, aux=want_aux)


# ---- routing and experts ------------------------------------------------------------------

def route(logits: torch.Tensor, top_k: int, norm: bool, ids: torch.Tensor | None = None,
          softmax_topk: bool = False, grouped: tuple | None = None):
    """Top-k routing from router logits [N, E]: softmax in fp32, the k largest (or the given
    ``ids`` [N, k], -1 = choose), renormalised over the k when ``norm``; with
    ``softmax_topk`` (gpt-oss, as transformers computes it) the k largest logits, then a
    softmax over those k; with ``grouped`` (DeepSeek-V3: correction bias [E], n_group,
    topk_group, routed_scaling_factor) see :func:`_route_grouped`. Returns (ids [N, k]
    long, weights [N, k] in the logits' dtype)."""
    if grouped is not None:
        return _route_grouped(logits, top_k, norm, ids, *grouped)
    probs = logits if softmax_topk else torch.softmax(logits, dim=-1, dtype=torch.float32)
    top_w, top_i = torch.topk(probs, top_k, dim=-1)
    if ids is not None:
        ids = ids.to(device=logits.device, dtype=torch.long)
        free = (ids < 0).any(-1, keepdim=True)
        top_i = torch.where(free, top_i, ids)
        top_w = probs.gather(1, top_i)
    if softmax_topk:
        top_w = torch.softmax(top_w, dim=-1, dtype=torch.float32)
    elif norm:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return top_i, top_w.to(logits.dtype)


def _route_grouped(logits, top_k: int, norm: bool, ids, bias: torch.Tensor, groups: int,
                   keep: int, scale: float):
    """DeepSeek-V3's router (transformers' ``DeepseekV3TopkRouter``): sigmoid scores; the
    choice ranks ``scores + bias`` within the ``keep`` groups (of ``groups`` equal ones)
    whose two best corrected scores sum highest; the weights are the uncorrected scores at
    the chosen (or replayed) ids, over their sum (+1e-20) when ``norm``, times ``scale``.
    The bias only chooses: it carries no gradient and is not in the weights."""
    scores = _by_rows(torch.sigmoid, logits.float())  # a row's bits whatever the row count
    n, e = scores.shape
    choice = scores + bias
    best = choice.view(n, groups, e // groups).topk(2, dim=-1)[0].sum(dim=-1)  # [N, G]
    kept = torch.zeros_like(best).scatter_(1, torch.topk(best, keep, dim=-1, sorted=False)[1], 1)
    choice = choice.masked_fill(~kept.bool().repeat_interleave(e // groups, 1), float("-inf"))
    top_i = torch.topk(choice, top_k, dim=-1, sorted=False)[1]
    if ids is not None:
        ids = ids.to(device=logits.device, dtype=torch.long)
        top_i = torch.where((ids < 0).any(-1, keepdim=True), top_i, ids)
    w = scores.gather(1, top_i)
    if norm:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return top_i, (w * scale).to(logits.dtype)


def grouped_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    experts: nn.ModuleList, packed=None) -> torch.Tensor:
    """sum_j weights[:, j] * experts[ids[:, j]](x), grouped by expert.

    x [N, H], ids [N, k], weights [N, k] -> [N, H]. The N * k (token, slot) pairs are sorted
    by expert id once; each active expert computes its contiguous slice in one call (one
    matmul per projection), and the weighted results are summed back per token with one
    ``index_add_`` (in expert order per token, as transformers adds them). One host sync
    (the per-expert counts) per call. ``packed``: the stacked buffers and weights of
    :func:`pack_experts` (from ``_packed_weights``), computed in grouped GEMMs instead of the
    per-expert loop. On a CPU an expert's slice of fewer than ``ROW_FLOOR`` rows is padded
    with zero rows to :func:`row_count` (see there) in the forward, so a token's result does
    not depend on how many other tokens chose its experts; the stacked path's backward
    runs on the real rows only (gradients need no row invariance).
    """
    N, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    token = order // k  # [N * k] token of each sorted slot
    pad = x.device.type == "cpu" and any(0 < c < ROW_FLOOR and row_count(c) != c
                                          for c in counts)
    padding = _padded_slots(token, counts) if pad else None
    w = weights.reshape(-1).index_select(0, order)[:, None]
    if packed is not None:  # stacked weights (pack_experts): grouped GEMMs
        (gu, dn), weights_ = packed
        if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad
                                        or any(p.requires_grad for p in weights_)):
            ys = _PackedExperts.apply(x, token, counts, padding, gu, dn, w, *weights_)
        else:
            ys = _packed_forward(x, token, counts, padding, gu, dn).mul_(w)
    else:
        if pad:
            token_p, keep, pcounts, _ = padding
            xs = _gather_padded(x, token_p, padding)
        else:
            xs, pcounts = x.index_select(0, token), counts
        # split, not slices: a slice's backward fills a zero tensor the size of ``xs`` per
        # expert, split's concatenates once (a quarter of the layer's backward at 1k tokens)
        parts = xs.split(pcounts)
        ys = torch.cat([experts[e].forward(p) for e, p in enumerate(parts) if pcounts[e]])
        if pad:
            ys = ys.index_select(0, keep)
        ys = ys * w if torch.is_grad_enabled() else ys.mul_(w)
    return x.new_zeros(N, x.shape[-1]).index_add_(0, token, ys.to(x.dtype))


# An MKL fp32 GEMM computes a row of its output the same way whatever the row count M,
# except for M < 12 that is not a multiple of 4 (measured with 1, 2 and 4 threads: M = 1, 2,
# 3, 5, 6, 7, 9, 10, 11 take other kernels and differ from the M >= 12 result by ulps).
ROW_FLOOR = 12


def row_count(m: int) -> int:
    """The rows a matmul of ``m`` rows runs with on a CPU so that each row's result is the
    one it gets in any larger batch: ``m`` itself from ``ROW_FLOOR`` up, else ``m`` rounded
    up to a multiple of 4 (at most 3 zero rows)."""
    return m if m >= ROW_FLOOR else -(-m // 4) * 4


def _padded_slots(token: torch.Tensor, counts: list[int]):
    """The sorted slots' token index with each short expert slice padded to
    :func:`row_count` rows (padding entries point at token 0 and are zeroed after the
    gather, see :func:`_gather_padded`); the positions of the real slots in it; the padded
    counts; the positions of the padding entries."""
    padded = [row_count(c) if c else 0 for c in counts]
    fill, at = [], 0
    for c, p in zip(counts, padded):
        fill.extend(range(at + c, at + p))
        at += p
    dev = token.device
    if len(token) <= 512:  # few slots: index lists in Python (fewer small tensor ops)
        keep, at = [], 0
        for c, p in zip(counts, padded):
            keep.extend(range(at, at + c))
            at += p
        keep_t = torch.tensor(keep, device=dev)
    else:  # real slot i of expert e sits at i + (padding rows of the experts before e)
        before = list(itertools.accumulate((p - c for c, p in zip(counts, padded)),
                                           initial=0))[:-1]
        keep_t = torch.arange(len(token), device=dev) + torch.repeat_interleave(
            torch.tensor(before, device=dev), torch.tensor(counts, device=dev),
            output_size=len(token))
    token_p = token.new_zeros(at).index_copy_(0, keep_t, token)
    return token_p, keep_t, padded, torch.tensor(fill, device=dev)


def _gather_padded(x: torch.Tensor, token_p: torch.Tensor, padding) -> torch.Tensor:
    """x's rows at ``token_p``, the padding rows zero."""
    return x.index_select(0, token_p).index_fill_(0, padding[3], 0)


class Expert(nn.Module):
    """One SwiGLU expert: down(silu(gate(x)) * up(x)), projections named per family.
    gpt-oss's: projections with biases and ``swiglu`` = (alpha, limit) of
    :func:`clamped_swiglu` in place of silu."""

    def __init__(self, hidden: int, width: int, names: tuple[str, str, str],
                 bias: bool = False, swiglu: tuple | None = None):
        super().__init__()
        self.names, self.swiglu = names, swiglu
        gate, up, down = names
        setattr(self, gate, nn.Linear(hidden, width, bias=bias))
        setattr(self, up, nn.Linear(hidden, width, bias=bias))
        setattr(self, down, nn.Linear(width, hidden, bias=bias))

    def forward(self, x):
        gate, up, down = (_call(getattr(self, n)) for n in self.names)
        if self.swiglu is not None:
            return down(clamped_swiglu(gate(x), up(x), *self.swiglu))
        return down(silu_rows(gate(x)) * up(x))


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float,
                   limit: float) -> torch.Tensor:
    """gpt-oss's activation (transformers' ``GptOssExperts._apply_gate``): the gate clamped
    above at ``limit``, up to [-limit, limit], ``(up + 1) * gate * sigmoid(alpha * gate)``;
    the sigmoid row by row on a CPU (:func:`silu_rows`), the rest rounds alike anyway."""
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * (gate * _by_rows(torch.sigmoid, gate * alpha))


def silu_rows(g: torch.Tensor) -> torch.Tensor:
    """``F.silu(g)``, each row of a CPU tensor rounded alike whatever the row count. A
    contiguous tensor is one flat loop: its last ``numel % 32`` values take the scalar
    ``exp`` instead of the vectorised one (ulps apart), so a row's result depends on how
    many rows precede it. Over a view with a gap after each row the loop runs row by
    row, and every row splits the same way (the stacked experts' gate is such a view)."""
    return _by_rows(F.silu, g)


def _by_rows(fn, g: torch.Tensor) -> torch.Tensor:
    """An elementwise ``fn(g)`` run row by row on a CPU (see :func:`silu_rows`)."""
    w = g.shape[-1]
    if g.device.type != "cpu" or w % 32 == 0 or g.dim() < 2:
        return fn(g)
    return fn(F.pad(g, (0, 1))[..., :w])


def _call(lin):
    """A plain ``nn.Linear`` as ``F.linear`` (no module call: an expert runs once per active
    expert per layer per step, where the call overhead is a visible share of a decode step);
    any other projection (LoRA, frozen formats) through its module."""
    if type(lin) is nn.Linear and lin.bias is None:
        w = lin.weight
        return lambda x: F.linear(x, w)
    return lin


class Router(nn.Module):
    """The router's weight [E, H] (``gate.weight``; gpt-oss: ``router.weight`` and a bias
    [E]). Not an ``nn.Linear``: it is neither quantized nor adapted (a routing decision
    should not move through a low-rank delta). ``correction`` (DeepSeek-V3): the fp32
    buffer ``e_score_correction_bias`` [E] that only chooses experts (``route``), and
    logits computed in fp32 whatever the model dtype (transformers keeps this router in
    fp32)."""

    def __init__(self, hidden: int, num_experts: int, bias: bool = False,
                 correction: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.register_parameter("bias", nn.Parameter(torch.empty(num_experts)) if bias else None)
        self.fp32 = correction
        if correction:
            self.register_buffer("e_score_correction_bias",
                                 torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x):
        if self.fp32:
            return F.linear(x.float(), self.weight.float())
        return F.linear(x, self.weight, self.bias)


class SparseMoE(nn.Module):
    """A sparse feed-forward layer. x [B, T, H] -> [B, T, H].

    Args:
        cfg: the decoder's ModelConfig (``cfg.moe`` set).
        moe_index: this layer's index among the sparse layers (its row in a Routing).
    """

    def __init__(self, cfg, moe_index: int):
        super().__init__()
        m: MoEConfig = cfg.moe
        self.moe_index, self.top_k, self.norm = moe_index, m.top_k, m.norm_topk_prob
        self.softmax_topk, self.grouped = m.softmax_topk, m.grouped
        h = cfg.hidden_size
        self.router_attr = m.router_attr  # "gate" ("router": gpt-oss)
        setattr(self, m.router_attr, Router(h, m.num_experts, m.bias, m.grouped is not None))
        names = _EXPERT_NAMES[m.family]
        self.experts = nn.ModuleList(Expert(h, m.expert_intermediate, names, m.bias, m.swiglu)
                                     for _ in range(m.num_experts))
        # "shared_expert" behind a sigmoid gate (Qwen2-MoE), "shared_experts" ungated
        # (DeepSeek-V3), or none
        self.shared_attr = m.shared_attr if m.shared_intermediate else None
        self.shared_expert_gate = None
        if self.shared_attr:
            setattr(self, self.shared_attr, Expert(h, m.shared_intermediate, names))
            if m.grouped is None:
                self.shared_expert_gate = nn.Linear(h, 1, bias=False)
        self.packed = self._pack_views = None  # see pack_experts

    def forward(self, x: torch.Tensor, routing: Routing | None = None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        router = self._modules[self.router_attr]
        logits = router(x)
        replay = None
        if routing is not None and routing.replay is not None:
            replay = routing.replay[self.moe_index]
        grouped = None if self.grouped is None else (router.e_score_correction_bias,
                                                     *self.grouped)
        ids, w = route(logits, self.top_k, self.norm, replay, self.softmax_topk, grouped)
        if routing is not None:
            if routing.record:
                routing.chosen[self.moe_index] = ids.detach()
            if routing.aux:
                routing.logits[self.moe_index] = (logits, ids)
        out = grouped_experts(x, ids, w, self.experts, _packed_weights(self))
        if self.shared_expert_gate is not None:
            out = out + self._shared_gate(x) * self.shared_expert(x)
        elif self.shared_attr is not None:
            out = out + self._modules[self.shared_attr](x)
        return out.view(shape)

    def _shared_gate(self, x: torch.Tensor) -> torch.Tensor:
        """sigmoid(shared_expert_gate(x)) [N, 1]. A one-column GEMM and a sigmoid over N
        contiguous values round a row differently depending on N (other kernels for other
        sizes, a scalar tail), so on a CPU the weight is padded to 16 zero rows: every
        row then takes the row-invariant GEMM and the vectorised sigmoid."""
        lin = self.shared_expert_gate
        w = lin.weight if type(lin) is nn.Linear else None
        if isinstance(lin, FrozenLinear):
            w = lin.compute_weight(x.dtype)
        if w is None or lin.bias is not None or x.device.type != "cpu":
            return torch.sigmoid(lin(x))
        return torch.sigmoid(F.linear(x, F.pad(w, (0, 0, 0, 15))))[:, :1]


def pack_experts(model) -> int:
    """Lay each sparse layer's plain fp32 CPU expert weights out as two stacked buffers,
    gate|up ``[E, H, 2W]`` and down ``[E, W, H]``, every expert's ``nn.Linear`` weight a
    (column-major) view into them; returns the number of layers packed.

    Why: an expert sees few rows per call (a 16-token decode step gives each of 16 experts
    about 4), where two things cost more than the arithmetic. ``x @ W.T`` over a row-major
    ``W`` runs at a fraction of MKL's bandwidth (a 16-token forward of a 16-expert layer,
    512 x 256 experts: 24 ms row-major, 10 ms column-major, one thread, 2 shared cores), and
    a Python loop over the experts dispatches six ops each (and autograd ten more). With the
    buffers, a forward runs two ``torch._grouped_mm`` over all experts and a backward three,
    plus one matmul per projection pair and active expert for the weight gradients
    (``_PackedExperts``). Same bytes at rest (the buffers are the weights); in-place updates
    keep the views; anything that re-allocates a weight (a move, sharding, a LoRA or
    frozen-format wrapper) breaks the view, which each call checks, and the per-expert loop
    runs instead."""
    if not hasattr(torch, "_grouped_mm"):
        return 0
    n = 0
    with torch.no_grad():
        for block in model.modules():
            if isinstance(block, SparseMoE) and _pack(block):
                n += 1
    return n


def _pack(block: "SparseMoE") -> bool:
    lins = [[getattr(ex, name) for name in ex.names] for ex in block.experts]
    if block.experts[0].swiglu is not None:  # gpt-oss: biases, another activation
        return False
    if not all(type(m) is nn.Linear and m.bias is None and m.weight.device.type == "cpu"
               and m.weight.dtype == torch.float32 for row in lins for m in row):
        return False
    E, (W, H) = len(lins), lins[0][0].weight.shape
    if W % 4 or H % 4:  # the grouped GEMM wants 16-byte strides
        return False
    gu, dn = torch.empty(E, H, 2 * W), torch.empty(E, W, H)
    for e, (g, u, d) in enumerate(lins):
        gu[e, :, :W], gu[e, :, W:], dn[e] = g.weight.t(), u.weight.t(), d.weight.t()
        g.weight.data, u.weight.data = gu[e, :, :W].t(), gu[e, :, W:].t()
        d.weight.data = dn[e].t()
    block.packed = (gu, dn)
    # what each call checks, as plain ints and objects (tensor indexing and module
    # attribute lookups cost more than a small decode step's arithmetic)
    block._pack_views = [(ex._modules, name, lin, lin._parameters, lin.weight,
                          lin.weight.data_ptr())
                         for ex, row in zip(block.experts, lins)
                         for name, lin in zip(ex.names, row)]
    return True


def _packed_weights(block: "SparseMoE"):
    """The stacked buffers and the expert weights they back (gate, up, down per expert)
    while every weight is still the view :func:`pack_experts` made, else None; a weight
    re-allocated or replaced, or a projection wrapped (moved, sharded, adapted) drops the
    buffers for good, freeing them."""
    if block.packed is None:
        return None
    for mods, name, lin, params, w, ptr in block._pack_views:
        if mods[name] is not lin or params["weight"] is not w or w.data_ptr() != ptr:
            block.packed = block._pack_views = None
            return None
    return block.packed, [v[4] for v in block._pack_views]


def _offsets(counts: list[int]) -> torch.Tensor:
    """The grouped GEMM's group ends (int32 cumulative counts)."""
    return torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32)


def _packed_forward(x, token, counts, padding, gu, dn, saved: bool = False, w=None):
    """Every expert over its sorted rows from the stacked buffers (on the padded rows).
    Returns ys [S, H] on the real rows (each row scaled by ``w`` [S, 1] when given, in
    place: a product is rounded alike wherever it is made) and, when ``saved``, what the
    backward needs of the real rows: the gathered input xs, the gate|up pre-activations a
    and silu(gate) sg.

    Few rows per expert: two grouped GEMMs over all experts (one call each). Many: expert by
    expert, gate|up GEMM, SiLU and down GEMM back to back, so the expert's [rows, 2W]
    intermediate is still in cache when the next op reads it (the grouped GEMM runs the same
    per-expert matmuls, so a row's result is the same either way)."""
    if padding is None:
        xs, c = x.index_select(0, token), counts
    else:
        xs, c = _gather_padded(x, padding[0], padding), padding[2]
    W = gu.shape[2] // 2
    scaled = False
    if _fused(c):
        S = xs.shape[0]
        ys = xs.new_empty(S, dn.shape[2])
        a = xs.new_empty(S, 2 * W) if saved else None
        sg = xs.new_empty(S, W) if saved else None
        for e, rows in _expert_rows(c):
            ae = torch.mm(xs[rows], gu[e], out=a[rows]) if saved else xs[rows] @ gu[e]
            gate, up = ae.chunk(2, dim=-1)
            se = torch.ops.aten.silu.out(gate, out=sg[rows]) if saved else F.silu(gate)
            ye = torch.mm(se * up, dn[e], out=ys[rows])
            if w is not None and padding is None:
                ye.mul_(w[rows])  # while the expert's rows are in cache
                scaled = True
    else:
        offs = _offsets(c)
        a = torch._grouped_mm(xs, gu, offs=offs)  # [S, 2W]: gate | up
        gate, up = a.chunk(2, dim=-1)
        # silu over a strided half runs row by row: each row rounds alike whatever S is
        sg = F.silu(gate)
        ys = torch._grouped_mm(sg * up, dn, offs=offs)
    if padding is not None:
        keep = padding[1]
        ys = ys.index_select(0, keep)
        if saved:
            xs, a, sg = (t.index_select(0, keep) for t in (xs, a, sg))
    if w is not None and not scaled:
        ys.mul_(w)
    return (ys, xs, a, sg) if saved else ys


def _expert_rows(counts):
    """(expert, its slice of the sorted rows) for each expert with rows."""
    start = 0
    for e, n in enumerate(counts):
        if n:
            yield e, slice(start, start + n)
            start += n


# rows per active expert from which the experts run one by one rather than grouped
FUSED_MIN_ROWS = 64


def _fused(counts) -> bool:
    active = sum(1 for n in counts if n)
    return active > 0 and sum(counts) >= FUSED_MIN_ROWS * active


class _PackedExperts(torch.autograd.Function):
    """:func:`_packed_forward` with its backward, on the real rows (no padding: gradients
    need no row invariance), grouped or expert by expert as the forward, each row scaled by
    its router weight ``w`` [S, 1] inside (where W <= H the backward then needs no [S, H]
    copy of the unscaled ys, and its row-scale work is on [S, W] while the expert's rows are
    in cache: with h = silu(gate) * up and g the incoming gradient, d w = rowsum((g dn^T) *
    h), d h = w * (g dn^T), d dn = (w * h)^T g; for experts wider than the model, W > H,
    the [S, H] output is scaled instead, kept unscaled for d w = rowsum(g * ys), and g
    scaled before the down GEMM). Each active expert's weight gradients come from one
    matmul per projection pair, into that expert's own parameters (the buffers are not
    parameters: each expert's weights are views into them). Two grouped GEMMs over all
    experts instead measured 2% slower at 16 tokens and equal at 1k, with a gradient buffer
    for every expert (16 MB, fresh pages each step)."""

    @staticmethod
    def forward(ctx, x, token, counts, padding, gu, dn, w, *weights):
        at_out = gu.shape[2] > 2 * gu.shape[1]  # W > H: scale the output, keep it unscaled
        ys, xs, a, sg = _packed_forward(x, token, counts, padding, gu, dn, saved=True,
                                        w=None if at_out else w)
        ctx.save_for_backward(xs, a, sg, token, w, ys if at_out else None)
        ctx.counts, ctx.gu, ctx.dn, ctx.n = counts, gu, dn, x.shape[0]
        return ys * w if at_out else ys

    @staticmethod
    def backward(ctx, gy):
        xs, a, sg, token, w, ys = ctx.saved_tensors  # ys: the unscaled output (W > H)
        counts, gu, dn = ctx.counts, ctx.gu, ctx.dn
        W = sg.shape[1]
        gy = gy.contiguous()
        need = [bool(c) and any(ctx.needs_input_grad[7 + 3 * e:10 + 3 * e])
                for e, c in enumerate(counts)]
        grads = [None] * (3 * len(counts))
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[6]
        at_out = ys is not None
        gw = w.new_empty(w.shape) if want_w else None
        ga = torch.empty_like(a)  # d gate | d up, written in place (no concatenation)
        if _fused(counts):  # expert by expert, as the forward
            gxs = xs.new_empty(xs.shape) if want_x else None
            for e, rows in _expert_rows(counts):
                gye, gae = gy[rows], ga[rows]
                if at_out:
                    if want_w:
                        torch.sum(gye * ys[rows], dim=1, keepdim=True, out=gw[rows])
                    gye = gye * w[rows]
                ghe = gye @ dn[e].t()  # d h (before the router weight unless at_out)
                gate, up = a[rows].chunk(2, dim=-1)
                he = sg[rows] * up if (want_w and not at_out) or need[e] else None
                if not at_out:
                    if want_w:
                        torch.sum(ghe * he, dim=1, keepdim=True, out=gw[rows])
                    ghe.mul_(w[rows])
                torch.ops.aten.silu_backward.grad_input(ghe * up, gate, grad_input=gae[:, :W])
                torch.mul(ghe, sg[rows], out=gae[:, W:])
                if want_x:
                    torch.mm(gae, gu[e].t(), out=gxs[rows])
                if need[e]:
                    g_a = gae.t() @ xs[rows]
                    if not at_out:
                        he.mul_(w[rows])
                    grads[3 * e:3 * e + 3] = g_a[:W], g_a[W:], (he.t() @ gye).t()
        else:
            offs = _offsets(counts)
            if at_out:
                if want_w:
                    gw = (gy * ys).sum(dim=1, keepdim=True)
                gy = gy * w
            gh = torch._grouped_mm(gy, dn.transpose(1, 2), offs=offs)  # [S, W]
            gate, up = a.chunk(2, dim=-1)
            h = sg * up
            if not at_out:
                if want_w:
                    gw = (gh * h).sum(dim=1, keepdim=True)
                gh.mul_(w)
                h.mul_(w)
            torch.ops.aten.silu_backward.grad_input(gh * up, gate, grad_input=ga[:, :W])
            torch.mul(gh, sg, out=ga[:, W:])
            gxs = torch._grouped_mm(ga, gu.transpose(1, 2), offs=offs) if want_x else None
            parts = zip(ga.split(counts), xs.split(counts), h.split(counts),
                        gy.split(counts))
            for e, (gae, xse, he, gye) in enumerate(parts):  # weight gradients
                if need[e]:
                    g_a = torch.mm(gae.t(), xse)  # [2W, H]: gate | up, contiguous halves
                    # down's weight is a transposed (column-major, dense) view: its
                    # gradient made in that layout becomes the .grad as it is (a row-major
                    # one would be copied into it)
                    grads[3 * e:3 * e + 3] = g_a[:W], g_a[W:], torch.mm(he.t(), gye).t()
        gx = None
        if want_x:
            gx = gxs.new_zeros(ctx.n, gxs.shape[1]).index_add_(0, token, gxs)
        return (gx, None, None, None, None, None, gw, *grads)


def make_ffn(cfg, layer_idx: int, dense_factory):
    """The feed-forward of layer ``layer_idx``: a SparseMoE when the config says so, else
    ``dense_factory()``. Returns (attribute name, module)."""
    m = cfg.moe
    if m is None:
        return "mlp", dense_factory()
    if layer_idx not in m.sparse_layers:
        return m.ffn_attr, dense_factory()
    return m.ffn_attr, SparseMoE(cfg, m.sparse_layers.index(layer_idx))


# ---- router losses ------------------------------------------------------------------------

def load_balancing_loss(logits: list[torch.Tensor], ids: list[torch.Tensor], num_experts: int,
                        valid: torch.Tensor | None = None) -> torch.Tensor:
    """Switch Transformer's auxiliary loss, as transformers computes it over all sparse
    layers: E * sum_e f_e * P_e, with f_e the fraction of (token, slot) assignments to expert
    e and P_e its mean router probability, both pooled over layers and valid tokens.
    ``ids`` are the experts actually used (the replayed ones under replay)."""
    dev = logits[0].device
    counts = torch.zeros(num_experts, device=dev)
    probs = torch.zeros(num_experts, device=dev)
    rows = 0.0
    for lg, ix in zip(logits, ids):
        p = torch.softmax(lg.float(), dim=-1)
        m = torch.ones(p.shape[0], device=dev) if valid is None else valid.float()
        counts = counts.scatter_add(0, ix.reshape(-1), m.repeat_interleave(ix.shape[1]))
        probs = probs + (p * m[:, None]).sum(0)
        rows = rows + m.sum()
    return num_experts * torch.sum((counts / rows) * (probs / rows))


def z_loss(logits: list[torch.Tensor], valid: torch.Tensor | None = None) -> torch.Tensor:
    """ST-MoE's router z-loss: mean over valid tokens and layers of logsumexp(logits)^2
    (keeps router logits small, so routing stays stable in low precision)."""
    total = 0.0
    for lg in logits:
        z = torch.logsumexp(lg.float(), dim=-1) ** 2
        total = total + (z.mean() if valid is None
                         else (z * valid).sum() / valid.sum().clamp(min=1))
    return total / len(logits)


def router_losses(model, routing: Routing | None) -> tuple[torch.Tensor | float, dict]:
    """``router_aux_coef * load_balancing + router_z_coef * z_loss`` of one forward's
    ``routing`` (collected with ``aux``), and metrics; (0.0, {}) when nothing was collected."""
    if routing is None or not routing.logits:
        return 0.0, {}
    keys = sorted(routing.logits)
    lg = [routing.logits[i][0] for i in keys]
    ix = [routing.logits[i][1] for i in keys]
    valid = routing.valid
    lb = load_balancing_loss(lg, ix, model.config.moe.num_experts, valid)
    z = z_loss(lg, valid)
    loss = model.router_aux_coef * lb + model.router_z_coef * z
    return loss, {"router_aux_loss": float(lb.detach()), "router_z_loss": float(z.detach())}


def configure(model, routing_replay: bool = True, aux_loss_coef: float = 0.0,
              z_loss_coef: float = 0.0) -> None:
    """Run settings of a mixture model (the ``moe`` config section); a no-op on dense ones."""
    if getattr(model.config, "moe", None) is None:
        return
    if aux_loss_coef < 0 or z_loss_coef < 0:
        raise OrbitError("moe.aux_loss_coef / moe.z_loss_coef: must be >= 0")
    model.routing_replay = bool(routing_replay)
    model.router_aux_coef, model.router_z_coef = float(aux_loss_coef), float(z_loss_coef)
