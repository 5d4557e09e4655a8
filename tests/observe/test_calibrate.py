"""``observe.calibrate.host_cost``: per-op host costs from the toy runs' op counts and
timings (the runs themselves stubbed here: tests/commands/test_plan.py runs them)."""

import pytest

from orbitrl.observe import calibrate

# ops per phase at 1 and 2 layers: 40 fixed + 10 per layer
OPS = {1: 50, 2: 60}


def _stub(monkeypatch, seconds):
    """``seconds``: layers -> every phase's median seconds."""
    monkeypatch.setattr(calibrate, "_toy", lambda path, layers: layers)

    def run(layers, out, settings, count, steps):
        if count:
            return [{f"ops_{ph}": OPS[layers] for ph in calibrate.PHASES}]
        return [{}] + [{f"time_{ph}_s": seconds[layers] for ph in calibrate.PHASES}] * steps

    monkeypatch.setattr(calibrate, "_run", run)


def test_fixed_and_per_layer_costs_from_a_linear_fit(monkeypatch):
    # 40 fixed ops at 2 us, 10 per layer at 5 us: 80 + 50 L us
    _stub(monkeypatch, {d: (80 + 50 * d) * 1e-6 for d in (1, 2, 4, 8)})
    cost = calibrate.host_cost("adapter", "fp32", False, steps=2)
    for ph in calibrate.PHASES:
        assert getattr(cost, f"{ph}_fixed") == pytest.approx(2.0)
        assert getattr(cost, f"{ph}_layer") == pytest.approx(5.0)


@pytest.mark.parametrize("seconds", [
    {1: 300e-6, 2: 200e-6, 4: 210e-6, 8: 250e-6},  # a loaded first run: negative slope
    {1: 10e-6, 2: 200e-6, 4: 600e-6, 8: 1400e-6},  # steeper than the ops: negative intercept
])
def test_noise_that_breaks_the_split_gives_one_positive_cost_per_op(monkeypatch, seconds):
    """A fit with a negative per-layer or fixed time (timings on a loaded machine) cannot
    split the cost: every op gets the phases' mean seconds over their mean ops, never 0."""
    _stub(monkeypatch, seconds)
    cost = calibrate.host_cost("adapter", "fp32", False, steps=2)
    mean_s = sum(seconds.values()) / 4
    mean_ops = 40 + 10 * (1 + 2 + 4 + 8) / 4
    for ph in calibrate.PHASES:
        assert getattr(cost, f"{ph}_fixed") == getattr(cost, f"{ph}_layer") == \
            pytest.approx(mean_s / mean_ops * 1e6)
