"""Config: YAML + --set overrides, one-line errors naming the key."""

import pytest

from orbitrl.cli import main
from orbitrl.config import load_config
from orbitrl.errors import OrbitError


def test_defaults_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  lr: 1e-4\n  mode: full\nrollout:\n  n: 4\n")
    cfg = load_config(f, ["rollout.n=2", "lora.targets=[q_proj,v_proj]"])
    assert cfg.train.lr == 1e-4 and cfg.train.mode == "full"
    assert cfg.rollout.n == 2 and cfg.lora.targets == ["q_proj", "v_proj"]
    assert cfg.algo.clip_low == 0.1 and cfg.algo.kl_coef == 0.01 and cfg.train.max_grad_norm == 0.3


@pytest.mark.parametrize("override,needle", [
    ("train.lrr=1", "'train.lrr'"),
    ("train.lr=abc", "'train.lr'"),
    ("train.mode=sideways", "'train.mode'"),
    ("rollout.n=2.5", "'rollout.n'"),
    ("nosuch.key=1", "'nosuch'"),
    ("novalue", "KEY=VALUE"),
    ("algo.kl_horizon=0", "'algo.kl_horizon'"),
    ("algo.dual_clip=1", "'algo.dual_clip'"),
    ("algo.dual_clip=0.5", "'algo.dual_clip'"),
    ("algo.entropy_coef=-0.01", "'algo.entropy_coef'"),
    ("algo.mismatch=is", "'algo.mismatch'"),
    ("algo.tis_cap=0", "'algo.tis_cap'"),
])
def test_bad_override(override, needle):
    with pytest.raises(OrbitError) as e:
        load_config(None, [override])
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_learning_rate_default_is_safe_and_the_builtin_model_tunes_its_own(tmp_path):
    """1e-4 for any model; the shipped model's orbitrl.yaml raises it to 1e-3 under the
    user's settings, which still win (file and --set)."""
    assert load_config(None, ["model.path=/some/model"]).train.lr == 1e-4
    assert load_config(None).train.lr == 1e-3
    assert load_config(None, ["train.lr=3e-5"]).train.lr == 3e-5
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  path: /some/model\n")
    assert load_config(f).train.lr == 1e-4
    f.write_text("train:\n  lr: 2.0e-4\n")
    assert load_config(f).train.lr == 2e-4
    # a later layer naming another model drops the built-in model's settings
    f.write_text("model:\n  path: builtin:tiny-arith\n")
    assert load_config(f, ["model.path=/some/model"]).train.lr == 1e-4


def test_unknown_key_in_file_names_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  bogus: 1\n")
    with pytest.raises(OrbitError) as e:
        load_config(f)
    assert "train.bogus" in str(e.value) and str(f) in str(e.value)


def test_cli_not_yaml_is_one_line_error(tmp_path, capsys):
    f = tmp_path / "c.yaml"
    f.write_text("train: [unclosed\n  : :")
    assert main(["train", str(f)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not valid YAML" in err and "Traceback" not in err


def test_config_doc_is_current():
    """docs/config.md is regenerated whenever a key changes (scripts/gen_config_docs.py)."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("gen", root / "scripts" / "gen_config_docs.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (root / "docs" / "config.md").read_text() == gen.render(), \
        "docs/config.md is stale: run python scripts/gen_config_docs.py"
