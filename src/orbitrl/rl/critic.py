"""PPO's critic: a value network of its own (``critic.kind: model``) or a value head on the
policy's hidden states (``critic.kind: head``).

Both give ``critic(batch, hidden) -> values [M]`` for the completion positions of a packed
micro-batch (``hidden``: the policy's final hidden states there, detached) and train on their
own: a backward of their own after the actor's, their own optimizer, their gradients clipped
to ``algo.critic_max_grad_norm``. V_t is the value of the state before completion token t is
emitted (the hidden state that predicts token t).

- ``head``: an MLP on the policy's hidden states; no forward of its own, no copy of the base.
- ``model``: a decoder of the policy's architecture (``critic.path`` empty: the policy's
  starting weights; else a model directory or Hub id, a sequence-classification checkpoint
  such as ``orbitrl rm`` writes included, whose score row starts the head) with a scalar
  head on its final hidden states, trained with adapters (``critic.mode: adapter``) or every
  weight (``full``). An adapter critic over the policy's own frozen base shares that base
  (one process, the same directory): its adapters, head and optimizer state are all it adds.
  Otherwise it loads its own base (``critic.base_dtype``, NF4 included) or weights;
  ``critic.tiers`` puts a full critic's layers on host tiers as ``train.tiers`` does the
  policy's.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn

from orbitrl.errors import OrbitError
from orbitrl.model.builtin import resolve_model_path
from orbitrl.model.lora import adapter_parameters, apply_lora
from orbitrl.model.quant import cache_dequantized
from orbitrl.model.weights import load_model
from orbitrl.rl.policy import BASE_FORMATS, load_base, place_on_tiers
from orbitrl.train.optim import build_optimizer, is_fused
from orbitrl.train.reward_model import classifier_labels


class ValueHead(nn.Module):
    """An MLP on the policy's detached hidden states (``critic.kind: head``)."""

    def __init__(self, hidden_size: int, width: int | None = None):
        super().__init__()
        width = width or hidden_size
        self.net = nn.Sequential(nn.Linear(hidden_size, width), nn.SiLU(), nn.Linear(width, 1))
        nn.init.zeros_(self.net[-1].weight)
        nn.init.zeros_(self.net[-1].bias)

    def forward(self, batch, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [M, H] (the policy's, detached here) -> values [M]
        return self.net(hidden.detach().float()).squeeze(-1)

    def trainable(self) -> list:
        return list(self.parameters())


class ValueModel(nn.Module):
    """A decoder and a scalar head on its final hidden states (``critic.kind: model``).

    ``state_dict`` holds the trained tensors only (adapters and head, or every weight), so a
    checkpoint does not repeat a base shared with the policy."""

    def __init__(self, decoder: nn.Module, head: nn.Linear):
        super().__init__()
        self.decoder, self.head = decoder, head

    def forward(self, batch, hidden=None) -> torch.Tensor:
        h = self.decoder(batch.input_ids, positions=batch.positions, seq_ids=batch.seq_ids,
                         parent_ids=batch.parent_ids, return_hidden=True, routing=None)
        return self.head(h.flatten(0, 1)[batch.src].float()).squeeze(-1)

    def trainable(self) -> list:
        return [p for p in self.parameters() if p.requires_grad]

    def state_dict(self, *args, **kwargs):
        keep = {id(p) for p in self.trainable()}
        return {n: p.detach().clone() for n, p in self.named_parameters() if id(p) in keep}

    def load_state_dict(self, sd, strict: bool = True):
        own = dict(self.named_parameters())
        if strict and set(sd) != {n for n, p in own.items() if p.requires_grad}:
            raise OrbitError("critic checkpoint: its tensors are not this critic's (critic.* "
                             "keys changed since it was saved?)")
        with torch.no_grad():
            for n, t in sd.items():
                own[n].copy_(t)


class Critic:
    """A value function, its optimizer and its step (see the module doc)."""

    def __init__(self, module: nn.Module, opt, max_grad_norm: float, coll=None,
                 head_opt=None):
        self.module, self.opt, self.max_grad_norm, self.coll = module, opt, max_grad_norm, coll
        self.fused = is_fused(opt)
        self.head_opt = head_opt  # a fused ``opt``'s head, under AdamW

    def __call__(self, batch, hidden: torch.Tensor) -> torch.Tensor:
        return self.module(batch, hidden)

    def parameters(self):
        return self.module.trainable()

    def state_dict(self) -> dict:
        return self.module.state_dict()

    def load_state_dict(self, sd: dict):
        self.module.load_state_dict(sd)

    def opt_state_dict(self) -> dict:
        out = {"critic_opt": self.opt.state_dict()}
        if self.head_opt is not None:
            out["critic_head_opt"] = self.head_opt.state_dict()
        return out

    def load_opt_state_dict(self, state: dict):
        self.opt.load_state_dict(state["critic_opt"])
        if self.head_opt is not None:
            self.head_opt.load_state_dict(state["critic_head_opt"])

    def step(self, loss_fn) -> dict:
        """One update: ``loss_fn() -> (loss, metrics)`` run forward and backward (twice for
        a fused two-pass update), the gradients summed over ranks and clipped, the step
        taken. Returns the metrics of the last run."""
        out = {}

        def closure():
            # (a fused two-pass step runs this twice: the head keeps the last pass's)
            (self.head_opt if self.fused else self.opt).zero_grad(set_to_none=True)
            loss, m = loss_fn()
            loss.backward()
            out.update(m)
            return loss

        if self.fused:
            self.opt.step(closure)
            torch.nn.utils.clip_grad_norm_(self.module.head.parameters(), self.max_grad_norm)
            self.head_opt.step()
            return out
        closure()
        params = self.parameters()
        if self.coll is not None:
            self.coll.sum_grads(params)
        torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return out


def share_frozen(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose frozen modules and tensors are the same objects as the
    original's (a frozen base, its dequantization cache, norms, embeddings) and whose
    trained tensors (the adapters) are its own."""
    memo: dict = {}
    for m in model.modules():
        if not any(p.requires_grad for p in m.parameters()):
            memo[id(m)] = m  # a frozen subtree: the same module
        tensors = list(m._parameters.values()) + list(m._buffers.values()) + \
            [v for v in vars(m).values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            if t is not None and not t.requires_grad:
                memo[id(t)] = t
    return copy.deepcopy(model, memo)


def critic_mode(cfg) -> str:
    return cfg.train.mode if cfg.critic.mode == "auto" else cfg.critic.mode


def build_critic(cfg, policy_model, device, coll=None, distributed: bool = False):
    """PPO's critic for ``cfg`` (None for the other algorithms)."""
    a, c = cfg.algo, cfg.critic
    if a.name != "ppo":
        return None
    if c.kind == "head":
        head = ValueHead(policy_model.config.hidden_size).to(device)
        return Critic(head, torch.optim.AdamW(head.parameters(), lr=a.value_lr),
                      a.critic_max_grad_norm, coll)
    mode = critic_mode(cfg)
    extra: dict = {}
    decoder = _critic_decoder(cfg, policy_model, device, mode, distributed, extra)
    H = decoder.config.hidden_size
    head = nn.Linear(H, 1, bias=False).to(device)  # a one-label classifier's score row
    nn.init.zeros_(head.weight)
    if "score.weight" in extra:
        with torch.no_grad():
            head.weight.copy_(extra["score.weight"].reshape(1, H))
    if getattr(decoder, "lm_head", None) is not None and not decoder.config.tie_word_embeddings:
        decoder.lm_head = None  # the critic reads hidden states only
    module = ValueModel(decoder, head)
    opt_name = c.optimizer if c.optimizer != "auto" else ("adamw" if mode == "adapter"
                                                          else "adalomo")
    if opt_name == "adamw":
        return Critic(module, torch.optim.AdamW(module.trainable(), lr=a.value_lr),
                      a.critic_max_grad_norm, coll)
    if distributed:
        raise OrbitError(f"config key 'critic.optimizer': {opt_name} (a fused update) runs "
                         "on one process; use adamw under torchrun")
    # the decoder's weights under the fused update; the head under AdamW (H numbers of
    # moments): a stateless update scales a tensor's step by its own size, and the head
    # starts at zero
    opt = build_optimizer(opt_name, decoder_params(module), a.value_lr,
                          max_grad_norm=a.critic_max_grad_norm)
    opt.veto = lambda norm: not math.isfinite(norm)
    return Critic(module, opt, a.critic_max_grad_norm, coll,
                  head_opt=torch.optim.AdamW(head.parameters(), lr=a.value_lr))


def decoder_params(module: ValueModel) -> list:
    return [p for p in module.decoder.parameters() if p.requires_grad]


def _critic_decoder(cfg, policy_model, device, mode: str, distributed: bool, extra: dict):
    """The critic's decoder: the policy's frozen base shared where it can be, else loaded
    (a one-label sequence classifier's ``score.weight`` into ``extra``)."""
    c = cfg.critic
    same_base = (c.base_dtype in ("auto", cfg.model.base_dtype))
    if (mode == "adapter" and cfg.train.mode == "adapter" and not c.path and same_base
            and not distributed):
        dec = share_frozen(policy_model)
        for p in adapter_parameters(dec):  # its own adapters, from the policy's start
            p.requires_grad_(True)
        return dec
    path = resolve_model_path(c.path or cfg.model.path,
                              None if c.path else cfg.model.revision)
    labels = classifier_labels(path)
    if labels not in (None, 1):
        raise OrbitError(f"{path / 'config.json'}: a classifier with {labels} labels; a "
                         "critic starts from one label (critic.path)")
    extra = extra if labels == 1 else None
    dtype = "float32" if cfg.model.dtype == "fp32" else "bfloat16"
    if mode == "adapter":
        fmt = cfg.model.base_dtype if c.base_dtype == "auto" else c.base_dtype
        dec = load_base(path, BASE_FORMATS[fmt], dtype, device, extra)
        apply_lora(dec, rank=cfg.lora.rank, alpha=cfg.lora.alpha, dropout=0.0,
                   targets=cfg.lora.targets, experts=cfg.lora.experts)
        cache_dequantized(dec, cfg.model.dequant_cache_mb << 20,
                          torch.float32 if cfg.model.dtype == "fp32" else torch.bfloat16)
    else:
        dec = load_model(path, dtype=dtype, device="cpu" if c.tiers else device, extra=extra)
        for p in dec.parameters():
            p.requires_grad_(True)
        if c.tiers:
            dec.residency = place_on_tiers(dec, device, c.tiers)
    dec.recompute = policy_model.recompute or bool(c.tiers)
    dec.offload_activations = False
    dec.attention_fp64 = getattr(policy_model, "attention_fp64", False)
    return dec
