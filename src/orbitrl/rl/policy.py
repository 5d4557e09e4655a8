"""Build the policy for a run: adapters on a frozen base, or full parameters.

Adapter mode: the base is quantized while loading (shard by shard) and frozen; LoRA adapters
are the only trainable tensors; the reference policy is the same modules with the adapters
switched off (or an anchored adapter snapshot, see ``anchors.py``), at no extra memory.
Full mode: every parameter trains under a stateless update fused into backward; the
reference is an int8 copy of the starting weights kept in host memory. When the compute
device is not the host, the reference's layers are copied to it one at a time as they run
(``LayerResidency``: the next ones prefetched, each released after use) and its embeddings
and head live there; on the host it computes in place. ``train.tiers`` puts the policy's
own layers on the same tiers (and the reference's, with the same prefetch depth).
A causal LM without native code trains through its transformers module instead
(``fallback_policy``; docs/models.md, "Fallback").
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from orbitrl.config import Config
from orbitrl.errors import OrbitError
from orbitrl.engine.governor import available_memory
from orbitrl.ledger.runtime import choose_base_dtype, forced_recompute, reference_needed
from orbitrl.model import load_tokenizer, moe
from orbitrl.model.adapters import load_adapters
from orbitrl.model.builtin import resolve_model_path
from orbitrl.model.config import is_native
from orbitrl.model.decoder import Decoder
from orbitrl.model.hf_fallback import load_hf_model
from orbitrl.model.lora import adapter_parameters, apply_lora, candidate_linears
from orbitrl.model.quant import cache_dequantized, check_format, finish_frozen, quantizing_hook
from orbitrl.model.weights import load_model
from orbitrl.train.residency import LayerResidency

BASE_FORMATS = {"fp32": None, "bf16": "bf16", "int8": "int8", "nf4mix": "nf4mix",
                "nf4": "nf4"}


@dataclass
class Policy:
    model: Decoder
    tokenizer: object
    path: Path
    trainable: list
    reference: Decoder | None = None  # full mode: frozen int8 copy; adapter mode: None
    residency: LayerResidency | None = None  # train.tiers: the policy's layers on tiers
    reference_residency: LayerResidency | None = None  # the reference pulled to the device


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise OrbitError(f"model.device {name!r}: no CUDA device on this machine")
    return dev


def load_base(path: Path, fmt: str | None, dtype: str, device, extra: dict | None = None
              ) -> Decoder:
    """Load with the frozen projections stored in ``fmt`` (None: plain dtype); ``extra``
    receives tensors outside the causal LM (``weights.load_model``)."""
    if fmt is None:
        return load_model(path, dtype=dtype, device=device, extra=extra)

    check_format(fmt, device, key="model.base_dtype")
    model = load_model(path, dtype=dtype, device=device, on_tensor=quantizing_hook(fmt),
                       extra=extra)
    finish_frozen(model, path)
    return model


def policy_tokenizer(cfg: Config):
    """The run's tokenizer, before the weights load (its prompts' length prices the run)."""
    path = resolve_model_path(cfg.model.path, cfg.model.revision)
    vocab = json.loads((path / "config.json").read_text()).get("vocab_size")
    return load_tokenizer(path, vocab)


def resolve_base(cfg: Config, device, prompt_len: int, distributed: bool):
    """``model.base_dtype: auto`` made concrete in ``cfg`` (every later reader, the saved
    config and the adapters' recorded base see the choice): the ledger's
    ``choose_base_dtype`` for these prompts and the memory free now; nf4 under torchrun
    (every rank must choose alike, whatever its own free memory)."""
    if cfg.model.base_dtype != "auto":
        return
    if not is_native(resolve_model_path(cfg.model.path, cfg.model.revision)):
        cfg.model.base_dtype = "fp32" if cfg.model.dtype == "fp32" else "bf16"
        return
    if distributed:
        cfg.model.base_dtype = "nf4" if cfg.train.mode == "adapter" else "fp32"
        return
    path = resolve_model_path(cfg.model.path, cfg.model.revision)
    hf = json.loads((path / "config.json").read_text())
    cfg.model.base_dtype = choose_base_dtype(cfg, hf, prompt_len, torch.device(device).type,
                                             available_memory(device))


def build_policy(cfg: Config, device, reference: bool = True, tokenizer=None) -> Policy:
    """The policy as the run trains it; ``reference=False`` skips full mode's int8
    reference (a rollout rank of separate pools never scores), as does a run without a KL
    term (``ledger.runtime.reference_needed``). ``tokenizer``: the run's, when the caller
    loaded it already (``policy_tokenizer``)."""
    path = resolve_model_path(cfg.model.path, cfg.model.revision)
    dtype = "float32" if cfg.model.dtype == "fp32" else "bfloat16"
    # auto: the trainer resolved it for its prompts (resolve_base); any other caller (a
    # rollout rank) gets what every rank of a torchrun run gets
    resolve_base(cfg, device, 0, distributed=True)
    if not is_native(path):
        return fallback_policy(cfg, path, dtype, device, reference, tokenizer)
    if cfg.train.mode == "adapter":
        model = load_base(path, BASE_FORMATS[cfg.model.base_dtype], dtype, device)
        apply_lora(model, rank=cfg.lora.rank, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout,
                   targets=cfg.lora.targets, experts=cfg.lora.experts)
        trainable = adapter_parameters(model)
        reference = residency = ref_residency = None

        cache_dequantized(model, cfg.model.dequant_cache_mb << 20,
                          torch.float32 if cfg.model.dtype == "fp32" else torch.bfloat16)
    else:
        # base_dtype only names a frozen base's storage; the full-parameter policy trains
        # its own weights in model.dtype and the reference is always int8
        tiers = cfg.train.tiers
        model = load_model(path, dtype=dtype, device="cpu" if tiers else device)
        for p in model.parameters():
            p.requires_grad_(True)
        trainable = [p for p in model.parameters()]
        residency = place_on_tiers(model, device, tiers) if tiers else None
        want_ref, reference = reference and reference_needed(cfg), None
        if want_ref:  # (no KL term anywhere: no reference copy, ledger/runtime.py)
            reference = load_base(path, "int8", dtype, "cpu")  # host-resident, frozen
            for p in reference.parameters():
                p.requires_grad_(False)
        ref_residency = None
        if reference is not None and (device.type != "cpu" or tiers):
            ref_residency = place_on_tiers(reference, device, tiers or 2)
    # (train.recompute auto is resolved by the trainer once the prompts' length is known:
    # ledger/runtime.py resolve_recompute)
    model.recompute = forced_recompute(cfg.train)
    # the layer inputs recompute keeps, held in host memory between forward and backward
    model.offload_activations = cfg.train.offload_activations
    model.attention_fp64 = cfg.model.attention_fp64
    moe.configure(model, cfg.moe.routing_replay, cfg.moe.aux_loss_coef, cfg.moe.z_loss_coef)
    tok = tokenizer if tokenizer is not None else load_tokenizer(path, model.config.vocab_size)
    return Policy(model, tok, path, trainable, reference, residency, ref_residency)


def load_checked(path: Path, fmt: str, adapter: str | None, purpose: str):
    """A model directory (resolved) with fp32 compute, its frozen base stored in ``fmt``
    (fp32 | bf16 | int8 | nf4) and the adapters at ``adapter`` loaded, as the commands that
    read a model (eval, check-alignment) load it; a model without native code runs through
    transformers over its fp32 weights only (another ``fmt``: one line saying it is
    ``purpose`` over those only)."""
    if not is_native(path):  # a causal LM without native code: through transformers
        if fmt != "fp32":
            raise OrbitError(f"--base-dtype {fmt}: {path / 'config.json'} has no native code; "
                             f"it is {purpose} over its fp32 weights only (docs/models.md)")
        model = load_hf_model(path, "float32", "cpu")
    else:
        model = load_base(path, None if fmt == "fp32" else fmt, "float32", "cpu")
    if adapter:
        load_adapters(model, adapter)
    return model


# what the transformers-backed policy cannot run: (config key, its off value or check)
FALLBACK_REFUSED = (
    ("model.base_dtype", lambda c: c.model.base_dtype in ("fp32", "bf16")),
    ("train.tiers", lambda c: not c.train.tiers),
    ("train.offload_activations", lambda c: not c.train.offload_activations),
    ("rollout.overlap", lambda c: not c.rollout.overlap),
    ("schedule.shape", lambda c: c.schedule.shape == "colocated"),
    ("env.name", lambda c: not c.env.name),
    ("lora.experts", lambda c: c.lora.experts == "none"),
)


def fallback_policy(cfg: Config, path: Path, dtype: str, device, reference: bool,
                    tokenizer) -> Policy:
    """A causal LM without native code through transformers (docs/models.md, "Fallback"):
    LoRA on its linear layers over a base in ``model.dtype`` (the reference: adapters off),
    or every parameter trained (the reference, when a KL term needs one: a frozen copy in
    ``model.dtype``). Settings it cannot honour stop with one line naming the key."""
    for key, ok in FALLBACK_REFUSED:
        if not ok(cfg):
            raise OrbitError(f"config key {key!r}: not available for {path / 'config.json'} "
                             "(a model without native code runs through transformers; "
                             "docs/models.md)")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise OrbitError(f"{path / 'config.json'}: a model without native code trains in one "
                         "process (not under torchrun)")
    model = load_hf_model(path, dtype, device)
    ref = None
    if cfg.train.mode == "adapter":
        if not candidate_linears(model):
            raise OrbitError(f"{path / 'config.json'}: {model.config.model_type!r} has no "
                             "nn.Linear projections for LoRA (transformers' Conv1D is not "
                             "adapted): use train.mode full")
        apply_lora(model, rank=cfg.lora.rank, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout,
                   targets=cfg.lora.targets)
        trainable = adapter_parameters(model)
    else:
        if reference and reference_needed(cfg):
            ref = copy.deepcopy(model).requires_grad_(False)
        trainable = list(model.requires_grad_(True).parameters())
    model.recompute = forced_recompute(cfg.train)
    tok = tokenizer if tokenizer is not None else load_tokenizer(path, model.config.vocab_size)
    return Policy(model, tok, path, trainable, ref)


def place_on_tiers(model: Decoder, device, prefetch: int) -> LayerResidency:
    """``model`` (loaded in host memory) computing on ``device`` with its decoder layers
    on tiers: cold in host memory, each copied to ``device`` just before it runs with the
    next ``prefetch`` prefetched, released after use. On a CPU-only machine the hot copies
    are still distinct buffers, so a run there takes the same copy and write-back path a
    GPU run takes (at the cost of the copies)."""
    return LayerResidency.on_device(model, device, prefetch=prefetch, copy_on_host=True,
                                    keep_timeline=False)
