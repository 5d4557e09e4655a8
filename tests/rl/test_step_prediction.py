"""The planner's step time against the measured one (observe/schedule.py StepPredictor): each
step's ``time_step_predicted_s`` comes from the medians of the rates measured over the
previous steps and this step's completion lengths, so on a steady run it should land close
to the step's own ``time_step_s``. Compared through medians over many steps, never against
a wall-clock time: a shared machine slows single steps (and steps 0 and 1, and every
``log.memory_every``-th, also probe memory), which moves single errors, not the medians."""

import statistics

from trainer_helpers import make_trainer

STEPS = 20
# Measured on the 2-core development machine (this test's run, 16-20 steps): the median
# relative error over steps 1.. was 7-10% idle, 12-20% with other processes taking both
# cores, 28% once when that load changed mid-run (the medians of the earlier steps' rates
# lag a change of machine speed); the ratio of the median prediction to the median
# measured time 1.00-1.01 idle, 0.95-1.26 loaded. Single steps: within +-15% after the
# first few idle (steps 1-3 over by 15-50%: their medians still hold step 0's warm-up), up
# to +150% loaded. 30% holds every run seen.
BOUND = 0.3


def test_predicted_step_time_tracks_the_measured_one():
    tr = make_trainer("train.workers=1", "data.heldout_size=8", "model.base_dtype=int8")
    try:
        rows = [tr.step() for _ in range(STEPS)]
    finally:
        tr.close()
    assert all(r["time_step_predicted_s"] > 0 and r["time_step_s"] > 0 for r in rows)
    later = rows[1:]  # step 0 predicts from its own rates: not a prediction
    pred = [r["time_step_predicted_s"] for r in later]
    meas = [r["time_step_s"] for r in later]
    errors = [abs(p - m) / m for p, m in zip(pred, meas)]
    assert statistics.median(errors) < BOUND, errors
    ratio = statistics.median(pred) / statistics.median(meas)
    assert 1 - BOUND < ratio < 1 + BOUND, (ratio, pred, meas)
