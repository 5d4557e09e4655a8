"""The PPO critic: a value head on the policy's own final hidden states.

The head (an MLP with its own parameters and optimizer) reads the hidden states the policy
forward already computes, detached, so the critic costs no extra forward pass and no extra
copy of the base, and its loss never moves the policy. V_t is the value of the state before
completion token t is emitted (the hidden state that predicts token t).
"""

from __future__ import annotations

import torch
import torch.nn as nn


class ValueHead(nn.Module):
    def __init__(self, hidden_size: int, width: int | None = None):
        super().__init__()
        width = width or hidden_size
        self.net = nn.Sequential(nn.Linear(hidden_size, width), nn.SiLU(), nn.Linear(width, 1))
        nn.init.zeros_(self.net[-1].weight)
        nn.init.zeros_(self.net[-1].bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [M, H] (detached by the caller) -> values [M]
        return self.net(hidden.float()).squeeze(-1)


def build_critic(algo, hidden_size: int, device):
    """PPO's value head and its AdamW (``algo.value_lr``); (None, None) for the other
    algorithms."""
    if algo.name != "ppo":
        return None, None
    critic = ValueHead(hidden_size).to(device)
    return critic, torch.optim.AdamW(critic.parameters(), lr=algo.value_lr)
