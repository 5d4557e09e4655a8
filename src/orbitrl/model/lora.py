"""LoRA adapters on a frozen base in any storage format: one module, the format a flag.

``LoRALinear`` wraps a base linear (plain ``nn.Linear`` or a :class:`FrozenLinear` holding
bf16 / int8 / nf4 / int4) and adds ``scale * B(A(dropout(x)))``, B initialised to zero so a
fresh adapter leaves the model unchanged. Module and parameter names follow PEFT's
(``q_proj.base_layer``, ``q_proj.lora_A.weight``), so adapter files map one to one onto a
transformers model wrapped by peft (see ``adapters.py``).

Rollout and training call these same modules: nothing is merged or copied between them, and
``adapters_disabled(model)`` gives the frozen base, i.e. the reference policy, at no extra
memory. ``adapter_view(snapshot)`` makes the modules compute, in the calling thread only,
with a frozen copy of the adapter tensors: the overlapped mode's rollout thread samples
with the previous policy while the training thread updates the live adapters.
"""

from __future__ import annotations

import fnmatch
import math
import re
import threading
from contextlib import contextmanager
from typing import Iterable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from orbitrl.errors import OrbitError
from orbitrl.model import gemm
from orbitrl.model.moe import ROUTED_EXPERT, SparseMoE
from orbitrl.model.quant import FrozenLinear

ADAPTER_DTYPES = {"float32": torch.float32, "fp32": torch.float32,
                  "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


class LoRALinear(nn.Module):
    """y = base(x) + (alpha / rank) * B(A(dropout(x))), base frozen.

    Args:
        base: ``nn.Linear`` or :class:`FrozenLinear` ([out, in] weight).
        rank, alpha, dropout: LoRA hyper-parameters (scale = alpha / rank, PEFT's default).
        adapter_dtype: storage dtype of A and B (fp32 or bf16); they are cast to the input's
            dtype per call, so bf16 adapters compute in fp32 on CPU.
        base_format: the flag: if given and ``base`` is a plain ``nn.Linear``, its weight is
            moved into a :class:`FrozenLinear` of that format (torchtune's ``quantize_base``).
    Shapes: x [..., in] -> [..., out].
    """

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0,
                 adapter_dtype=torch.float32, base_format: str | None = None):
        super().__init__()
        if rank <= 0:
            raise OrbitError(f"lora rank: must be positive, got {rank}")
        if not 0.0 <= dropout < 1.0:
            raise OrbitError(f"lora dropout: must be in [0, 1), got {dropout}")
        if base_format is not None and isinstance(base, nn.Linear):
            if base_format == "nf4mix":  # its format depends on the weight's name
                raise OrbitError("lora base_format: nf4mix needs the weight's name; "
                                 "quantize the base as it loads (model.base_dtype)")
            base = FrozenLinear.from_linear(base, base_format)
        for p in base.parameters():
            p.requires_grad_(False)
        self.base_layer = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        dtype = ADAPTER_DTYPES.get(adapter_dtype, adapter_dtype)
        device = base.device if isinstance(base, FrozenLinear) else base.weight.device
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, dtype=dtype, device=device)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, dtype=dtype, device=device)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.enabled = True
        self.reset_adapter()

    def reset_adapter(self):
        """PEFT's init: A Kaiming-uniform, B zero (the adapter starts as the identity)."""
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        view = getattr(_VIEW, "tensors", None)
        if view is not None:  # this thread's frozen adapters: always on, no dropout
            a_w, b_w = view[id(self)]
            return self._add_delta(y, F.linear(x, a_w.to(x.dtype)), b_w.to(x.dtype))
        if not self.enabled:
            return y
        a_w, b_w = self.lora_A.weight, self.lora_B.weight
        if a_w.dtype != x.dtype:  # (a same-dtype .to is a dispatch per call on the hot path)
            a_w, b_w = a_w.to(x.dtype), b_w.to(x.dtype)
        drop = self.lora_dropout
        # (gemm.linear: oneDNN where a training run's rollout and trainer share its rounding)
        a = gemm.linear(x if isinstance(drop, nn.Identity) else drop(x), a_w)  # [..., r]
        return self._add_delta(y, a, b_w)

    def _add_delta(self, y, a, b_w):
        """y + scale * a @ B^T as one GEMM accumulating into y (addmm, beta 1): the sum and
        the scaling ride in the GEMM's epilogue instead of two passes over [tokens, out].
        Where B is multiplied on oneDNN (model/gemm.py: a training run whose rollout engine
        packs its weights), its product, then the scaled sum: MKL's addmm rounds a decode
        step's few rows otherwise than the trainer's many."""
        if gemm.routed(b_w):
            return torch.add(y, gemm.linear(a, b_w), alpha=self.scaling)
        out = torch.addmm(y.reshape(-1, y.shape[-1]), a.reshape(-1, a.shape[-1]), b_w.t(),
                          alpha=self.scaling)
        return out.view(y.shape)

    def delta_weight(self, dtype=torch.float32) -> torch.Tensor:
        """scale * B @ A, [out, in]."""
        return (self.lora_B.weight.to(dtype) @ self.lora_A.weight.to(dtype)) * self.scaling

    def base_weight(self, dtype=torch.float32) -> torch.Tensor:
        b = self.base_layer
        return b.dequantize(dtype) if isinstance(b, FrozenLinear) else b.weight.detach().to(dtype)

    def dequantized_state(self) -> dict[str, torch.Tensor]:
        """HF-named tensors for export: the merged weight (dequantized base + adapter when
        enabled) and the base bias."""
        with torch.no_grad():
            w = self.base_weight(torch.float32)
            if self.enabled:
                w = w + self.delta_weight(torch.float32)
        out = {"weight": w}
        if self.base_layer.bias is not None:
            out["bias"] = self.base_layer.bias.detach()
        return out

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}, enabled={self.enabled}"


# ---- selecting target modules --------------------------------------------------------------

def candidate_linears(model: nn.Module, experts: bool = False) -> dict[str, nn.Module]:
    """Linear layers inside the decoder layers that LoRA may target (not the LM head, not
    layers already inside an adapter, a mixture's routed experts only with ``experts``), by
    HF module name (the layers under ``model.layers.``, or the model's ``layers_prefix``:
    a transformers module's own layer list, ``hf_fallback.py``)."""
    inside = {n for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    prefix = getattr(model, "layers_prefix", "model.layers.")
    out = {}
    for name, mod in model.named_modules():
        if not name.startswith(prefix) or any(name.startswith(p + ".") for p in inside):
            continue
        if not experts and ROUTED_EXPERT.fullmatch(name):
            continue
        if isinstance(mod, (nn.Linear, FrozenLinear)):
            out[name] = mod
    return out


def match_targets(names: Iterable[str], targets: str | Sequence[str],
                  key: str = "targets") -> list[str]:
    """Module names selected by ``targets`` (every pattern must select at least one).

    Pattern forms: ``"all-linear"``; a bare name such as ``"q_proj"`` or
    ``"self_attn.q_proj"`` (suffix match at a dot, as PEFT's list form); a glob with
    ``* ? [`` matched against the whole name (``"model.layers.*.mlp.*"``); ``"re:<regex>"``
    fully matching the whole name (PEFT's string form).
    """
    names = list(names)
    pats = [targets] if isinstance(targets, str) else list(targets)
    if not pats:
        raise OrbitError(f"{key}: no target pattern given (use 'all-linear' for every layer)")
    chosen: set[str] = set()
    for pat in pats:
        if not isinstance(pat, str):
            raise OrbitError(f"{key}: pattern {pat!r} is not a string")
        if pat == "all-linear":
            hits = names
        elif pat.startswith("re:"):
            try:
                rx = re.compile(pat[3:])
            except re.error as e:
                raise OrbitError(f"{key}: bad regular expression '{pat}' ({e})") from None
            hits = [n for n in names if rx.fullmatch(n)]
        elif any(c in pat for c in "*?["):
            hits = [n for n in names if fnmatch.fnmatchcase(n, pat)]
        else:
            hits = [n for n in names if n == pat or n.endswith("." + pat)]
        if not hits:
            leaves = sorted({n.rpartition(".")[2] for n in names})
            raise OrbitError(f"{key}: pattern '{pat}' matches no linear layer (names look like "
                             f"{names[0] if names else '?'!r}; leaf names: {', '.join(leaves)})")
        chosen.update(hits)
    return [n for n in names if n in chosen]


def apply_lora(model: nn.Module, rank: int = 16, alpha: float | None = None,
               dropout: float = 0.0, targets: str | Sequence[str] = "all-linear",
               adapter_dtype="float32", base_format: str | None = None,
               experts: str = "none") -> list[str]:
    """Wrap the selected linear layers in :class:`LoRALinear` and freeze everything else.

    Args:
        model: our Decoder (any module with HF-named ``model.layers.N....`` linears).
        rank, alpha, dropout: LoRA hyper-parameters; alpha defaults to rank (scale 1).
        targets: pattern(s), see :func:`match_targets`.
        adapter_dtype: "float32" or "bf16".
        base_format: also store each wrapped plain ``nn.Linear`` frozen in this format.
        experts: mixtures: "none" (routed experts are not candidates), "per_expert" (each
            selected expert projection gets its own adapter), "shared" (one adapter per
            projection kind and layer, used by every expert; :func:`share_expert_adapters`).
    Returns:
        The wrapped module names, in model order.
    """
    if lora_modules(model):
        raise OrbitError("apply_lora: the model already has LoRA adapters")
    if experts not in ("none", "per_expert", "shared"):
        raise OrbitError(f"lora.experts: {experts!r} is not one of none, per_expert, shared")
    if adapter_dtype not in ADAPTER_DTYPES and adapter_dtype not in ADAPTER_DTYPES.values():
        raise OrbitError(f"adapter_dtype: {adapter_dtype!r} is not one of float32, bf16")
    alpha = float(rank if alpha is None else alpha)
    cands = candidate_linears(model, experts != "none")
    names = match_targets(cands, targets)
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        parent, _, child = name.rpartition(".")
        mod = LoRALinear(cands[name], rank, alpha, dropout, adapter_dtype, base_format)
        setattr(model.get_submodule(parent), child, mod.train(model.training))
    if experts == "shared":
        share_expert_adapters(model)
    return names


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def adapter_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters: every LoRA A and B (hand these to the optimizer)."""
    params = [p for m in lora_modules(model).values() for p in (m.lora_A.weight, m.lora_B.weight)]
    return list({id(p): p for p in params}.values())  # experts' shared adapters once


def routed_adapters(model: nn.Module) -> list[str]:
    """Names of the LoRA modules on a mixture's routed experts (PEFT files cannot hold them
    here)."""
    return [n for n in lora_modules(model) if ROUTED_EXPERT.fullmatch(n)]


def share_expert_adapters(model: nn.Module) -> int:
    """Make every routed expert of a layer use one LoRA pair per projection kind: the
    adapters ``apply_lora`` put on each expert's projection are replaced by the first
    expert's (its A and B modules are the same objects in every expert), so a layer trains
    ``rank * (in + out)`` per projection kind instead of ``num_experts`` times that. Returns
    the number of shared pairs; a one-line OrbitError when only some experts were adapted."""
    pairs = 0
    for name, mod in model.named_modules():
        if not isinstance(mod, SparseMoE):
            continue
        for proj in mod.experts[0].names:
            wrapped = [getattr(ex, proj) for ex in mod.experts]
            hit = [isinstance(w, LoRALinear) for w in wrapped]
            if not any(hit):
                continue
            if not all(hit):
                raise OrbitError(f"lora.experts shared: lora.targets adapt {proj} of only some "
                                 f"experts of {name} (select all of them, or none)")
            for w in wrapped[1:]:
                w.lora_A, w.lora_B = wrapped[0].lora_A, wrapped[0].lora_B
            pairs += 1
    return pairs


def set_adapters_enabled(model: nn.Module, enabled: bool) -> None:
    for m in lora_modules(model).values():
        m.enabled = enabled


_VIEW = threading.local()


def snapshot_adapters(model: nn.Module) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """A copy of every module's (A, B), for :func:`adapter_view` (a few MB)."""
    return {id(m): (m.lora_A.weight.detach().clone(), m.lora_B.weight.detach().clone())
            for m in lora_modules(model).values()}


@contextmanager
def adapter_view(tensors: dict[int, tuple[torch.Tensor, torch.Tensor]]):
    """In the calling thread, every LoRA module computes with ``tensors`` (from
    :func:`snapshot_adapters`), enabled and without dropout, whatever the live adapters,
    their switch or the module's train mode; other threads are unaffected."""
    before = getattr(_VIEW, "tensors", None)
    _VIEW.tensors = tensors
    try:
        yield
    finally:
        _VIEW.tensors = before


@contextmanager
def adapters_disabled(model: nn.Module):
    """The frozen base (the reference policy) for the duration, with no extra memory;
    each module's previous switch is restored afterwards."""
    mods = lora_modules(model).values()
    before = [m.enabled for m in mods]
    try:
        for m in mods:
            m.enabled = False
        yield model
    finally:
        for m, e in zip(mods, before):
            m.enabled = e
