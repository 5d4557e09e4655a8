"""``algo.critic_max_grad_norm`` reaches PPO's value-head update (``rl/update.py``
``Updater._critic_step``): after clipping, the head's gradient norm is the key's value
whenever the raw norm is larger."""

import pytest
import torch

from orbitrl.config import load_config
from orbitrl.errors import OrbitError
from orbitrl.rewards import register
from trainer_helpers import make_trainer

CLIP = 1e-3  # far below the head's raw gradient norm on a first step, and not 1.0


@register("test_length_critic", override=True)
def _length(prompt, completion, **f):
    return float(len(completion))  # returns the fresh (zero) value head is far from


def test_critic_gradient_clipped_to_the_key(monkeypatch):
    seen = []  # (max_norm, raw norm, norm after clipping) per clip call
    clip = torch.nn.utils.clip_grad_norm_

    def spy(params, max_norm, *a, **kw):
        params = [p for p in params if p.grad is not None]
        raw = clip(params, max_norm, *a, **kw)
        after = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        seen.append((float(max_norm), float(raw), float(after)))
        return raw

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    tr = make_trainer("rollout.prompts_per_step=2", "rollout.n=4", "rollout.max_tokens=4",
                      "data.heldout_size=8", "reward.name=test_length_critic",
                      "algo.name=ppo", f"algo.critic_max_grad_norm={CLIP}")
    tr.step()
    critic = [(raw, after) for norm, raw, after in seen if norm == CLIP]
    assert critic  # one clip per micro-batch, at the key's value
    for raw, after in critic:
        assert raw > 10 * CLIP
        assert after == pytest.approx(CLIP, rel=1e-4)
    assert all(norm != 1.0 for norm, _, _ in seen)  # the old hard-coded value is gone


def test_key_must_be_positive():
    assert load_config(None, []).algo.critic_max_grad_norm == 1.0
    for bad in ("0", "-1"):
        with pytest.raises(OrbitError, match="algo.critic_max_grad_norm"):
            load_config(None, [f"algo.critic_max_grad_norm={bad}"])
