"""`orbitrl generate` end to end on a tiny model with a character-level tokenizer; stop
strings through the Python API."""

import json
import string
import subprocess
import sys

import pytest

import orbitrl
from orbitrl.cli import main
from orbitrl.engine import Engine, SamplingParams

CHARS = string.printable[:96]  # 96 characters + "<eos>"


def _char_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(CHARS)}
    vocab["<eos>"] = 96
    t = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    t.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    t.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>", unk_token="<eos>")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from hf_helpers import make_hf_model

    d = tmp_path_factory.mktemp("cli_model")
    # 100 rows: AutoTokenizer picks Qwen2's class from config.json and adds a pad token
    make_hf_model("qwen2", vocab_size=100).save_pretrained(d)
    _char_tokenizer().save_pretrained(d)
    return d


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def test_cli_writes_rows_in_order(model_dir, tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [{"prompt": "12+30="}, {"prompt_ids": [5, 6, 7], "max_tokens": 3}])
    rc = main(["generate", "--model", str(model_dir), "--prompts", str(inp), "--out", str(out),
               "--n", "3", "--max-tokens", "5", "--temperature", "0.8", "--top-p", "0.9",
               "--seed", "7"])
    assert rc == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["index"], r["sample"]) for r in rows] == [(i, j) for i in (0, 1) for j in range(3)]
    for r in rows:
        assert len(r["completion_ids"]) == len(r["logprobs"]) == len(r["raw_logprobs"])
        assert r["finish_reason"] in ("stop", "length")
        assert len(r["completion_ids"]) <= (5 if r["index"] == 0 else 3)
    err = capsys.readouterr().err
    assert "tokens/s" in err and "KV blocks used" in err and "preemptions" in err
    from orbitrl.engine.packed import available

    # a CPU run packs the projections (where this torch build has oneDNN's inner product)
    assert ("weights packed for oneDNN" in err) == available()
    # same seed: same output
    out2 = tmp_path / "out2.jsonl"
    main(["generate", "--model", str(model_dir), "--prompts", str(inp), "--out", str(out2),
          "--n", "3", "--max-tokens", "5", "--temperature", "0.8", "--top-p", "0.9",
          "--seed", "7", "--no-progress"])
    assert out2.read_text() == out.read_text()


def test_cli_greedy_matches_api(model_dir, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [{"prompt": "hello"}])
    assert main(["generate", "--model", str(model_dir), "--prompts", str(inp), "--out",
                 str(out), "--temperature", "0", "--max-tokens", "6", "--no-progress"]) == 0
    row = json.loads(out.read_text())
    eng = Engine(orbitrl.load_model(model_dir), _char_tokenizer(), kv_budget_bytes=1 << 20)
    s = eng.generate(["hello"], SamplingParams(max_tokens=6, temperature=0))[0].samples[0]
    assert row["completion_ids"] == s.token_ids and row["completion"] == s.text


def test_cli_bad_rows(model_dir, tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [{"prompt": "ok"}, {"prompt": ""}, "{not json", {"prompt_ids": [1], "max_tokens": 0},
                 {"prompt": "x" * 200}, {"foo": 1}, {"prompt_ids": [3, 4]}])
    rc = main(["generate", "--model", str(model_dir), "--prompts", str(inp), "--out", str(out),
               "--max-tokens", "2", "--no-progress"])
    assert rc == 1
    err = [x for x in capsys.readouterr().err.splitlines() if ": error: " in x]
    assert [x.split(":")[2] for x in err] == ["2", "3", "4", "5", "6"]
    assert {json.loads(x)["index"] for x in out.read_text().splitlines()} == {0, 6}
    # nothing valid: exit 2, one line
    _write(inp, [{"prompt": ""}])
    assert main(["generate", "--model", str(model_dir), "--prompts", str(inp), "--out",
                 str(tmp_path / "none.jsonl"), "--no-progress"]) == 2


def test_stop_strings(model_dir):
    tok = _char_tokenizer()
    eng = Engine(orbitrl.load_model(model_dir), tok, kv_budget_bytes=1 << 20)
    full = eng.generate(["abc"], SamplingParams(max_tokens=12, temperature=0,
                                                ignore_eos=True))[0].samples[0]
    stop = full.text[3:5]
    cut = full.text.index(stop)
    s = eng.generate(["abc"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                             stop=[stop]))[0].samples[0]
    assert s.finish_reason == "stop" and s.text == full.text[:cut]
    assert s.token_ids == full.token_ids[:cut + len(stop)]


def test_cli_packed_budget(model_dir, tmp_path, capsys, monkeypatch):
    """--packed-mb 0 (MKL's GEMMs) writes the same greedy rows as the default (oneDNN over
    packed copies); a negative budget is a one-line error. The head is re-laid out
    column-major (for MKL) only when it is not packed."""
    from orbitrl.model import hf_fallback

    loaded = []
    load = hf_fallback.load_any_model
    monkeypatch.setattr(hf_fallback, "load_any_model",
                        lambda *a, **k: loaded.append(load(*a, **k)) or loaded[-1])
    inp = tmp_path / "in.jsonl"
    _write(inp, [{"prompt": "hello"}, {"prompt": "12+30="}])
    outs = []
    for mb in ("512", "0"):
        out = tmp_path / f"out{mb}.jsonl"
        assert main(["generate", "--model", str(model_dir), "--prompts", str(inp), "--out",
                     str(out), "--temperature", "0", "--max-tokens", "6", "--no-progress",
                     "--packed-mb", mb]) == 0
        outs.append([json.loads(x)["completion_ids"] for x in out.read_text().splitlines()])
    assert outs[0] == outs[1]
    assert [m.lm_head.weight.is_contiguous() for m in loaded] == [True, False]
    capsys.readouterr()
    assert main(["generate", "--model", str(model_dir), "--prompts", str(inp), "--out",
                 str(tmp_path / "bad.jsonl"), "--packed-mb", "-1"]) == 2
    assert "--packed-mb -1: must be 0 or more" in capsys.readouterr().err
    assert not (tmp_path / "bad.jsonl").exists()


def test_the_kv_pool_is_sized_to_the_job(model_dir, tmp_path, capsys):
    """Without --kv-budget-mb the pool holds every sample's prompt and cap (whole blocks,
    one more each for a shared prompt's copy on write), not the engine's default for any
    job (on a CPU its pages are all touched); --kv-budget-mb still wins."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [{"prompt_ids": [5] * 20}, {"prompt_ids": [6] * 3, "max_tokens": 40}])
    assert main(["generate", "--model", str(model_dir), "--prompts", str(inp), "--out",
                 str(out), "--n", "4", "--max-tokens", "12", "--no-progress"]) == 0
    # 4 x (ceil(32 / 16) + 1) + 4 x (ceil(43 / 16) + 1) = 12 + 16 blocks
    assert "KV blocks used" in (err := capsys.readouterr().err) and "/28 " in err
    assert main(["generate", "--model", str(model_dir), "--prompts", str(inp), "--out",
                 str(out), "--n", "4", "--max-tokens", "12", "--no-progress",
                 "--kv-budget-mb", "1"]) == 0
    assert "/28 " not in capsys.readouterr().err


def test_the_console_entry_leaves_at_once_with_the_status_and_the_rows(tmp_path):
    """`orbitrl generate` leaves through os._exit once its output is written (cli.entry,
    LEAVE_AT_ONCE): the status of a partial failure, the good rows and both lines printed."""
    (tmp_path / "in.jsonl").write_text('{"prompt": "12+34="}\n{"prompt": ""}\n')
    out = tmp_path / "out.jsonl"
    res = subprocess.run([sys.executable, "-m", "orbitrl", "generate", "--model",
                          "builtin:tiny-arith", "--prompts", str(tmp_path / "in.jsonl"),
                          "--out", str(out), "--n", "2", "--max-tokens", "3",
                          "--no-progress"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 1, res.stderr[-2000:]
    assert len(out.read_text().splitlines()) == 2  # the first prompt's two samples
    err = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert err[0].startswith("orbitrl generate: ") and "in.jsonl:2: error" in err[0]
    assert err[-1].startswith("generated ")
