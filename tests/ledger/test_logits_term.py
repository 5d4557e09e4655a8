"""The ledger's logits term prices the chunked logprob's tiles (train/logprobs.py), never
the [tokens, vocabulary] logits it does not hold."""

from orbitrl.ledger.memory import LOGIT_VOCAB_CHUNK, Workload, logits_bytes
from orbitrl.ledger.models import from_config
from orbitrl.train import logprobs

SMOL = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
            num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
            tie_word_embeddings=True)


def test_the_tile_is_the_one_the_trainer_uses():
    assert LOGIT_VOCAB_CHUNK == logprobs.VOCAB_CHUNK
    assert Workload().logit_chunk == logprobs.TOKEN_CHUNK


def test_tiles_not_the_whole_vocabulary():
    shape = from_config(SMOL)
    tile = 1024 * 8192 * 4
    assert logits_bytes(shape, 2016, 1024, grad=False) == tile  # 32 MiB, not 2016 x 49152
    assert logits_bytes(shape, 2016, 1024, grad=True) == 2 * tile
    assert logits_bytes(shape, 100, 1024, grad=False) == 100 * 8192 * 4
    small = from_config(dict(SMOL, vocab_size=1000))
    assert logits_bytes(small, 100, 1024, grad=True) == 2 * 100 * 1000 * 4
