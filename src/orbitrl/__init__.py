"""orbitrl: RL post-training (GRPO, PPO) of language models on a tenth of the memory."""

__version__ = "0.1.0"

from orbitrl import _quiet  # noqa: E402

_quiet.install()  # before anything imports torchao (see _quiet.py)


def load_model(path, dtype="float32", device="cpu", **kwargs):
    """Load an HF model directory with orbitrl's own decoder (see orbitrl.model.weights)."""
    from orbitrl.model.weights import load_model as _load  # start-up: torch-free orbitrl

    return _load(path, dtype=dtype, device=device, **kwargs)


def load_tokenizer(path, vocab_size=None):
    from orbitrl.model.tokenizer import load_tokenizer as _load  # start-up: torch-free orbitrl

    return _load(path, vocab_size=vocab_size)


def save_pretrained(model, out_dir, tokenizer=None, dtype=None):
    from orbitrl.model.weights import save_pretrained as _save  # start-up: torch-free orbitrl

    return _save(model, out_dir, tokenizer=tokenizer, dtype=dtype)
