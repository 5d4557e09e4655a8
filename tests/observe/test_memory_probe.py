"""Host memory probing: phase peaks (and the heap trims they need) on probe steps only."""

import pytest

import orbitrl.observe.memory as memory
from orbitrl.config import load_config
from orbitrl.rl.run import load_data
from orbitrl.rl.trainer import RLTrainer

SMALL = ["rollout.prompts_per_step=2", "rollout.n=4", "rollout.max_tokens=4",
         "data.heldout_size=8", "model.base_dtype=int8", "model.device=cpu"]


def test_phase_peaks_and_heap_trims_on_probe_steps_only(monkeypatch):
    cfg = load_config(None, SMALL + ["log.memory_every=3"])
    train, held = load_data(cfg)
    tr = RLTrainer(cfg, train, held)
    trims = []
    real = memory.trim_heap
    monkeypatch.setattr(memory, "trim_heap", lambda: trims.append(1) or real())
    monkeypatch.setattr("orbitrl.engine.governor.trim_heap", memory.trim_heap)
    per_step, probed = [], []
    for _ in range(7):
        before = len(trims)
        row = tr.step()
        per_step.append(len(trims) - before)
        probed.append(all(f"mem_{ph}_measured_bytes" in row for ph in ("rollout", "score", "train")))
    # steps 0, 1 and every 3rd: measured (and trimmed) phase by phase
    assert probed == [True, True, False, True, False, False, True]
    assert [n > 0 for n in per_step] == probed
    s = tr.mem.summary()
    assert s["measured_peak_bytes"] > 0 and s["measured_train_bytes"] > 0


def test_memory_every_must_be_positive():
    with pytest.raises(Exception, match="log.memory_every"):
        load_config(None, ["log.memory_every=0"])


def test_prediction_at_the_steps_shape_prices_its_own_micro_batches():
    """Each probed step is also priced by the ledger at the positions its micro-batches
    hold (``mem_train_positions``): the same terms as the a-priori prediction but the
    activations, which follow the replies the step drew, below the cap's."""
    from orbitrl.ledger.runtime import runtime_prediction

    cfg = load_config(None, SMALL[:2] + ["rollout.max_tokens=12"] + SMALL[3:])
    train, held = load_data(cfg)
    tr = RLTrainer(cfg, train, held)
    rows = [tr.step() for _ in range(2)]
    prompt_len = tr.mem.predict_at.args[3]  # the task's longest prompt, as the run took it
    for row in rows:
        pos = row["mem_train_positions"]
        assert 0 < pos <= 8 * (prompt_len + 12)  # 2 prompts x 4 samples, at most the cap
        want = runtime_prediction(cfg, tr.model.config.hf, prompt_len,
                                  kv_blocks=tr.engine.pool.num_blocks, device="cpu",
                                  workers=tr.workers.n,
                                  recompute=bool(getattr(tr.model, "recompute", False)),
                                  packed_bytes=tr.engine.packed.planned_bytes,
                                  packing_workspace=tr.engine.packed.workspace_bytes,
                                  positions=pos)
        for ph in ("rollout", "score", "train"):
            assert row[f"mem_{ph}_predicted_at_shape_bytes"] == want[ph]
        # the rollout is priced alike; scoring and training at fewer positions than the cap
        assert want["rollout"] == row["mem_rollout_predicted_bytes"]
        assert row["mem_train_predicted_at_shape_bytes"] < row["mem_train_predicted_bytes"]
    s = tr.mem.summary()
    assert s["predicted_peak_at_shape_bytes"] == max(
        r[f"mem_{ph}_predicted_at_shape_bytes"] for r in rows for ph in ("rollout", "score", "train"))
    assert s["peak_at_shape_error"] == pytest.approx(
        s["predicted_peak_at_shape_bytes"] / s["measured_peak_bytes"] - 1)
