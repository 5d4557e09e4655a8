"""A reward model directory (scalar head) as a reward source, alone and beside a verifier."""

import shutil

import pytest
import torch

from orbitrl.errors import OrbitError
from orbitrl.model.builtin import resolve_model_path
from orbitrl.rl.reward_model import RewardModel, save_reward_head


@pytest.fixture()
def rm_dir(tmp_path):
    d = tmp_path / "rm"
    shutil.copytree(resolve_model_path("builtin:tiny-arith"), d)
    torch.manual_seed(0)
    save_reward_head(d, torch.randn(1, 128), torch.tensor([0.5]))
    return d


def test_reward_model_scores_are_the_head_on_the_last_hidden_state(rm_dir):
    rm = RewardModel(rm_dir)
    s = rm("12+34=", "46")
    ids = rm.tok("12+34=46", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        h = rm.model(torch.tensor([ids]), return_hidden=True)[0, -1]
        want = float(rm.head(h))
    assert s == pytest.approx(want) and s != rm("12+34=", "47")


def test_missing_head_is_a_one_line_error(tmp_path):
    d = tmp_path / "plain"
    shutil.copytree(resolve_model_path("builtin:tiny-arith"), d)
    with pytest.raises(OrbitError, match="reward_head.safetensors"):
        RewardModel(d)


def test_trainer_with_reward_model_beside_a_verifier(rm_dir):
    from rl.test_trainer import make

    tr = make("reward.name=exact_match", f"reward.extra=[rm:{rm_dir}]", "reward.weights=[1.0, 0.1]")
    row = tr.step()
    assert "reward_rm_mean" in row and "reward_exact_match_mean" in row
    assert row["reward_rm_errors"] == 0
