"""The trainer stays one sitting's read: under 250 lines, at most 20 attributes, and it names
no rollout source (rl/sources.py picks one at setup)."""

import ast
from pathlib import Path

import orbitrl.rl.trainer as T
from orbitrl.rl.sources import Colocated, OneStepOverlap
from trainer_helpers import make_trainer

SRC = Path(T.__file__)


def test_trainer_is_short_and_names_no_source():
    text = SRC.read_text()
    assert len(text.splitlines()) < 250
    names = {n.id for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Attribute)}
    for source in ("Colocated", "OneStepOverlap", "SeparatePools", "Overlap",
                   "PoolRollouts", "PoolShare", "overlap", "pool"):
        assert source not in names, source


def test_trainer_holds_at_most_20_attributes_and_the_config_picks_the_source():
    tr = make_trainer("train.max_steps=1")
    assert len(vars(tr)) <= 20, sorted(vars(tr))
    assert type(tr.source) is Colocated and tr.source.abandonable
    tr.step()
    ov = make_trainer("train.max_steps=2", "rollout.overlap=true")
    assert type(ov.source) is OneStepOverlap and not ov.source.abandonable
    assert ov.source.position() is None
    row = ov.step()
    assert "time_wait_rollout_s" in row  # the overlap's batch, waited for
    ov.close()
