"""What every checkpoint format holds besides the policy's tensors, optimizer and anchors:
the step counters and the components' own state (data cursor, updater, guard, KL
controller, critic), the random-number states and the run's extra fields."""

from __future__ import annotations

import random

import torch


def to_cpu(obj):
    """A host copy of every tensor in a nested dict/list/tuple."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def scalar_state(tr, extra: dict) -> dict:
    """Step counters, each component's state_dict, RNG states, the critic; ``extra``."""
    state = {
        "step_idx": tr.step_idx,
        "iteration": tr.iteration,
        # overlapped, the producer has drawn prompts ahead: the cursor keeps the position
        # as of the trained steps
        **tr.data.state_dict(),
        **tr.updater.state_dict(),
        "guard": tr.guard.state_dict(),
        **tr.kl_ctl.state_dict(),
        "rng_python": random.getstate(),
        "rng_torch": torch.get_rng_state(),
        "rng_engine": tr.engine.rng.get_state(),
        "extra": extra,
    }
    if tr.critic is not None:
        state["critic"] = tr.critic.state_dict()
        state.update(tr.critic.opt_state_dict())
    if torch.cuda.is_available():
        state["rng_cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_scalars(tr, state: dict):
    """The inverse of :func:`scalar_state`."""
    tr.updater.load_state_dict(state)
    tr.step_idx, tr.iteration = state["step_idx"], state["iteration"]
    tr.data.load_state_dict(state)
    tr.guard.load_state_dict(state["guard"])
    tr.kl_ctl.load_state_dict(state)
    random.setstate(state["rng_python"])
    torch.set_rng_state(state["rng_torch"])
    tr.engine.rng.set_state(state["rng_engine"])
    if "rng_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng_cuda"])
    if tr.critic is not None:
        tr.critic.load_state_dict(state["critic"])
        tr.critic.load_opt_state_dict(state)
