"""Build the built-in tiny model and its character tokenizer from orbitrl's own code.

Writes src/orbitrl/builtin/tiny-arith/ (config.json, model.safetensors, tokenizer files):
a Qwen2-shaped decoder at random init. `scripts/sft_builtin.py` then warm-starts it on the
arithmetic task's format. Nothing is downloaded.

    python scripts/make_builtin_model.py [--out DIR] [--seed 0]
    python scripts/make_builtin_model.py --tokenizer-only   # rewrite the tokenizer files of
                                                            # both built-in models, weights kept
"""

from __future__ import annotations

import argparse
import string
from pathlib import Path

import torch

from orbitrl.model.config import ModelConfig
from orbitrl.model.decoder import Decoder
from orbitrl.model.tokenizer import save_tokenizer
from orbitrl.model.weights import save_pretrained

OUT = Path(__file__).resolve().parents[1] / "src" / "orbitrl" / "builtin" / "tiny-arith"
SPECIALS = ["<pad>", "<eos>", "<unk>"]
CHARS = list(string.digits + "+-*/=?., ") + list(string.ascii_lowercase) + \
    list(string.ascii_uppercase) + list("()[]:;!'\"<>#%&_\n")
# appended later (ids after the first 90 unchanged): what code needs besides the above
CODE_CHARS = list("`{}|\\~^$@\t")


def make_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS + CODE_CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    return fast


def hf_config(vocab_size: int) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "vocab_size": vocab_size, "hidden_size": 128, "intermediate_size": 384,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "rope_theta": 10000.0, "tie_word_embeddings": True, "use_sliding_window": False,
        "bos_token_id": None, "eos_token_id": 1, "pad_token_id": 0,
    }


def build(out: Path, seed: int = 0) -> Path:
    tok = make_tokenizer()
    vocab = 128  # padded past len(tok) so the embedding is a round size
    assert len(tok) <= vocab
    cfg = ModelConfig.from_hf(hf_config(vocab))
    torch.manual_seed(seed)
    model = Decoder(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
    save_pretrained(model, out, tokenizer=tok)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer-only", action="store_true",
                    help="rewrite only the tokenizer files of tiny-arith and tiny-arith-moe")
    a = ap.parse_args()
    if a.tokenizer_only:
        for d in (OUT, OUT.parent / "tiny-arith-moe"):
            save_tokenizer(make_tokenizer(), d)
            print(f"wrote the tokenizer of {d}")
    else:
        print(f"wrote {build(a.out, a.seed)}")
