"""``train.micro_batch_tokens: 0`` (auto): the ledger cuts the batch so that the saved
activations stay within the weights' bytes (at least ACTIVATION_FLOOR), shared by the
side-by-side workers; an explicit value is kept; the trainer cuts with what the ledger
priced."""

import pytest

from orbitrl.config import load_config
from orbitrl.ledger import runtime
from orbitrl.ledger.memory import activation_bytes
from orbitrl.ledger.models import from_config

# SmolLM2-135M-Instruct's shape (config.json)
SMOL = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
            num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
            max_position_embeddings=8192, tie_word_embeddings=True)


def cfg(*sets):
    return load_config(None, ["model.path=x", "model.base_dtype=fp32", "rollout.n=8",
                              "rollout.prompts_per_step=4", "rollout.max_tokens=16", *sets])


def test_a_real_model_is_cut_to_its_weights():
    c = cfg()
    t1 = runtime.micro_batch_tokens(c, SMOL, workers=1)
    t2 = runtime.micro_batch_tokens(c, SMOL, workers=2)
    shape = from_config(SMOL)
    per = activation_bytes(shape, 1, False, 1, 4, fp64_attention=True)
    weights = shape.total_params * 4  # fp32 base, fp32 everything else
    assert t1 == weights // per and t2 == weights // 2 // per  # 348 and 174 tokens
    assert 300 < t1 < 400
    pred = runtime.runtime_prediction(c, SMOL, 40, workers=2)["terms"]["train"]
    assert pred["activations:saved"] <= weights
    # explicit: kept, and the prediction prices the whole batch in one micro-batch per worker
    big = runtime.runtime_prediction(cfg("train.micro_batch_tokens=4096"), SMOL, 40,
                                     workers=2)["terms"]["train"]
    assert big["activations:saved"] > 4 * pred["activations:saved"]
    assert runtime.micro_batch_tokens(cfg("train.micro_batch_tokens=512"), SMOL) == 512


def test_small_models_keep_the_cap():
    tiny = dict(SMOL, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=97)
    assert runtime.micro_batch_tokens(cfg(), tiny, workers=2) == runtime.AUTO_MICRO_BATCH_CAP


def test_recompute_allows_more_tokens():
    c = cfg()
    assert runtime.micro_batch_tokens(c, SMOL, recompute=True) > \
        4 * runtime.micro_batch_tokens(c, SMOL)


def test_the_scorer_cuts_with_the_ledgers_choice(monkeypatch):
    """The scorer cuts with whatever the ledger answers (40 tokens here: several
    micro-batches of the built-in task's samples), and an explicit key wins."""
    from trainer_helpers import make_trainer

    monkeypatch.setattr(runtime, "auto_micro_batch_tokens",
                        lambda *a, **k: 40)  # the ledger's answer, whatever it is
    tr = make_trainer("rollout.prompts_per_step=2", "rollout.n=4", "train.workers=1",
                      "data.heldout_size=4")
    from orbitrl.rl import score as score_mod

    cuts = []
    real = score_mod.micro_batches
    monkeypatch.setattr(score_mod, "micro_batches",
                        lambda samples, n: cuts.append((n, real(samples, n))) or cuts[-1][1])
    assert tr.scorer.mb_tokens == 40
    tr.step()
    assert cuts and cuts[0][0] == 40 and len(cuts[0][1]) >= 2  # 8 samples of ~12 tokens
    explicit = make_trainer("rollout.prompts_per_step=2", "rollout.n=4", "train.workers=1",
                            "data.heldout_size=4", "train.micro_batch_tokens=4096")
    assert explicit.scorer.mb_tokens == 4096
    tr.close()
    explicit.close()


def test_full_mode_keeps_one_micro_batch_per_worker():
    """The fused update steps once per micro-batch: auto does not cut full mode finer."""
    c = cfg("train.mode=full")
    assert runtime.micro_batch_tokens(c, SMOL, workers=1) == runtime.AUTO_MICRO_BATCH_CAP
