"""Adapter files: peft loads ours and we load peft's, with the same logits; merged export loads
in transformers; bad adapter files give one-line errors naming the file and key."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import orbitrl
from orbitrl.errors import OrbitError
from orbitrl.model.adapters import load_adapters, save_adapters, save_merged
from orbitrl.model.lora import adapter_parameters, adapters_disabled, apply_lora


def _train(model, steps=3, seed=0):
    """A few plain AdamW steps on a toy loss (push logits towards token 7)."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(adapter_parameters(model), lr=1e-2)
    model.train()
    for _ in range(steps):
        ids = torch.randint(0, 97, (2, 8), generator=g)
        loss = -torch.log_softmax(model(ids), -1)[..., 7].mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def _peft_logits(base_dir, adapter_dir, ids):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    pm = PeftModel.from_pretrained(hf, adapter_dir).eval()
    with torch.no_grad():
        return pm(ids).logits


IDS = torch.randint(0, 97, (3, 10), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("family,targets", [
    ("llama", "all-linear"),
    ("qwen2", ["q_proj", "v_proj"]),  # tied embeddings, qkv bias
    ("qwen3", r"re:model\.layers\.1\.(self_attn\.o_proj|mlp\.up_proj)"),  # q/k norm, subset
    ("smollm3", "all-linear"),  # a NoPE layer
    ("olmo2", "all-linear"),  # post-norm, whole-projection q/k norm
    ("phi3", "all-linear"),  # fused qkv_proj / gate_up_proj: one LoRA pair each, as peft
    ("phi3", ["qkv_proj", "down_proj"]),
    ("gemma2", "all-linear"),  # (1+w) sandwich norms, soft-capping, scaled embeddings
    ("gemma3_text", ["q_proj", "k_proj", "down_proj"]),  # per-head q/k norms, two rotaries
    # mixtures whose gate/up/down names peft moves onto the routed experts: the dense and
    # shared-expert linears go in as target_parameters (adapters.py peft_split)
    ("deepseek_v3", "all-linear"),
    ("qwen2_moe", "all-linear"),
])
def test_peft_loads_our_adapters(hf_dirs, tmp_path, family, targets):
    path, ref = hf_dirs[family]
    model = orbitrl.load_model(path)
    apply_lora(model, rank=4, alpha=8, dropout=0.1, targets=targets)
    _train(model)
    with torch.no_grad():
        ours = model(IDS)
        assert (ours - ref(IDS).logits).abs().max() > 1e-3  # the adapters really moved it
    save_adapters(model, tmp_path / "ad", base_model_name_or_path=str(path))
    theirs = _peft_logits(path, tmp_path / "ad", IDS)
    assert (ours - theirs).abs().max().item() < 1e-5
    # and back into a fresh orbitrl model
    again = orbitrl.load_model(path)
    load_adapters(again, tmp_path / "ad")
    with torch.no_grad():
        assert torch.equal(again(IDS), ours)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "nf4", "int4"])
def test_quantized_base_adapters_in_peft_and_merged_export(hf_dirs, tmp_path, fmt):
    """peft over the dequantized base equals orbitrl's LoRA over the stored format, and the
    merged export (dequantized base + B @ A * scale) loads in transformers with our logits."""
    from transformers import AutoModelForCausalLM

    path, _ = hf_dirs["llama_bias"]
    model = orbitrl.load_model(path, base_format=fmt)
    apply_lora(model, rank=4, alpha=8)
    _train(model)
    with torch.no_grad():
        ours = model(IDS)
    save_adapters(model, tmp_path / "ad")
    with adapters_disabled(model):
        save_merged(model, tmp_path / "base")  # the dequantized base alone
    assert (ours - _peft_logits(tmp_path / "base", tmp_path / "ad", IDS)).abs().max() < 1e-5
    save_merged(model, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        assert (merged.eval()(IDS).logits - ours).abs().max().item() < 1e-5


@pytest.mark.parametrize("family,targets", [("mistral", ["k_proj", "down_proj"]),
                                             ("phi3", ["qkv_proj", "gate_up_proj"])])
def test_we_load_peft_adapters(hf_dirs, tmp_path, family, targets):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path, _ = hf_dirs[family]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    pm = get_peft_model(hf, LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        want = pm.eval()(IDS).logits
    pm.save_pretrained(tmp_path / "peft")
    model = orbitrl.load_model(path, base_format="fp32")
    names = load_adapters(model, tmp_path / "peft")
    assert len(names) == 4
    with torch.no_grad():
        assert (model(IDS) - want).abs().max().item() < 1e-5


# ---- bad files ------------------------------------------------------------------------------

@pytest.fixture
def saved(hf_dirs, tmp_path):
    path, _ = hf_dirs["llama"]
    model = orbitrl.load_model(path)
    apply_lora(model, rank=4, alpha=8, targets=["q_proj", "v_proj"])
    _train(model, steps=1)
    d = save_adapters(model, tmp_path / "ad")
    return path, d


def _edit_config(d, **kv):
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg.update(kv)
    (d / "adapter_config.json").write_text(json.dumps(cfg))


def _edit_tensors(d, fn):
    f = d / "adapter_model.safetensors"
    t = load_file(f)
    fn(t)
    save_file(t, f)


def _load_err(path, d, model=None) -> str:
    model = model if model is not None else orbitrl.load_model(path)
    before = {n for n, _ in model.named_modules()}
    with pytest.raises(OrbitError) as e:
        load_adapters(model, d)
    msg = str(e.value)
    assert "\n" not in msg and str(d) in msg
    assert {n for n, _ in model.named_modules()} == before  # nothing was changed
    return msg


def test_wrong_rank(saved):
    path, d = saved
    _edit_config(d, r=8)
    msg = _load_err(path, d)
    assert "adapter_model.safetensors" in msg and "r=8" in msg and "rank" in msg


def test_rank_disagrees_with_model_adapters(saved):
    path, d = saved
    model = orbitrl.load_model(path)
    apply_lora(model, rank=2, alpha=8, targets=["q_proj", "v_proj"])
    msg = _load_err(path, d, model)
    assert "adapter_config.json" in msg and "r=4" in msg and "rank 2" in msg


def test_wrong_targets(saved):
    path, d = saved
    _edit_config(d, target_modules=["q_proj"])  # tensors for v_proj are not selected
    msg = _load_err(path, d)
    assert "v_proj" in msg and "target_modules" in msg
    _edit_config(d, target_modules=["q_proj", "v_proj", "o_proj"])  # o_proj tensors missing
    msg = _load_err(path, d)
    assert "lacks" in msg and "o_proj" in msg
    _edit_config(d, target_modules=["qkv_proj"])  # a pattern matching nothing
    msg = _load_err(path, d)
    assert "adapter_config.json" in msg and "qkv_proj" in msg


def test_wrong_shape(saved):
    path, d = saved
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    _edit_tensors(d, lambda t: t.__setitem__(key, torch.zeros(64, 4)))  # v_proj out is 32
    msg = _load_err(path, d)
    assert key in msg and "(64, 4)" in msg and "(32, 4)" in msg


def test_unsupported_and_malformed(saved, tmp_path):
    path, d = saved
    _edit_config(d, use_dora=True)
    assert "use_dora" in _load_err(path, d)
    _edit_config(d, use_dora=False, target_parameters=["model.layers.0.mlp.experts.gate_up_proj"])
    assert "target_parameters" in _load_err(path, d)
    (d / "adapter_config.json").write_text("{not json")
    assert "adapter_config.json" in _load_err(path, d)
    shutil.rmtree(d)
    d.mkdir()
    assert "adapter_config.json" in _load_err(path, d)


def test_unexpected_tensor(saved):
    path, d = saved
    _edit_tensors(d, lambda t: t.__setitem__("base_model.model.lm_head.weight",
                                            torch.zeros(97, 64)))
    msg = _load_err(path, d)
    assert "lm_head.weight" in msg and "unexpected" in msg
