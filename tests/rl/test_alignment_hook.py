"""check-alignment inside training (log.align_every): logged every N steps, sequential and
overlapped, and the figures see a real mismatch."""

import pytest
import torch

from orbitrl.config import load_config
from orbitrl.errors import OrbitError
from trainer_helpers import make_trainer

SMALL = ["rollout.prompts_per_step=2", "rollout.n=4", "rollout.max_tokens=4",
         "data.heldout_size=8", "model.base_dtype=int8", "log.align_every=2",
         "lora.dropout=0.1"]


def make(*over):
    return make_trainer(*SMALL, *over)


@pytest.mark.parametrize("overlap", [False, True])
def test_alignment_is_logged_every_n_steps(overlap):
    tr = make(f"rollout.overlap={str(overlap).lower()}")
    try:
        rows = [tr.step() for _ in range(3)]
    finally:
        tr.close()
    assert [("align_ok" in r) for r in rows] == [True, False, True]
    for r in (rows[0], rows[2]):
        assert r["align_ok"] == 1.0, r
        assert r["align_l1_max"] < 1e-3 and r["align_topk_agreement"] == 1.0
        assert r["align_logprob_gap_max"] < 1e-3


def test_the_training_check_reports_a_mismatch():
    from orbitrl.evals.alignment import training_row

    tr = make()
    prompts = [tr.encode(r["prompt"]) for r in tr.train_rows[:2]]
    engine_only = {}

    def shifted(module, inputs, output):  # the engine path sees shifted logits
        if engine_only.get("on"):
            return output + torch.linspace(0, 8, output.shape[-1])

    h = tr.model.lm_head.register_forward_hook(shifted)
    engine_only["on"] = True
    tr.model.train(True)
    try:
        row = training_row(tr.model, tr.tok, prompts, 4)
    finally:
        h.remove()
    assert row["align_ok"] == 0.0 and row["align_l1_max"] > 0.1
    assert tr.model.training  # the check ran in eval mode and left the mode as it was


def test_bad_key_is_one_line_error():
    with pytest.raises(OrbitError, match="log.align_every"):
        load_config(None, ["log.align_every=-1"])
