"""Framework ops an orbitrl step dispatches, per phase: the host's share of a step's time.

A small model's step on a CPU (and any eager step on an accelerator) is bound less by its
FLOPs than by the ops it dispatches: each costs the host ``Links.op_us`` (Python, the
dispatcher, a launch) on top of its compute. The counts below are this implementation's,
counted (``ORBITRL_COUNT_OPS=1``, observe/metrics.py) on decoders of one and of three layers (the difference
is the per-layer count); ``tests/ledger/test_dispatch.py`` recounts them on the built-in model's
code and fails when they drift by more than a quarter. They are aten ops: views included,
autograd's backward ops included, the optimizer's own ops included.

- rollout: per engine step (one decode step of the whole batch; the first also prefills),
  per layer and once for the sampler, the head and the scheduler's tensors. Adapters add the
  LoRA products; a quantized base its per-layer dequantization.
- score: the phase's own bookkeeping once, and per scoring pass (reference, old logprobs,
  values) and micro-batch a forward.
- train: forward and backward per micro-batch; adapters' AdamW steps each LoRA tensor once
  per step (``optimizer``, per layer, the seven linears of ``all-linear``); the fused
  stateless update runs inside the backward, so full mode has no per-step term.
"""

from __future__ import annotations

from dataclasses import dataclass

ROLLOUT_FIXED = 133  # per engine step: sampling, the head, positions and block tables
ROLLOUT_LAYER = {"full": 84, "adapter": 126, "adapter_quantized": 132}  # per engine step
SCORE_FIXED = 175  # per step: advantages, masks, packing (with or without a scoring pass)
FORWARD_LAYER, FORWARD_FIXED = 44, 129  # per micro-batch of a scoring pass
TRAIN_LAYER = {"full": 531, "adapter": 360}  # per micro-batch, forward + backward
TRAIN_FIXED = {"full": 393, "adapter": 272}  # per micro-batch: the loss, logprobs, the head
OPTIMIZER_LAYER = {"full": 0, "adapter": 168}  # per step (fused full mode: in the backward)
OPTIMIZER_FIXED = {"full": 0, "adapter": 3}

@dataclass(frozen=True)
class HostCost:
    """Host microseconds per op, per phase: ``*_fixed`` for the ops a phase dispatches
    whatever the depth (sampling, scheduling, the loss, the optimizer's bookkeeping), which
    carry most of the Python around them, ``*_layer`` for the ops of its decoder layers.
    Measured by ``orbitrl plan --this-machine`` (observe/calibrate.py)."""

    rollout_fixed: float
    rollout_layer: float
    score_fixed: float
    score_layer: float
    train_fixed: float
    train_layer: float

    def seconds(self, phase: str, ops: tuple[int, int]) -> float:
        """``ops``: (fixed, per-layer) ops of ``phase``."""
        return (ops[0] * getattr(self, f"{phase}_fixed")
                + ops[1] * getattr(self, f"{phase}_layer")) * 1e-6


def _kind(kind: str) -> str:
    return "adapter" if kind == "adapter" else "full"


def rollout_ops(kind: str, quantized_base: bool, layers: int) -> tuple[int, int]:
    """(fixed, layer) ops of one engine step."""
    key = "adapter_quantized" if kind == "adapter" and quantized_base else _kind(kind)
    return ROLLOUT_FIXED, ROLLOUT_LAYER[key] * layers


def score_ops(layers: int, micro_steps: int, passes: int) -> tuple[int, int]:
    """(fixed, layer) ops of the scoring phase: its bookkeeping and ``passes`` forwards
    over ``micro_steps`` micro-batches each."""
    n = passes * micro_steps
    return SCORE_FIXED + n * FORWARD_FIXED, n * FORWARD_LAYER * layers


def train_ops(kind: str, layers: int, micro_steps: int) -> tuple[int, int]:
    """(fixed, layer) ops of one update: every micro-batch's forward and backward, and the
    optimizer."""
    k = _kind(kind)
    return (micro_steps * TRAIN_FIXED[k] + OPTIMIZER_FIXED[k],
            (micro_steps * TRAIN_LAYER[k] + OPTIMIZER_LAYER[k]) * layers)


def train_ops_outside_layers(kind: str, layers: int, micro_steps: int) -> tuple[int, int]:
    """(fixed, layer) ops of one update less its decoder layers' forward and backward (what
    a timed layer, ``Links.train_layer_token_s``, already holds): the loss, logprobs and head per
    micro-batch, and the optimizer."""
    k = _kind(kind)
    return micro_steps * TRAIN_FIXED[k] + OPTIMIZER_FIXED[k], OPTIMIZER_LAYER[k] * layers
