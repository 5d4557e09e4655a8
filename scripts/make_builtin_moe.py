"""Build the built-in tiny mixture of experts from the built-in dense model, by upcycling.

Writes src/orbitrl/builtin/tiny-arith-moe/: a Qwen2-MoE-shaped decoder (4 routed experts,
top-2 with normalised weights, one shared expert behind its sigmoid gate) whose attention,
norms and embeddings are tiny-arith's (the SFT warm start of scripts/sft_builtin.py). Each
dense MLP of 384 neurons is split: neurons 0-191 become the shared expert (its down
projection doubled, its gate at zero: sigmoid(0) = 1/2), neurons 192-383 are copied into
every routed expert, each copy perturbed by Gaussian noise of ``--noise`` times the weight's
standard deviation; routers start random. With zero noise the upcycled model computes the
dense one exactly (the routed weights sum to one); the noise makes the experts, and so the
routing, matter. Nothing is downloaded.

    python scripts/make_builtin_moe.py [--noise 0.6] [--seed 0] [--out DIR]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

import orbitrl
from orbitrl.model.config import ModelConfig
from orbitrl.model.decoder import Decoder
from orbitrl.model.weights import save_pretrained

BUILTIN = Path(__file__).resolve().parents[1] / "src" / "orbitrl" / "builtin"
DENSE, OUT = BUILTIN / "tiny-arith", BUILTIN / "tiny-arith-moe"
FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def moe_config(dense: dict, experts: int, top_k: int) -> dict:
    """The dense config.json turned into a Qwen2-MoE one (half the MLP shared, half routed)."""
    half = dense["intermediate_size"] // 2
    hf = {k: v for k, v in dense.items() if k not in ("dtype", "torch_dtype")}
    hf.update(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
              num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=half,
              shared_expert_intermediate_size=half, norm_topk_prob=True,
              decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=True,
              router_aux_loss_coef=0.001)
    return hf


def upcycle(dense, cfg: ModelConfig, noise: float, seed: int) -> Decoder:
    """A mixture initialised from ``dense`` (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    moe = Decoder(cfg)
    sd = dense.state_dict()
    half = cfg.moe.expert_intermediate
    with torch.no_grad():
        for name, p in moe.named_parameters():
            if name in sd:
                p.copy_(sd[name])
        for i, layer in enumerate(moe.model.layers):
            src = {n: sd[f"model.layers.{i}.mlp.{n}.weight"]
                   for n in ("gate_proj", "up_proj", "down_proj")}
            block = layer.mlp
            sh = block.shared_expert
            sh.gate_proj.weight.copy_(src["gate_proj"][:half])
            sh.up_proj.weight.copy_(src["up_proj"][:half])
            sh.down_proj.weight.copy_(2 * src["down_proj"][:, :half])
            block.shared_expert_gate.weight.zero_()
            block.gate.weight.normal_(0.0, 0.02, generator=g)
            for ex in block.experts:
                for n, w in (("gate_proj", src["gate_proj"][half:]),
                             ("up_proj", src["up_proj"][half:]),
                             ("down_proj", src["down_proj"][:, half:])):
                    jitter = torch.randn(w.shape, generator=g) * (noise * float(w.std()))
                    getattr(ex, n).weight.copy_(w + jitter)
    return moe.eval()


def build(out: Path = OUT, noise: float = 0.6, seed: int = 0, experts: int = 4,
          top_k: int = 2) -> Path:
    import json

    dense = orbitrl.load_model(DENSE)
    hf = moe_config(json.loads((DENSE / "config.json").read_text()), experts, top_k)
    model = upcycle(dense, ModelConfig.from_hf(hf), noise, seed)
    out.mkdir(parents=True, exist_ok=True)
    save_pretrained(model, out)
    for f in FILES:
        shutil.copy(DENSE / f, out / f)
    (out / "orbitrl.yaml").write_text(
        "# Run settings for the built-in tiny mixture (orbitrl.config.builtin_run_settings);\n"
        "# its dense parent's learning rate (scripts/sweep_rl_lr.py).\n"
        "train:\n  lr: 1.0e-3\n")
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--noise", type=float, default=0.6)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(f"wrote {build(a.out, a.noise, a.seed)}")
