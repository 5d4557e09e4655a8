"""LoRA adapter files in PEFT's format, and merged export.

A directory holds ``adapter_config.json`` (PEFT ``LoraConfig`` fields) and
``adapter_model.safetensors`` with tensors named as peft names them on a transformers
causal LM, e.g. ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``
([rank, in]) and ``...lora_B.weight`` ([out, rank]). ``PeftModel.from_pretrained`` loads
what :func:`save_adapters` writes, and :func:`load_adapters` loads what peft writes (plain
LoRA: one rank, one alpha, no DoRA, no bias, no modules_to_save).

Loading validates everything before it touches the model, and every error is one line
naming the file and the key at fault.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from orbitrl.errors import OrbitError
from orbitrl.model.lora import (apply_lora, candidate_linears, lora_modules, match_targets,
                                routed_adapters)
from orbitrl.model.weights import save_pretrained

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PREFIX = "base_model.model."
_KEY = re.compile(r"base_model\.model\.(?P<mod>.+)\.lora_(?P<ab>[AB])(?:\.default)?\.weight")

# PEFT options we do not implement, with the value that means "off".
_UNSUPPORTED = {"use_dora": False, "use_rslora": False, "rank_pattern": {},
                "alpha_pattern": {}, "bias": "none", "lora_bias": False,
                "modules_to_save": None, "fan_in_fan_out": False, "layers_to_transform": None,
                "layers_pattern": None, "exclude_modules": None,
                "layer_replication": None, "trainable_token_indices": None,
                "use_qalora": False, "alora_invocation_tokens": None}


def peft_targets(model: nn.Module) -> list[str] | str:
    """``target_modules`` for adapter_config.json that selects exactly the wrapped modules in
    peft: the leaf names (PEFT's list form) when those select no more than what is wrapped,
    else a regex of the exact names (PEFT's string form, full match)."""
    wrapped = list(lora_modules(model))
    leaves = sorted({n.rpartition(".")[2] for n in wrapped})
    every = set(wrapped) | set(candidate_linears(model))
    if {n for n in every if n.rpartition(".")[2] in leaves} == set(wrapped):
        return leaves
    return "|".join(re.escape(n) for n in wrapped)


# model types whose feed-forward names peft (with transformers 5) maps onto the fused routed
# experts (peft/utils/transformers_weight_conversion.py, the ``qwen2_moe`` pattern): a
# ``gate_proj`` / ``up_proj`` / ``down_proj`` target there adapts the experts instead of the
# dense or shared-expert linear of that name, whatever the target's form
PEFT_REMAPPED_FFN = {"qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
                     "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
                     "deepseek_v3": ("gate_proj", "up_proj", "down_proj")}


def peft_split(model: nn.Module) -> tuple[list[str] | str, list[str]]:
    """(``target_modules``, ``target_parameters``) for adapter_config.json. Where peft would
    move a feed-forward target onto the routed experts (:data:`PEFT_REMAPPED_FFN`), the
    dense and shared-expert linears are named by their weights as ``target_parameters``
    (peft adapts such a weight with the same ``B @ A``; the file's ``lora_dropout`` is then 0,
    which peft requires there and which inference never reads), the rest as usual; when only
    feed-forward linears are wrapped the file keeps them as modules (peft then moves them)."""
    mt = getattr(getattr(model, "config", None), "model_type", None)
    leaves = PEFT_REMAPPED_FFN.get(mt, ())
    wrapped = list(lora_modules(model))
    ffn = [n for n in wrapped if n.rpartition(".")[2] in leaves]
    if not ffn or len(ffn) == len(wrapped):
        return peft_targets(model), []
    rest = [n for n in wrapped if n not in ffn]
    return "|".join(re.escape(n) for n in rest), [f"{n}.weight" for n in ffn]


TRAINED_BASE = "orbitrl_base.json"


def save_adapters(model: nn.Module, out_dir: str | Path,
                  base_model_name_or_path: str | None = None,
                  trained_base: str | None = None) -> Path:
    """Write the model's LoRA adapters as a PEFT adapter directory.

    Args:
        model: a model with :func:`apply_lora` applied (one rank and alpha throughout).
        out_dir: created if missing; files are written under temporary names and renamed.
        base_model_name_or_path: recorded in the config (peft loads the base from it).
        trained_base: the frozen base's format the adapters were trained over
            (``model.base_dtype``), written to ``orbitrl_base.json`` beside them: adapters
            trained over an NF4 base fit that base, and give other answers over the fp32
            weights peft loads (``orbitrl eval --adapter`` reads it and loads the same).
    Returns:
        ``out_dir`` as a Path.
    """
    mods = lora_modules(model)
    if not mods:
        raise OrbitError("save_adapters: the model has no LoRA adapters (call apply_lora)")
    routed = routed_adapters(model)
    if routed:
        raise OrbitError(f"save_adapters: {routed[0]} is a routed expert's adapter; PEFT files "
                         "here cover attention, dense and shared-expert layers only (train with "
                         "lora.experts=none, or export merged weights)")
    first = next(iter(mods.values()))
    drop = first.lora_dropout.p if isinstance(first.lora_dropout, nn.Dropout) else 0.0
    modules, params = peft_split(model)
    if params:
        drop = 0.0  # peft's parameter targets take no dropout (it refuses to load them with one)
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": first.rank,
           "lora_alpha": first.alpha, "lora_dropout": drop, "target_modules": modules,
           **({"target_parameters": params} if params else {}),
           "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True,
           "inference_mode": True, "modules_to_save": None, "use_rslora": False,
           "use_dora": False, "rank_pattern": {}, "alpha_pattern": {},
           "base_model_name_or_path": None if base_model_name_or_path is None
           else str(base_model_name_or_path), "revision": None}
    tensors = {}
    for name, m in mods.items():
        if (m.rank, m.alpha) != (first.rank, first.alpha):
            raise OrbitError(f"save_adapters: {name} has rank {m.rank}, alpha {m.alpha}; PEFT "
                             f"files here carry one rank/alpha ({first.rank}, {first.alpha})")
        tensors[f"{PREFIX}{name}.lora_A.weight"] = m.lora_A.weight.detach().cpu().contiguous()
        tensors[f"{PREFIX}{name}.lora_B.weight"] = m.lora_B.weight.detach().cpu().contiguous()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (WEIGHTS_NAME + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / WEIGHTS_NAME)
    tmp = out / (CONFIG_NAME + ".tmp")
    tmp.write_text(json.dumps(cfg, indent=2))
    os.replace(tmp, out / CONFIG_NAME)
    if trained_base is not None:
        tmp = out / (TRAINED_BASE + ".tmp")
        tmp.write_text(json.dumps({"base_dtype": trained_base,
                                   "base_model_name_or_path": cfg["base_model_name_or_path"]},
                                  indent=2))
        os.replace(tmp, out / TRAINED_BASE)
    return out


def trained_base(path: str | Path) -> str | None:
    """The base format an adapter directory says it was trained over (``orbitrl_base.json``),
    or None (adapters from elsewhere, or older runs)."""
    f = Path(path) / TRAINED_BASE
    if not f.exists():
        return None
    try:
        return str(json.loads(f.read_text())["base_dtype"])
    except (ValueError, KeyError, TypeError):
        raise OrbitError(f"{f}: not a JSON object with 'base_dtype'") from None


def read_adapter_config(path: str | Path) -> dict:
    """adapter_config.json of an adapter directory, checked for the LoRA subset we run."""
    f = Path(path) / CONFIG_NAME
    if not f.exists():
        raise OrbitError(f"{f}: missing (not a PEFT adapter directory)")
    try:
        cfg = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise OrbitError(f"{f}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise OrbitError(f"{f}: expected a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise OrbitError(f"{f}: peft_type {cfg['peft_type']!r} is not supported (only LORA)")
    for k in ("r", "lora_alpha", "target_modules"):
        if k not in cfg:
            raise OrbitError(f"{f}: key {k!r} is missing")
    if not isinstance(cfg["r"], int) or cfg["r"] <= 0:
        raise OrbitError(f"{f}: key 'r' must be a positive integer, got {cfg['r']!r}")
    tp = cfg.get("target_parameters") or []
    bad = [p for p in tp if not (isinstance(p, str) and p.endswith(".weight"))] \
        if isinstance(tp, list) else [tp]
    if bad:
        raise OrbitError(f"{f}: key 'target_parameters' entry {bad[0]!r} is not supported (only "
                         "a linear layer's '<module>.weight'; routed experts' fused tensors are "
                         "not adapted here)")
    for k, off in _UNSUPPORTED.items():
        v = cfg.get(k, off)
        if v != off and not (off in ({}, None) and not v):
            raise OrbitError(f"{f}: key {k!r} = {v!r} is not supported (only plain LoRA)")
    return cfg


def _config_targets(cfg: dict) -> list[str]:
    t = cfg["target_modules"]
    out = [t if t == "all-linear" else "re:" + t] if isinstance(t, str) else list(t or [])
    # a linear's weight named as a parameter target: that linear (peft_split)
    return out + ["re:" + re.escape(p[:-len(".weight")])
                  for p in cfg.get("target_parameters") or []]


def load_adapters(model: nn.Module, path: str | Path, adapter_dtype="float32") -> list[str]:
    """Load a PEFT LoRA adapter directory into ``model``.

    If the model has no adapters yet they are created from the config (rank, alpha, dropout,
    target_modules); if it has, the config must agree with them. Every tensor's name, rank
    and shape is checked against the base before anything is changed.

    Args:
        model: our Decoder, base loaded in any format.
        path: directory with adapter_config.json and adapter_model.safetensors.
        adapter_dtype: dtype of newly created adapters.
    Returns:
        The adapted module names.
    """
    path = Path(path)
    cfg = read_adapter_config(path)
    cfile, wfile = path / CONFIG_NAME, path / WEIGHTS_NAME
    r, alpha = cfg["r"], float(cfg["lora_alpha"])
    existing = lora_modules(model)
    if existing:
        names = list(existing)
        first = next(iter(existing.values()))
        if (first.rank, first.alpha) != (r, alpha):
            raise OrbitError(f"{cfile}: r={r}, lora_alpha={alpha} but the model's adapters "
                             f"have rank {first.rank}, alpha {first.alpha}")
        want = set(match_targets(list(existing) + list(candidate_linears(model)),
                                 _config_targets(cfg), key=f"{cfile}: target_modules"))
        if want != set(names):
            diff = sorted(want ^ set(names))[0]
            raise OrbitError(f"{cfile}: target_modules select a different set of modules than "
                             f"the model's adapters (e.g. {diff!r})")
        shapes = {n: (m.in_features, m.out_features) for n, m in existing.items()}
    else:
        cands = candidate_linears(model)
        names = match_targets(cands, _config_targets(cfg), key=f"{cfile}: target_modules")
        shapes = {n: (cands[n].in_features, cands[n].out_features) for n in names}

    if not wfile.exists():
        raise OrbitError(f"{wfile}: missing")
    tensors: dict[tuple[str, str], torch.Tensor] = {}
    try:
        with safe_open(str(wfile), framework="pt", device="cpu") as sf:
            for key in sf.keys():
                m = _KEY.fullmatch(key)
                if m is None:
                    raise OrbitError(f"{wfile}: unexpected tensor {key!r} (expected "
                                     f"{PREFIX}<module>.lora_A.weight / lora_B.weight)")
                mod, ab = m["mod"], m["ab"]
                if mod not in shapes:
                    raise OrbitError(f"{wfile}: tensor {key!r} is for module {mod!r}, which "
                                     f"{CONFIG_NAME} target_modules does not select in this model")
                fin, fout = shapes[mod]
                want = (r, fin) if ab == "A" else (fout, r)
                t = sf.get_tensor(key)
                if tuple(t.shape) != want:
                    got_r = t.shape[0] if ab == "A" else t.shape[-1]
                    why = (f"its rank {got_r} is not r={r} of {CONFIG_NAME}" if got_r != r
                           else f"{mod!r} is [{fout}, {fin}] in this base")
                    raise OrbitError(f"{wfile}: tensor {key!r} has shape {tuple(t.shape)}, "
                                     f"expected {want}: {why}")
                tensors[(mod, ab)] = t
    except SafetensorError as e:
        raise OrbitError(f"{wfile}: unreadable safetensors file ({e})") from None
    for n in names:
        for ab in "AB":
            if (n, ab) not in tensors:
                raise OrbitError(f"{wfile}: lacks tensor {PREFIX}{n}.lora_{ab}.weight "
                                 f"({CONFIG_NAME} target_modules select {n!r})")

    if not existing:
        targets = ["re:" + "|".join(re.escape(n) for n in names)]
        apply_lora(model, r, alpha, float(cfg.get("lora_dropout", 0.0) or 0.0), targets,
                   adapter_dtype)
    mods = lora_modules(model)
    with torch.no_grad():
        for (n, ab), t in tensors.items():
            lin = mods[n].lora_A if ab == "A" else mods[n].lora_B
            lin.weight.copy_(t)
    return names


def save_merged(model: nn.Module, out_dir: str | Path, dtype=None, tokenizer=None) -> Path:
    """Export base (dequantized) + adapters (scale * B @ A) as a plain HF model directory
    that transformers loads; adapters switched off export the dequantized base alone."""
    return save_pretrained(model, out_dir, tokenizer=tokenizer, dtype=dtype)


__all__ = ["save_adapters", "load_adapters", "save_merged", "read_adapter_config",
           "peft_targets"]
