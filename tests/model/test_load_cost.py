"""What loading a model costs besides its bytes: the meta-device skeleton is built without
running weight initialisers (weights.empty_modules), which on the meta device would import
torch's compiler stack (about a second of every command's start-up)."""

from __future__ import annotations

import subprocess
import sys

import torch.nn as nn

from orbitrl.model.weights import empty_modules

LOAD = """
import sys
import orbitrl
from orbitrl.engine import Engine, SamplingParams
from orbitrl.model.builtin import resolve_model_path

model = orbitrl.load_model(resolve_model_path("builtin:tiny-arith"))
Engine(model, kv_budget_bytes=8 << 20).generate([[1, 2, 3]], SamplingParams(max_tokens=2))
print(sorted(m for m in ("torch._dynamo", "triton") if m in sys.modules))
"""


def test_load_and_generate_import_no_compiler():
    r = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_empty_modules_restores_the_initialisers():
    before = nn.init.normal_
    with empty_modules():
        assert nn.init.normal_ is not before
        lin = nn.Linear(4, 3)
    assert nn.init.normal_ is before and lin.weight.is_meta
    try:
        with empty_modules():
            raise RuntimeError("a failed build")
    except RuntimeError:
        pass
    assert nn.init.normal_ is before
