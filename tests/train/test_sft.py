"""Supervised warm-up: the padded batch's loss is each answer token's NLL, as computed
one sequence at a time."""

import torch
import torch.nn.functional as F

import orbitrl
from orbitrl.model.builtin import resolve_model_path
from orbitrl.train.sft import encode_pairs, sft_loss


def test_padded_batch_loss_matches_one_sequence_at_a_time():
    path = resolve_model_path("builtin:tiny-arith")
    model = orbitrl.load_model(path)
    tok = orbitrl.load_tokenizer(path, model.config.vocab_size)
    rows = [{"prompt": "347*58=", "answer": "[347*58]"},
            {"prompt": "347*58=[347*58](20126)", "answer": "20126"},
            {"prompt": "1+2=", "answer": "3"}]
    batch = encode_pairs(tok, rows)
    nll, count = 0.0, 0
    with torch.no_grad():
        for p, a in batch:
            logits = model(torch.tensor([p + a]))[0]  # [T, V]
            nll += F.cross_entropy(logits[len(p) - 1:len(p) - 1 + len(a)], torch.tensor(a),
                                   reduction="sum").item()
            count += len(a)
        got = sft_loss(model, batch).item()
    assert abs(got - nll / count) < 1e-5
