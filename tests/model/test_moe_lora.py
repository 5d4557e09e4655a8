"""LoRA on mixtures: attention and shared-expert adapters in PEFT files that peft loads onto
transformers' MoE models; routed-expert adapters per expert or shared across experts, on a
frozen quantized base, merged into an export (gpt-oss: into its fused expert tensors); a
one-line error where PEFT files cannot carry them."""

import pytest
import torch

import orbitrl
from orbitrl.errors import OrbitError
from orbitrl.model import moe
from orbitrl.model.adapters import load_adapters, save_adapters, save_merged
from orbitrl.model.lora import LoRALinear, adapter_parameters, apply_lora, lora_modules

IDS = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(8))


def _train(model, steps=3):
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(adapter_parameters(model), lr=1e-2)
    model.train()
    for _ in range(steps):
        ids = torch.randint(0, 97, (2, 8), generator=g)
        (-torch.log_softmax(model(ids), -1)[..., 7].mean()).backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"])
def test_peft_loads_attention_and_shared_expert_adapters(hf_dirs, tmp_path, family):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path, ref = hf_dirs[family]
    model = orbitrl.load_model(path)
    names = apply_lora(model, rank=4, alpha=8, targets="all-linear")
    assert names and not any(moe.ROUTED_EXPERT.fullmatch(n) for n in names)
    assert any("shared_expert" in n for n in names) == (family == "qwen2_moe")
    _train(model)
    with torch.no_grad():
        ours = model(IDS)
    assert (ours - ref(IDS).logits).abs().max() > 1e-3
    save_adapters(model, tmp_path / "ad", base_model_name_or_path=str(path))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    pm = PeftModel.from_pretrained(hf, tmp_path / "ad").eval()
    with torch.no_grad():
        assert (pm(IDS).logits - ours).abs().max().item() < 1e-5
    again = orbitrl.load_model(path)
    load_adapters(again, tmp_path / "ad")
    with torch.no_grad():
        assert (again(IDS) - ours).abs().max().item() < 1e-6


@pytest.mark.parametrize("fmt", [None, "int8", "nf4"])
def test_per_expert_adapters_train_on_a_frozen_base(hf_dirs, tmp_path, fmt):
    path, _ = hf_dirs["qwen3_moe"]
    model = orbitrl.load_model(path, base_format=fmt)
    names = apply_lora(model, rank=2, targets="all-linear", experts="per_expert")
    routed = [n for n in names if moe.ROUTED_EXPERT.fullmatch(n)]
    assert len(routed) == 2 * 8 * 3  # layers x experts x projections
    before = {n: m.lora_B.weight.clone() for n, m in lora_modules(model).items()}
    with torch.no_grad():
        start = model(IDS)
    _train(model)
    moved = [n for n, m in lora_modules(model).items()
             if n in routed and not torch.equal(m.lora_B.weight, before[n])]
    assert moved  # the experts that ran got gradients
    with torch.no_grad():
        assert (model(IDS) - start).abs().max() > 1e-3
    with pytest.raises(OrbitError, match="routed expert") as e:
        save_adapters(model, tmp_path / "ad")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("fmt,experts", [(None, "per_expert"), ("nf4", "shared")])
def test_gpt_oss_expert_adapters_merge_into_the_fused_experts(hf_dirs, tmp_path, fmt,
                                                             experts):
    """gpt-oss's checkpoint holds each layer's experts fused (gate and up columns
    interleaved, x @ W + b): adapters on every expert projection and on attention, over a
    plain or NF4 base, export merged into those tensors, which transformers loads with our
    logits."""
    from transformers import AutoModelForCausalLM

    path, ref = hf_dirs["gpt_oss"]
    model = orbitrl.load_model(path, base_format=fmt)
    names = apply_lora(model, rank=2, targets="all-linear", experts=experts)
    assert len([n for n in names if moe.ROUTED_EXPERT.fullmatch(n)]) == 2 * 4 * 3
    _train(model)
    with torch.no_grad():
        ours = model(IDS)
    assert (ours - ref(IDS).logits).abs().max() > 1e-3
    save_merged(model, tmp_path / "merged")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        assert (back.eval()(IDS).logits - ours).abs().max().item() < 1e-5


def test_shared_expert_adapters_are_one_pair_per_projection(hf_dirs):
    path, _ = hf_dirs["mixtral"]
    model = orbitrl.load_model(path, base_format="bf16")
    apply_lora(model, rank=2, targets=["w1", "w2", "w3", "q_proj"], experts="shared")
    block = model.model.layers[0].block_sparse_moe
    for proj in ("w1", "w2", "w3"):
        mods = [getattr(ex, proj) for ex in block.experts]
        assert all(isinstance(m, LoRALinear) for m in mods)
        assert all(m.lora_A is mods[0].lora_A and m.lora_B is mods[0].lora_B for m in mods)
    params = adapter_parameters(model)
    assert len({id(p) for p in params}) == len(params)
    # per layer: q_proj + 3 shared pairs, 2 tensors each
    assert len(params) == 2 * (1 + 3) * model.config.num_layers
    _train(model, steps=2)
    w1 = [ex.w1.lora_B.weight for ex in block.experts]
    assert w1[0].abs().sum() > 0 and all(w is w1[0] for w in w1)


def test_experts_option_checked(hf_dirs):
    path, _ = hf_dirs["qwen3_moe"]
    with pytest.raises(OrbitError, match="lora.experts"):
        apply_lora(orbitrl.load_model(path), experts="all")
    # a routed-expert name is not a candidate unless asked for
    with pytest.raises(OrbitError, match="matches no linear layer"):
        apply_lora(orbitrl.load_model(path), targets=r"re:.*experts\.0\.up_proj")


@pytest.mark.parametrize("family,targets", [
    ("deepseek_v3", ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]),
    ("deepseek_v3_plain_q", ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"])])
def test_peft_loads_latent_attention_adapters(hf_dirs, tmp_path, family, targets):
    """Adapters on every latent-attention projection load in peft on transformers'
    DeepseekV3ForCausalLM with our logits, and back here to the bit. (peft maps any
    gate_proj / up_proj / down_proj target of this model onto its fused routed experts as
    well, so files with dense-MLP or shared-expert adapters are exact here and in a merged
    export, not in peft: docs/models.md.)"""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path, ref = hf_dirs[family]
    model = orbitrl.load_model(path)
    apply_lora(model, rank=4, alpha=8, dropout=0.1, targets=targets)
    _train(model)
    with torch.no_grad():
        ours = model(IDS)
    assert (ours - ref(IDS).logits).abs().max() > 1e-3
    save_adapters(model, tmp_path / "ad", base_model_name_or_path=str(path))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    pm = PeftModel.from_pretrained(hf, tmp_path / "ad").eval()
    with torch.no_grad():
        assert (pm(IDS).logits - ours).abs().max().item() < 1e-5
    again = orbitrl.load_model(path)
    load_adapters(again, tmp_path / "ad")
    with torch.no_grad():
        assert torch.equal(again(IDS), ours)


@pytest.mark.parametrize("fmt", [None, "nf4"])
def test_deepseek_latent_attention_adapters_merge_into_an_export(hf_dirs, tmp_path, fmt):
    """LoRA on every latent-attention projection (q_a_proj, q_b_proj, kv_a_proj_with_mqa,
    kv_b_proj, o_proj), the dense layer's MLP and the shared experts, over an fp32 or NF4
    base: the merged export loads in transformers with our logits, and so does the engine's
    greedy decoding (which expands the cached latents through the adapted kv_b_proj)."""
    from transformers import AutoModelForCausalLM

    from orbitrl.engine import Engine, SamplingParams

    path, ref = hf_dirs["deepseek_v3"]
    model = orbitrl.load_model(path, base_format=fmt)
    names = apply_lora(model, rank=4, alpha=8, targets="all-linear")
    leaves = {n.rpartition(".")[2] for n in names}
    assert leaves == {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                      "gate_proj", "up_proj", "down_proj"}
    _train(model)
    with torch.no_grad():
        ours = model(IDS)
    assert (ours - ref(IDS).logits).abs().max() > 1e-3
    save_merged(model, tmp_path / "merged")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        assert (back.eval()(IDS).logits - ours).abs().max().item() < 1e-5
    prompt = IDS[0, :5].tolist()
    out = Engine(model, kv_budget_bytes=1 << 20, block_size=4).generate(
        [prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    want = back.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=6,
                         min_new_tokens=6, eos_token_id=None, pad_token_id=0)
    assert out[0].samples[0].token_ids == want[0, 5:].tolist()
