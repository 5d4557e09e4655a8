"""Checkpoints resume at a different world size: saved by 2 ranks (torch.distributed
.checkpoint, each rank its shards), resumed by 1 process; saved by 1 process (state.pt),
resumed by 2 ranks. Either way the run ends where the uninterrupted one-process run ends."""

from __future__ import annotations

import pytest

from dist_helpers import STEPS, final_weights, max_diff, metrics, train, train_args

HALF = 2


@pytest.mark.parametrize("mode,first,then", [("full", 2, 1), ("adapter", 1, 2),
                                             ("adapter", 2, 1)])
def test_resume_at_another_world_size(one_process_runs, tiny_llama, tmp_path, mode, first,
                                      then):
    reference = one_process_runs
    run = tmp_path / "run"
    train(train_args(tiny_llama, mode, HALF), first, run)
    ckpt = run / "checkpoints" / f"step-{HALF:06d}"
    if first > 1:  # a sharded checkpoint: DCP metadata plus one file per rank
        assert (ckpt / ".metadata").exists() and (ckpt / "meta.pt").exists()
        assert len(list(ckpt.glob("*.distcp"))) == first
    else:
        assert (ckpt / "state.pt").exists()
    train(train_args(tiny_llama, mode, STEPS), then, run, resume=True)
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(STEPS))
    ref = metrics(reference[mode])
    assert [r["reward_mean"] for r in rows] == pytest.approx(
        [r["reward_mean"] for r in ref], abs=1e-6)  # same data position and samples
    d = max_diff(final_weights(reference[mode], mode), final_weights(run, mode))
    print(f"{mode}: {first} -> {then} ranks, max |resumed - uninterrupted| = {d:.2e}")
    assert d < 1e-5
