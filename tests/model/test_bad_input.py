"""Bad model directories give one-line errors naming the file and the problem."""

import json
import shutil

import pytest

import orbitrl
from orbitrl.errors import OrbitError
from orbitrl.model.tokenizer import load_tokenizer


def _copy(hf_dirs, tmp_path, fam="llama"):
    src, _ = hf_dirs[fam]
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    return dst


def _err(fn, *a, **k) -> str:
    with pytest.raises(OrbitError) as e:
        fn(*a, **k)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_unsupported_architecture(hf_dirs, tmp_path):
    d = _copy(hf_dirs, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "gpt2", ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    msg = _err(orbitrl.load_model, d)
    assert "config.json" in msg and "GPT2LMHeadModel" in msg


def test_truncated_shard(hf_dirs, tmp_path):
    d = _copy(hf_dirs, tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    msg = _err(orbitrl.load_model, d)
    assert "model.safetensors" in msg and "truncated" in msg


def test_missing_shard(hf_dirs, tmp_path):
    src, _ = hf_dirs["llama"]
    m = orbitrl.load_model(src)
    orbitrl.model.weights.save_pretrained(m, tmp_path / "s", max_shard_bytes=20_000)
    shard = sorted((tmp_path / "s").glob("model-0*.safetensors"))[1]
    shard.unlink()
    msg = _err(orbitrl.load_model, tmp_path / "s")
    assert shard.name in msg and "missing" in msg


def test_wrong_shape(hf_dirs, tmp_path):
    d = _copy(hf_dirs, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 80
    (d / "config.json").write_text(json.dumps(cfg))
    msg = _err(orbitrl.load_model, d)
    assert "mlp" in msg and "shape" in msg


def test_missing_config(tmp_path):
    assert "config.json" in _err(orbitrl.load_model, tmp_path)


def test_tokenizer_larger_than_embedding(hf_dirs, tmp_path):
    from orbitrl.model.builtin import resolve_model_path

    tok_dir = resolve_model_path("builtin:tiny-arith")
    msg = _err(load_tokenizer, tok_dir, vocab_size=50)
    assert "tokenizer has" in msg and "50" in msg
