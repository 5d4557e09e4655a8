"""The one evaluation path (rl/evaluate.py Evaluator): prompt encoding, context fitting,
n samples per prompt through the engine; the suite (evals/run.py) goes through it."""

import json

import pytest

from orbitrl.engine import Engine, SamplingParams
from orbitrl.errors import OrbitError
from orbitrl.model import load_model, load_tokenizer
from orbitrl.model.builtin import resolve_model_path
from orbitrl.model.tokenizer import encode_prompt
from orbitrl.rl.evaluate import Evaluator


@pytest.fixture(scope="module")
def tiny():
    path = resolve_model_path("builtin:tiny-arith")
    model = load_model(path)
    return model, load_tokenizer(path, model.config.vocab_size)


def test_encode_prompts_is_the_training_encoding_and_cuts_from_the_left(tiny, capsys):
    model, tok = tiny
    texts = ["12+7=", "3+4=" * 20]
    for chat in (False, True):
        ev = Evaluator(Engine(model, tok), lambda t: encode_prompt(tok, t, chat), None, 8)
        assert ev.encode_prompts(texts) == [encode_prompt(tok, t, chat) for t in texts]
    ev = Evaluator(Engine(model, tok), lambda t: encode_prompt(tok, t), None, 8, context=64)
    ids = ev.encode_prompts(texts)
    full = encode_prompt(tok, texts[1])
    assert len(full) > 56 and ids == [encode_prompt(tok, texts[0]), full[-56:]]
    assert ev.truncated == 1
    assert "1 of 2 prompts cut from the left to 56" in capsys.readouterr().err
    with pytest.raises(OrbitError, match="--max-tokens 64: the model's context is 64"):
        Evaluator(None, lambda t: [1], None, 64, context=64).encode_prompts(["x"])


def test_complete_draws_n_per_request_and_the_engine_is_built_once_sized(tiny):
    model, tok = tiny
    built = []

    def factory(longest):
        built.append(longest)
        return Engine(model, tok)

    ev = Evaluator(factory, lambda t: encode_prompt(tok, t), None, 6)
    prompts = ev.encode_prompts(["12+7=", "30+4="])
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=6)
    sampled = SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=5)
    texts = ev.complete(prompts, [greedy, sampled])
    assert [len(t) for t in texts] == [1, 3] and built == [max(map(len, prompts)) + 6 + 16]
    again = ev.complete(prompts, [greedy, sampled])
    assert again == texts and len(built) == 1  # seeded: the same samples; one engine
    ref = Engine(model, tok).generate([prompts[0]], greedy)[0].samples[0].text
    assert texts[0][0] == ref


def _suite(tiny, batch):
    from orbitrl.evals.run import EvalOptions, evaluate
    from orbitrl.evals.tasks import gsm8k_task

    model, tok = tiny
    chunks = []
    res = evaluate(gsm8k_task(limit=7), model, tok,
                   EvalOptions(n=2, k=(1, 2), max_tokens=6, batch=batch),
                   on_chunk=lambda r: chunks.append(json.loads(json.dumps(r))))
    return res, chunks


def test_the_suite_generates_through_the_evaluator_in_chunks(tiny, monkeypatch):
    calls = []
    complete = Evaluator.complete

    def spy(self, prompts, params, progress=False, label=""):
        calls.append([p.n for p in params])
        return complete(self, prompts, params, progress, label)

    monkeypatch.setattr(Evaluator, "complete", spy)
    whole, one = _suite(tiny, 64)
    assert calls == [[1, 2] * 7] and len(one) == 1  # greedy + samples of 7 problems at once
    calls.clear()
    parts, chunks = _suite(tiny, 2)  # ceil(2 * 2 / 3) = 2 problems a chunk
    assert calls == [[1, 2] * 2] * 3 + [[1, 2]]
    assert [c["problems_done"] for c in chunks] == [2, 4, 6, 7]
    assert [len(c["rows"]) for c in chunks] == [2, 4, 6, 7]
    first = chunks[0]["rows"]
    assert chunks[0]["greedy"]["passed"] == sum(r["greedy"]["passed"] for r in first)
    # seeded per problem and per sequence: chunking changes no completion
    assert parts["rows"] == whole["rows"] and parts["greedy"] == whole["greedy"]
    assert parts["sampled"] == whole["sampled"] and whole["problems_done"] == 7
