"""The distributed mechanisms one by one: process-group setup and bad input (one process),
then sharded optimizers, lockstep forwards, global-batch statistics and metric reduction on
2 ranks against their one-process originals (tests/distributed/rank_checks.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dist_helpers import TIMEOUT_S, rank_env

from orbitrl.config import load_config
import launch
from orbitrl.distributed.env import Dist, choose_backend, init_distributed
from orbitrl.distributed.metrics import reduce_row
from orbitrl.errors import OrbitError

CHECKS = Path(__file__).with_name("rank_checks.py")


def test_share_covers_every_item_once():
    for n in range(0, 11):
        for world in (1, 2, 3, 4):
            spans = [Dist(rank=r, world=world).share(n) for r in range(world)]
            assert spans[0][0] == 0 and spans[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            assert max(b - a for a, b in spans) - min(b - a for a, b in spans) <= 1


def test_one_process_is_the_identity():
    cfg = load_config()
    d = init_distributed(cfg, env={})
    assert not d.enabled and d.is_main and d.world == 1
    assert d.all_sum(2.5) == 2.5 and d.any(True) and not d.any(False)
    row = {"step": 1, "reward_mean": 0.25}
    assert reduce_row(row, d) is row


def test_backend_choice():
    assert choose_backend("auto", "cpu") == "gloo"
    assert choose_backend("auto", "cuda") == "nccl"
    assert choose_backend("gloo", "auto") == "gloo"


@pytest.mark.parametrize("env,over,needle", [
    ({"WORLD_SIZE": "2", "RANK": "x"}, [], "WORLD_SIZE/RANK/LOCAL_RANK"),
    ({"WORLD_SIZE": "2", "RANK": "5"}, [], "RANK 5 is outside WORLD_SIZE 2"),
    ({"WORLD_SIZE": "2", "RANK": "0"}, ["dist.backend=nccl", "model.device=cpu"],
     "dist.backend"),
])
def test_bad_launch_is_one_line_error(env, over, needle):
    import torch

    if "dist.backend=nccl" in over and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(OrbitError, match=needle.replace("/", ".")):
        init_distributed(load_config(None, over), env=env)


@pytest.mark.parametrize("item,needle", [("dist.timeout_s=0", "dist.timeout_s"),
                                         ("dist.prefetch_layers=-1", "dist.prefetch_layers"),
                                         ("dist.backend=mpi", "dist.backend")])
def test_bad_dist_keys(item, needle):
    with pytest.raises(OrbitError, match=needle):
        load_config(None, [item])


def test_launch_kills_a_hang():
    with pytest.raises(launch.LaunchTimeout, match="still running"):  # not a 600 s wait
        launch.run([sys.executable, "-c", "import time; time.sleep(600)"], 2, timeout_s=2)


def test_sharded_mechanisms_match_one_process():
    res = launch.run([sys.executable, str(CHECKS), "fused_optimizers", "lockstep",
                      "global_batch", "empty_rank", "metrics", "prefetch_depth"], 2, TIMEOUT_S,
                     env=rank_env())
    for r in res:
        assert r.returncode == 0, f"rank {r.rank}: {r.stderr[-3000:]}"
        assert f"rank {r.rank}: metrics ok" in r.stdout
