"""Every example config parses, and its header names its run command."""

from pathlib import Path

import pytest

from orbitrl.config import load_config

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_parses(path):
    load_config(path)
    assert f"orbitrl train examples/{path.name}" in path.read_text()
