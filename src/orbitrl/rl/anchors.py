"""Reference anchors for the KL term: cached reference logprobs, refreshed on a schedule
and when the policy drifts.

The anchor is the policy the KL is measured against. At the start it is the initial
policy: with adapters, the base with adapters switched off (no extra memory); in full mode
an int8 copy of the starting weights in host memory. Every ``refresh_steps`` steps, and at
once when the monitored mean KL to the anchor passes ``kl_threshold``, the anchor is moved
to the current policy (adapters: a snapshot of the adapter tensors, a few MB; full mode:
the int8 copy is re-quantized from the current weights). A stale anchor lets the policy
"buy" reward with KL drift; a refreshed one keeps the penalty meaningful. Reference
logprobs are computed once per step for the step's samples and reused by every epoch and
micro-batch of that step.
"""

from __future__ import annotations

import contextlib

import torch

from orbitrl.model.decoder import Decoder
from orbitrl.model.dtensor import is_dtensor
from orbitrl.model.lora import adapter_parameters, adapters_disabled
from orbitrl.model.quant import FrozenLinear, leaf_tensors


class Anchors:
    def __init__(self, model: Decoder, reference: Decoder | None, refresh_steps: int = 200,
                 kl_threshold: float = 0.3):
        self.model, self.reference = model, reference
        self.refresh_steps, self.kl_threshold = refresh_steps, kl_threshold
        self.snapshot: list[torch.Tensor] | None = None  # adapter tensors at last refresh
        self.last_refresh = 0
        self.events: list[dict] = []

    @contextlib.contextmanager
    def anchored(self):
        """The anchor policy as a model, for the duration of the block."""
        if self.reference is not None:
            yield self.reference
            return

        if self.snapshot is None:
            with adapters_disabled(self.model):
                yield self.model
            return
        params = adapter_parameters(self.model)
        live = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, s in zip(params, self.snapshot):
                p.copy_(s)
        try:
            yield self.model
        finally:
            with torch.no_grad():
                for p, s in zip(params, live):
                    p.copy_(s)

    def refresh(self, step: int, reason: str, kl: float | None = None):
        """Move the anchor to the current policy and log the event."""
        if self.reference is None:
            self.snapshot = [p.detach().clone() for p in adapter_parameters(self.model)]
        else:
            _requantize(self.reference, self.model)
        self.last_refresh = step
        self.events.append({"step": step, "reason": reason, "kl": kl})

    def maybe_refresh(self, step: int, kl_mean: float) -> str | None:
        """Refresh after the step if due or drifted; returns the reason or None."""
        if kl_mean > self.kl_threshold:
            self.refresh(step, "kl_drift", kl_mean)
            return "kl_drift"
        if self.refresh_steps > 0 and step - self.last_refresh >= self.refresh_steps:
            self.refresh(step, "schedule", kl_mean)
            return "schedule"
        return None

    def state_dict(self) -> dict:
        return {"snapshot": self.snapshot, "last_refresh": self.last_refresh,
                "events": self.events}

    def load_state_dict(self, sd: dict):
        self.snapshot, self.last_refresh = sd["snapshot"], sd["last_refresh"]
        self.events = list(sd["events"])
        if self.reference is not None and self.last_refresh > 0:
            _requantize(self.reference, self.model)


@torch.no_grad()
def _requantize(reference: Decoder, policy: Decoder):
    """Copy the policy's current weights into the frozen (int8) reference, layer by layer.

    In place, into the tensors the reference already holds (the int8 data and scales of each
    projection): a reference on tiers keeps its host copies (pinned on CUDA) and the
    residency manager's view of them. Between steps every tiered layer is cold, so those
    tensors are the host copies."""
    pmods = dict(policy.named_modules())
    for name, mod in list(reference.named_modules()):
        if isinstance(mod, FrozenLinear):
            new = FrozenLinear.from_linear(_cpu_linear(pmods[name]), mod.fmt,
                                           group_size=mod.group_size)
            for key in ("weight", "qweight", "scales"):
                if key in mod._buffers:
                    pairs = zip(leaf_tensors(mod._buffers[key]),
                                leaf_tensors(new._buffers[key]))
                    for dst, src in pairs:
                        dst.copy_(src)
            mod._cached = None  # written in place: a kept dequantized copy is stale
    rparams = dict(reference.named_parameters())
    for name, p in policy.named_parameters():
        if name in rparams:
            rparams[name].copy_(_whole(p).to(rparams[name].device, rparams[name].dtype))


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded (DTensor) parameter: a collective every rank joins
    (ranks refresh their replicated reference together, on the same reduced KL)."""
    t = t.detach()
    return t.full_tensor() if is_dtensor(t) else t


def _cpu_linear(lin):
    out = torch.nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None)
    out.weight.data = _whole(lin.weight).to("cpu", torch.float32).clone()
    if lin.bias is not None:
        out.bias.data = _whole(lin.bias).to("cpu", torch.float32).clone()
    return out.requires_grad_(False)
