"""A small reward model as a reward source: a scalar head on a model directory.

The directory is an ordinary HF model directory (our decoder loads it) plus
``reward_head.safetensors`` holding ``weight`` [1, hidden] and ``bias`` [1]; the score of a
(prompt, completion) is the head applied to the final hidden state of the last token. It
lives here, not in ``rewards/``, because rewards never import the model; the reward runner
sees it as one more callable ``fn(prompt, completion, **fields) -> float`` (so it gets the
same time limit, error accounting and per-source metrics as any verifier).
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from orbitrl.errors import OrbitError
from orbitrl.model import load_model, load_tokenizer
from orbitrl.model.builtin import resolve_model_path

HEAD_FILE = "reward_head.safetensors"


class RewardModel:
    def __init__(self, path: str | Path, device="cpu"):
        self.path = resolve_model_path(path)
        head = self.path / HEAD_FILE
        if not head.exists():
            raise OrbitError(f"{head}: missing (a reward model directory needs a scalar head)")
        self.model = load_model(self.path, device=device)
        self.tok = load_tokenizer(self.path, self.model.config.vocab_size)
        sd = load_file(str(head))
        H = self.model.config.hidden_size
        if set(sd) != {"weight", "bias"} or tuple(sd["weight"].shape) != (1, H):
            raise OrbitError(f"{head}: expected 'weight' [1, {H}] and 'bias' [1], got "
                             f"{ {k: tuple(v.shape) for k, v in sd.items()} }")
        self.head = torch.nn.Linear(H, 1).to(device)
        self.head.load_state_dict(sd)
        self.lock = threading.Lock()  # the runner calls from worker threads
        self.__name__ = f"rm:{self.path.name}"

    @torch.no_grad()
    def __call__(self, prompt: str, completion: str, **fields) -> float:
        ids = self.tok(prompt + completion, add_special_tokens=False)["input_ids"]
        if not ids:
            raise ValueError("empty prompt and completion")
        with self.lock:
            x = torch.tensor([ids], device=self.model.device)
            h = self.model(x, return_hidden=True)[0, -1]
            return float(self.head(h.float()))


def save_reward_head(path: str | Path, weight: torch.Tensor, bias: torch.Tensor):
    """Write the scalar head beside a model directory's weights."""
    save_file({"weight": weight.detach().reshape(1, -1).contiguous().cpu(),
               "bias": bias.detach().reshape(1).contiguous().cpu()}, str(Path(path) / HEAD_FILE))
