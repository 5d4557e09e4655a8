"""Hugging Face Hub ids as ``model.path`` / ``--model``: resolved from a local cache built
here (no network: HF_HUB_OFFLINE), by revision, and a one-line error naming the id."""

import json
import shutil

import pytest

from orbitrl.cli import main
from orbitrl.errors import OrbitError
from orbitrl.model.builtin import resolve_model_path
from orbitrl.model.hub import parse_hub_id

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A hub cache holding the built-in model as ``orbit-test/tiny`` (main and tag v1 at one
    commit, a second commit with a marker file), the layout huggingface_hub writes."""
    cache = tmp_path / "hub"
    repo = cache / "models--orbit-test--tiny"
    builtin = resolve_model_path("builtin:tiny-arith")
    for commit in (COMMIT, OTHER):
        shutil.copytree(builtin, repo / "snapshots" / commit)
    (repo / "snapshots" / OTHER / "marker.txt").write_text("other")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "refs" / "v1").write_text(OTHER)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return repo


def test_parse_hub_id():
    assert parse_hub_id("Qwen/Qwen2.5-0.5B-Instruct") == ("Qwen/Qwen2.5-0.5B-Instruct", None)
    assert parse_hub_id("org/name@v1.0") == ("org/name", "v1.0")
    assert parse_hub_id("builtin:tiny-arith") is None
    assert parse_hub_id("justaname") is None and parse_hub_id("a/b/c") is None


def test_hub_id_resolves_from_the_cache_by_revision(hub_cache):
    assert resolve_model_path("orbit-test/tiny") == hub_cache / "snapshots" / COMMIT
    assert resolve_model_path("orbit-test/tiny@v1") == hub_cache / "snapshots" / OTHER
    assert resolve_model_path("orbit-test/tiny", "v1") == hub_cache / "snapshots" / OTHER
    assert resolve_model_path(f"orbit-test/tiny@{OTHER}") == hub_cache / "snapshots" / OTHER


def test_missing_hub_id_is_one_line_naming_it(hub_cache):
    with pytest.raises(OrbitError) as e:
        resolve_model_path("orbit-test/absent")
    msg = str(e.value)
    assert "'orbit-test/absent'" in msg and "HF_HUB_OFFLINE" in msg and "\n" not in msg
    assert msg.startswith("orbit-test/absent: no such model directory")
    with pytest.raises(OrbitError, match="'orbit-test/tiny@v9'"):
        resolve_model_path("orbit-test/tiny@v9")


def test_an_existing_directory_wins_over_a_hub_id(hub_cache, tmp_path, monkeypatch):
    local = tmp_path / "orbit-test" / "tiny"
    shutil.copytree(resolve_model_path("builtin:tiny-arith"), local)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("orbit-test/tiny").resolve() == local.resolve()


def test_train_and_cli_take_a_hub_id(hub_cache, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--set", "model.path=orbit-test/tiny", "--set", "train.max_steps=1",
                 "--set", "rollout.prompts_per_step=2", "--set", "rollout.n=2",
                 "--set", "data.heldout_size=2", "--set", "log.progress=false",
                 "--set", "checkpoint.every=0", "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 1
    # the run pins the commit main pointed at: a resume reads it after main moves
    import yaml

    assert yaml.safe_load((out / "config.yaml").read_text())["model"]["revision"] == COMMIT
    (hub_cache / "refs" / "main").write_text(OTHER)
    assert main(["train", "--resume", str(out), "--set", "train.max_steps=2"]) == 0
    assert yaml.safe_load((out / "config.yaml").read_text())["model"]["revision"] == COMMIT
    assert main(["train", "--set", "model.path=orbit-test/absent", "--out",
                 str(tmp_path / "bad")]) != 0
    assert "'orbit-test/absent'" in capsys.readouterr().err


def test_a_snapshot_fetched_with_model_patterns_reads_as_cached(hub_cache):
    """huggingface_hub records a repository's whole file list beside a snapshot; one
    fetched with only the model's files (no README.md) still resolves offline."""
    from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache

    snap = hub_cache / "snapshots" / COMMIT
    files = {f.name: TreeCacheEntry(size=f.stat().st_size, blob_id=f"{i:040x}")
             for i, f in enumerate(sorted(snap.iterdir()))}
    files["README.md"] = TreeCacheEntry(size=10, blob_id="f" * 40)  # never fetched
    write_tree_cache(str(hub_cache), COMMIT, files)
    assert resolve_model_path("orbit-test/tiny") == snap


def test_a_relative_path_under_an_existing_folder_is_never_a_hub_id(hub_cache, tmp_path,
                                                                      monkeypatch):
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE")  # a Hub lookup would try the network
    with pytest.raises(OrbitError, match="runs/out: model directory not found"):
        resolve_model_path("runs/out")
