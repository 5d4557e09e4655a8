"""Rollout-vs-trainer alignment: the figures on hand-made logits, `orbitrl check-alignment`
passing on every base format in fp32 compute, and failing when the weights differ."""

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from orbitrl.cli import main
from orbitrl.model.builtin import resolve_model_path
from orbitrl.observe.alignment import AlignmentBounds, compare, violations


def test_figures_on_hand_made_logits():
    e = torch.tensor([[0.0, 0.0, -1e9], [2.0, 1.0, 0.0]])
    t = torch.tensor([[math.log(3.0), 0.0, -1e9], [2.0, 1.0, 0.0]])
    m = compare(e, t, torch.tensor([-0.5, -1.0]), torch.tensor([-0.75, -1.0]), top_k=2)
    # row 0: p = [.5, .5, 0], q = [.75, .25, 0] -> L1 0.5; row 1 identical
    assert m["l1_max"] == pytest.approx(0.5) and m["l1_mean"] == pytest.approx(0.25)
    assert m["topk_agreement"] == 1.0  # top-2 sets {0, 1} both rows
    assert m["logprob_gap_max"] == pytest.approx(0.25)
    assert m["logprob_gap_mean"] == pytest.approx(0.125)
    assert m["logit_max_abs"] == pytest.approx(math.log(3.0))
    bad = violations(m, AlignmentBounds())
    assert len(bad) == 2 and "L1 max 0.5" in bad[0] and "logprob gap max 0.25" in bad[1]
    swapped = compare(torch.tensor([[3.0, 0.0, 1.0]]), torch.tensor([[0.0, 3.0, 1.0]]),
                      torch.zeros(1), torch.zeros(1), top_k=1)
    assert swapped["topk_agreement"] == 0.0 and swapped["top1_agreement"] == 0.0
    assert violations(compare(e, e, torch.zeros(2), torch.zeros(2)), AlignmentBounds()) == []


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "nf4"])
def test_check_alignment_passes_on_every_base_format(fmt, tmp_path, capsys):
    out = tmp_path / "a.json"
    assert main(["check-alignment", "--base-dtype", fmt, "--json", str(out)]) == 0
    m = json.loads(out.read_text())
    assert m["aligned"] and m["positions"] >= 8 and m["l1_max"] < 1e-3
    assert m["topk_agreement"] == 1.0 and m["logprob_gap_max"] < 1e-3
    assert "aligned" in capsys.readouterr().out


def _perturbed_copy(tmp_path):
    src = resolve_model_path("builtin:tiny-arith")
    dst = tmp_path / "perturbed"
    shutil.copytree(src, dst)
    w = load_file(dst / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    name = "model.layers.0.mlp.down_proj.weight"
    w[name] = w[name] + 0.5 * torch.randn(w[name].shape, generator=g)
    save_file(w, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("fmt", ["fp32", "nf4"])
def test_check_alignment_fails_when_the_engine_weights_differ(fmt, tmp_path, capsys):
    bad = _perturbed_copy(tmp_path)
    out = tmp_path / "a.json"
    rc = main(["check-alignment", "--base-dtype", fmt, "--engine-model", str(bad),
               "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 1, text
    assert "NOT aligned" in text and "misaligned: next-token distributions differ" in text
    assert not json.loads(out.read_text())["aligned"]


def test_bad_input_exits_2_without_traceback(tmp_path, capsys):
    assert main(["check-alignment", "--model", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "nope: model directory not found" in err and "Traceback" not in err


def test_a_merged_export_serves_what_base_plus_adapter_trains(tmp_path, capsys):
    from orbitrl.model import load_model, load_tokenizer
    from orbitrl.model.adapters import save_adapters, save_merged
    from orbitrl.model.lora import apply_lora, lora_modules

    src = resolve_model_path("builtin:tiny-arith")
    model = load_model(src)
    apply_lora(model, rank=4, alpha=8)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in lora_modules(model).values():  # B starts at zero: give the adapter an effect
            m.lora_B.weight.copy_(0.2 * torch.randn(m.lora_B.weight.shape, generator=g))
    save_adapters(model, tmp_path / "adapter")
    save_merged(model, tmp_path / "merged",
                tokenizer=load_tokenizer(src, model.config.vocab_size))
    adapter = ["--adapter", str(tmp_path / "adapter")]
    assert main(["check-alignment", *adapter, "--engine-model", str(tmp_path / "merged")]) == 0
    assert main(["check-alignment", *adapter, "--engine-model", str(src)]) == 1
    assert "NOT aligned" in capsys.readouterr().out
