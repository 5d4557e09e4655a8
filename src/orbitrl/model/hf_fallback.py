"""A causal LM without native code, run through its transformers module.

``HFDecoder`` holds an ``AutoModelForCausalLM`` and presents what the trainer calls on a
:class:`Decoder`: ``config`` (a ``ModelConfig`` read generically from the transformers
config: no mixture, no soft-cap), ``lm_head``, ``forward(input_ids, positions, seq_ids,
parent_ids, return_hidden=True)`` over packed rows, ``recompute`` (transformers' gradient
checkpointing). The transformers module's children are registered as its own, so module
and parameter names are transformers' (``gpt_neox.layers.0.attention.query_key_value``):
LoRA wraps them in place (``lora.apply_lora`` over ``layers_prefix``) and adapter files
carry the names peft gives them on that model. Rollout goes through transformers'
``generate`` (``engine/hf_generate.py``).

Packed rows are unpacked: each sample's own sequence (its shared prompt, then its tokens)
runs as one row of a right-padded batch with an attention mask, and the final hidden states
go back to the positions the sample occupies in the packed layout (a shared prompt's from
its first completion: they are the same). It costs the prompt once per sample; the native
decoder computes it once per group.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn as nn

from orbitrl.errors import OrbitError
from orbitrl.model.builtin import resolve_model_path
from orbitrl.model.config import ModelConfig, is_native
from orbitrl.model.lora import LoRALinear, lora_modules
from orbitrl.model.tokenizer import save_tokenizer
from orbitrl.model.weights import load_model, to_dtype

# the shape keys the ledger reads from config.json, read through transformers' attribute
# names (GPT-2's n_embd is its hidden_size)
SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
              "intermediate_size", "num_key_value_heads", "head_dim", "max_position_embeddings")
WARNING = ("orbitrl: {name}: model_type {mt!r} runs through transformers (LoRA or full "
           "training on its module, rollout through its generate); the native families are "
           "faster (docs/models.md)")


def fallback_config(hf_cfg, raw: dict) -> ModelConfig:
    """A ``ModelConfig`` for a transformers config (``hf_cfg``; ``raw``: its config.json)
    with what the trainer and the ledger read; ``hf`` is ``raw`` with the shape keys under
    their usual names."""
    get = lambda k, d=None: getattr(hf_cfg, k, None) or d  # noqa: E731
    hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
    shape = {k: getattr(hf_cfg, k, None) for k in SHAPE_KEYS}
    shape["intermediate_size"] = int(get("intermediate_size") or get("ffn_dim") or 4 * hidden)
    hf = {**raw, **{k: v for k, v in shape.items() if v is not None}}
    return ModelConfig(
        model_type=hf_cfg.model_type, vocab_size=int(hf_cfg.vocab_size), hidden_size=hidden,
        intermediate_size=shape["intermediate_size"], num_layers=int(get("num_hidden_layers")),
        num_heads=heads, num_kv_heads=heads, head_dim=int(get("head_dim", hidden // heads)),
        max_position_embeddings=int(get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(getattr(hf_cfg, "tie_word_embeddings", False)),
        bos_token_id=get("bos_token_id"), eos_token_id=get("eos_token_id"), hf=hf)


class HFDecoder(nn.Module):
    """A transformers causal LM behind the :class:`Decoder` interface the trainer uses.

    Args:
        hf_model: the loaded ``PreTrainedModel`` (its children become this module's).
        raw: its config.json as a dict.
    """

    def __init__(self, hf_model, raw: dict):
        super().__init__()
        for name, child in hf_model.named_children():
            self.add_module(name, child)
        object.__setattr__(self, "hf", hf_model)  # (not a child: its children are ours)
        self.config = fallback_config(hf_model.config, raw)
        self.layers_prefix = _layer_list(hf_model, self.config.num_layers) + "."
        self.offload_activations = self.attention_fp64 = False
        self.dropout: dict = {}  # config dropout rates set to 0 at load (load_hf_model)
        self._recompute = False

    lm_head = property(lambda self: self.hf.get_output_embeddings())
    device = property(lambda self: next(self.parameters()).device)

    @property
    def recompute(self) -> bool:
        return self._recompute

    @recompute.setter
    def recompute(self, on: bool):
        """``train.recompute``: transformers' gradient checkpointing of each layer."""
        was, self._recompute = self._recompute, bool(on)
        if on and not was:
            self.hf.gradient_checkpointing_enable({"use_reentrant": False})
        elif was and not on:
            self.hf.gradient_checkpointing_disable()

    def train(self, mode: bool = True):
        super().train(mode)
        self.hf.training = mode  # (the wrapper's own flag; its children are ours)
        return self

    def hidden(self, ids: torch.Tensor, mask: torch.Tensor,
               positions: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states [B, T, H] of right-padded rows (mask [B, T])."""
        out = self.hf.base_model(input_ids=ids, attention_mask=mask, position_ids=positions,
                                 use_cache=False)
        return out.last_hidden_state

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                seq_ids: torch.Tensor | None = None, attn=None, return_hidden: bool = False,
                parent_ids: torch.Tensor | None = None, routing=None, **_):
        """Packed rows [R, L] -> final hidden states [R, L, H] (logits [R, L, V] without
        ``return_hidden``); padding positions (seq id -1) hold zeros."""
        if attn is not None or routing is not None:
            raise OrbitError("the transformers-backed policy takes no attention backend and "
                             "no routing replay")
        R, L = input_ids.shape
        if seq_ids is None:
            seq_ids = torch.zeros_like(input_ids)
        rows = _unpack(seq_ids.tolist(), None if parent_ids is None else parent_ids.tolist())
        T = max(len(idx) for _, idx in rows)
        flat = [r * L + i for r, idx in rows for i in idx]
        n = torch.tensor([len(idx) for _, idx in rows], device=input_ids.device)
        mask = (torch.arange(T, device=input_ids.device)[None] < n[:, None]).long()
        src = torch.zeros(len(rows), T, dtype=torch.long, device=input_ids.device)
        src[mask.bool()] = torch.tensor(flat, device=input_ids.device)
        ids = input_ids.flatten()[src] * mask
        pos = (positions.flatten()[src] * mask if positions is not None
               else torch.arange(T, device=input_ids.device).expand(len(rows), T))
        h = self.hidden(ids, mask, pos)[mask.bool()]  # [N, H] in the order of ``flat``
        # a shared prompt's positions from its first sample only (each packed position
        # one hidden state, so one path for its gradient)
        seen: set = set()
        first = torch.tensor([f not in seen and not seen.add(f) for f in flat], device=h.device)
        out = h.new_zeros(R * L, h.shape[-1]).index_copy(0, src[mask.bool()][first], h[first])
        out = out.view(R, L, -1)
        return out if return_hidden else self.lm_head(out)

    def save_pretrained(self, out_dir, tokenizer=None, dtype=None) -> Path:
        """The whole model as transformers writes it (adapters merged in), its weights in
        ``dtype`` (None: as loaded)."""
        if dtype is not None:
            self.hf.to(to_dtype(dtype))
        mods = lora_modules(self)
        for name, m in mods.items():  # merged copies, the live modules left as they are
            parent, _, child = name.rpartition(".")
            merged = nn.Linear(m.in_features, m.out_features, bias=m.base_layer.bias is not None)
            state = m.dequantized_state()
            merged.load_state_dict({k: v.to(merged.weight.dtype) for k, v in state.items()})
            setattr(self.get_submodule(parent), child, merged)
        kept = {k: getattr(self.hf.config, k) for k in self.dropout}
        try:
            for k, v in self.dropout.items():  # the checkpoint's own dropout rates
                setattr(self.hf.config, k, v)
            self.hf.save_pretrained(out_dir)
        finally:
            for k, v in kept.items():
                setattr(self.hf.config, k, v)
            for name, m in mods.items():
                parent, _, child = name.rpartition(".")
                assert isinstance(m, LoRALinear)
                setattr(self.get_submodule(parent), child, m)
        if tokenizer is not None:
            save_tokenizer(tokenizer, out_dir)
        return Path(out_dir)


def _layer_list(hf_model, n_layers: int) -> str:
    """The module name of the transformers model's decoder layer list (``gpt_neox.layers``,
    ``model.decoder.layers``): its first ``ModuleList`` of ``num_layers`` entries."""
    for name, mod in hf_model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == n_layers:
            return name
    return "model.layers"


def _unpack(seq_ids: list, parent_ids: list | None) -> list[tuple[int, list[int]]]:
    """(row, column indices) of each sample's whole sequence in packed rows: a sequence a
    completion reads through ``parent_ids`` (its group's shared prompt) comes first; a
    sequence that others read is not a sample of its own."""
    out = []
    for r, sids in enumerate(seq_ids):
        cols: dict[int, list[int]] = {}
        parent: dict[int, int] = {}
        for i, s in enumerate(sids):
            if s >= 0:
                cols.setdefault(s, []).append(i)
                p = parent_ids[r][i] if parent_ids is not None else s
                if p >= 0 and p != s:
                    parent[s] = p
        read = set(parent.values())
        for s, idx in cols.items():
            if s not in read:
                out.append((r, (cols[parent[s]] if s in parent else []) + idx))
    return out


def load_hf_model(path: str | Path, dtype: str = "float32", device="cpu") -> HFDecoder:
    """The transformers causal LM at ``path`` (config.json that ``ModelConfig`` routes
    here: ``NotNative``), in ``dtype`` on ``device``, with the one warning that the native
    path is faster. Its logits must be its head over the final hidden states (what the
    trainer's chunked logprobs compute); a model that scales, caps or biases them stops
    with one line. Its config's dropout rates are set to 0 (the trainer's forwards run in
    train mode and must compute what the rollout sampled from, as the native decoder has
    no dropout); an export writes them back."""
    from transformers import AutoConfig, AutoModelForCausalLM  # start-up: the fallback's only
    from transformers.utils import logging as hf_logging  # start-up: as above

    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    conf = AutoConfig.from_pretrained(path)
    dropout = {k: v for k, v in conf.to_dict().items()
               if isinstance(v, float) and v and ("dropout" in k or "pdrop" in k)}
    for k in dropout:  # the trainer scores in train mode: it must see the rollout's model
        setattr(conf, k, 0.0)
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # (its loading bar; the run prints its own lines)
    try:
        hf = AutoModelForCausalLM.from_pretrained(path, config=conf, dtype=getattr(torch, dtype))
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    model = HFDecoder(hf.to(device), raw).eval()
    model.dropout = dropout  # (written back on export)
    _check_head(model, path / "config.json")
    print(WARNING.format(name=path.name, mt=model.config.model_type), file=sys.stderr)
    return model


def _check_head(model: HFDecoder, source) -> None:
    head = model.lm_head
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise OrbitError(f"{source}: the output head of {model.config.model_type!r} is not a "
                         "bias-free linear layer (the transformers fallback projects hidden "
                         "states through its weight)")
    ids = torch.arange(1, 5, device=model.device)[None] % model.config.vocab_size
    with torch.no_grad():
        want = model.hf(input_ids=ids).logits.float()
        got = head(model.hidden(ids, torch.ones_like(ids))).float()
    if not torch.allclose(got, want, atol=1e-4, rtol=1e-3):
        raise OrbitError(f"{source}: {model.config.model_type!r} computes its logits other "
                         "than as the head over the final hidden states (a logit scale or "
                         "cap): the transformers fallback does not support it")


def load_any_model(path: str | Path, dtype: str = "float32", device="cpu",
                   column_major_head: bool = True):
    """The model at ``path`` (a directory or ``builtin:NAME``): orbitrl's own decoder where
    its family is native, else (a causal LM transformers knows) the transformers-backed
    :class:`HFDecoder`; anything else stops with ModelConfig's one line.
    ``column_major_head``: see :func:`orbitrl.model.weights.load_model`."""
    path = resolve_model_path(path)
    if not is_native(path):
        return load_hf_model(path, dtype, device)
    return load_model(path, dtype=dtype, device=device, column_major_head=column_major_head)
