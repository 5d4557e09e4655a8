"""Our decoder, its HF loading/saving, and its tokenizer."""

from orbitrl.model.config import ModelConfig
from orbitrl.model.decoder import Decoder
from orbitrl.model.tokenizer import load_tokenizer
from orbitrl.model.weights import load_model, save_pretrained

__all__ = ["ModelConfig", "Decoder", "load_model", "save_pretrained", "load_tokenizer"]
