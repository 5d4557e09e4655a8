"""Tiny random Hugging Face models per family, for parity tests (imported by tests as
``hf_helpers``: every conftest.py is a module named "conftest", so helpers imported from one
would be ambiguous across test directories)."""

import copy

import torch

# special token ids inside the tiny vocabulary (these families' defaults lie beyond it)
SMALL_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
# Tiny configs per family: GQA, tied/untied, biases, q/k norm, rope scaling, sliding window.
FAMILY_CONFIGS = {
    "llama": dict(model_type="llama", attention_bias=False, tie_word_embeddings=False),
    "llama3": dict(model_type="llama", tie_word_embeddings=True,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 16}),
    "llama_bias": dict(model_type="llama", attention_bias=True, mlp_bias=True,
                       rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "mistral": dict(model_type="mistral", sliding_window=5),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=False, head_dim=24),
    # SmolLM3: the second layer without rotary embeddings (NoPE)
    "smollm3": dict(model_type="smollm3", no_rope_layers=[1, 0], tie_word_embeddings=True,
                    **SMALL_IDS),
    # OLMo 2: post-norm blocks, q/k norm over the whole projection; OLMo 3 adds a sliding layer
    "olmo2": dict(model_type="olmo2", tie_word_embeddings=False, **SMALL_IDS),
    "olmo3": dict(model_type="olmo3", sliding_window=5,
                  layer_types=["sliding_attention", "full_attention"], **SMALL_IDS),
    # Phi-3/4: fused qkv_proj and gate_up_proj, partial rotary (12 of 16 channels, as
    # Phi-4-mini's 0.75), longrope: short factors and the attention factor (from
    # max_position_embeddings / 48) within the 48 tokens the shared tests stay in; the long
    # factors past them: tests/model/test_rope.py and the engine's rope test (switch at 16);
    # a sliding window on every layer (Phi-3-mini-4k has one of 2047)
    "phi3": dict(model_type="phi3", partial_rotary_factor=0.75, sliding_window=7,
                 original_max_position_embeddings=48,
                 rope_scaling={"rope_type": "longrope",
                               "short_factor": [1.0 + 0.1 * i for i in range(6)],
                               "long_factor": [1.5 + 0.7 * i for i in range(6)]},
                 **SMALL_IDS),
    # Gemma 2: (1+w) norms, four per block, scaled embeddings, query_pre_attn_scalar apart
    # from head_dim, sliding / global layers by transformers' default pattern, caps small
    # enough to bend these tiny models' scores and logits; Gemma 3 adds per-head q/k norms
    # and a second rotary base on its sliding layers (sliding_window_pattern 2)
    "gemma2": dict(model_type="gemma2", head_dim=16, query_pre_attn_scalar=24,
                   sliding_window=5, attn_logit_softcapping=0.5, final_logit_softcapping=1.0,
                   **SMALL_IDS),
    "gemma3_text": dict(model_type="gemma3_text", head_dim=24, query_pre_attn_scalar=20,
                        sliding_window=5, sliding_window_pattern=2, tie_word_embeddings=False,
                        rope_theta=10000.0, rope_local_base_freq=100.0, **SMALL_IDS),
}

# Tiny mixtures: top-2 softmax routing (Mixtral, with a sliding window and a tied head),
# a shared expert with its sigmoid gate, raw top-k weights and a dense layer (Qwen2-MoE),
# normalised top-k over 8 experts, untied (Qwen3-MoE); gpt-oss: attention sinks, sliding and
# full layers alternating (transformers' default layer_types), biases everywhere, a biased
# router whose weights are a softmax over the top-k logits, fused experts in the checkpoint,
# a SwiGLU limit low enough that these tiny experts' clamps bite, yarn with truncate false
# (gpt-oss's), its factor the context ratio as transformers expects; DeepSeek-V3: latent
# attention (q through q_a/q_b with interleaved rope pairs; plainly: q_proj, rotate-half and
# yarn with mscale_all_dim, which scales the softmax), a dense first layer, sigmoid routing
# over 4 groups of 2 experts keeping 2 groups, shared experts, a correction bias
# (make_hf_model sets one) and a routed scaling factor
DEEPSEEK = dict(model_type="deepseek_v3", num_hidden_layers=3, first_k_dense_replace=1,
                q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                v_head_dim=12, n_routed_experts=8, n_group=4, topk_group=2,
                num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                routed_scaling_factor=2.5, norm_topk_prob=True, num_key_value_heads=4,
                **SMALL_IDS)
MOE_CONFIGS = {
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=6, tie_word_embeddings=True),
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      norm_topk_prob=False, mlp_only_layers=[1], num_hidden_layers=3),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=3,
                      moe_intermediate_size=32, norm_topk_prob=True,
                      tie_word_embeddings=False),
    "gpt_oss": dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2,
                    intermediate_size=48, head_dim=16, sliding_window=5, swiglu_limit=0.5,
                    rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False,
                                     "original_max_position_embeddings": 16}, **SMALL_IDS),
    "deepseek_v3": DEEPSEEK,
    "deepseek_v3_plain_q": dict(DEEPSEEK, q_lora_rank=None, rope_interleave=False,
                                n_shared_experts=2, tie_word_embeddings=True,
                                rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                 "mscale": 1.0, "mscale_all_dim": 0.7,
                                                 "original_max_position_embeddings": 32}),
}
FAMILY_CONFIGS.update(MOE_CONFIGS)

# Tiny llamas per rope scaling type that the families above do not cover
# (tests/model/test_rope.py, tests/engine/test_engine.py). Each switch length is 16 tokens:
# yarn's original context, longrope's original context (short factors within it, long ones
# past it), dynamic NTK's max_position_embeddings (its base grows past it).
ROPE_CONFIGS = {
    "yarn": dict(model_type="llama", rope_scaling={
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
        "beta_fast": 8.0, "beta_slow": 1.0}),
    "longrope": dict(model_type="llama", rope_scaling={
        "rope_type": "longrope", "original_max_position_embeddings": 16,
        "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [1.5 + 0.7 * i for i in range(8)]}),
    "dynamic": dict(model_type="llama", max_position_embeddings=16,
                    rope_scaling={"rope_type": "dynamic", "factor": 3.0}),
}
ROPE_SWITCH = 16
PHI3_SWITCH = dict(original_max_position_embeddings=ROPE_SWITCH)  # "phi3" with that switch


def make_hf_config(family: str, **over):
    from transformers import AutoConfig

    # a deep copy: transformers keeps the rope dict it is given and standardises it in place
    kw = copy.deepcopy(FAMILY_CONFIGS[family] if family in FAMILY_CONFIGS
                       else ROPE_CONFIGS[family])
    mt = kw.pop("model_type")
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                rms_norm_eps=1e-6)
    base.update(kw)
    base.update(over)
    return AutoConfig.for_model(mt, **base)


def make_hf_model(family: str, seed: int = 0, **over):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = make_hf_config(family, **over)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    routers = ("gate.weight", "router.weight")  # gpt-oss's is "router"
    # random norms/biases too, so a mis-mapped norm or bias cannot hide
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else 0.1 * torch.randn_like(p))
            elif n.endswith(routers) or "experts" in n:  # routers: spread choices
                p.copy_(0.5 * torch.randn_like(p) if n.endswith(routers)
                        else 0.1 * torch.randn_like(p))
            elif n.endswith("sinks"):  # gpt-oss: sinks that take a real share of each softmax
                p.copy_(torch.randn_like(p))
        for n, b in model.named_buffers():  # DeepSeek-V3: a correction bias that changes choices
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.5 * torch.randn_like(b))
    return model.eval()


# ---- engine tests -----------------------------------------------------------------------
GREEDY = dict(temperature=0, ignore_eos=True)


def random_prompts(lengths, seed=0, vocab=97):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def unconstrained_run(model, prompts, params):
    """Generate with a pool far larger than needed: (outputs, blocks the run peaked at,
    bytes per block), the reference a constrained pool must reproduce."""
    from orbitrl.engine import Engine

    eng = Engine(model, kv_budget_bytes=1 << 22, block_size=4)
    return eng.generate(prompts, params), eng.pool.peak_used, eng.block_bytes


def hf_greedy(hf, prompt, n):
    """transformers' greedy tokens and their logprobs for one prompt (EOS off)."""
    ids = torch.tensor([prompt])
    r = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                    max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0,
                    output_logits=True, return_dict_in_generate=True)
    toks = r.sequences[0, len(prompt):].tolist()
    lps = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(r.logits, toks)]
    return toks, lps


def lora_views(model, n: int = 2, seed: int = 0):
    """LoRA (rank 4) on ``model`` and ``n`` snapshots of its adapters (``lora.adapter_view``
    inputs), each one random step further than the last; the live adapters stay at the
    last snapshot."""
    from orbitrl.model.lora import adapter_parameters, apply_lora, snapshot_adapters

    apply_lora(model, rank=4)
    torch.manual_seed(seed)
    views = []
    with torch.no_grad():
        for _ in range(n):
            for p in adapter_parameters(model):
                p.add_(torch.randn_like(p) * 0.3)
            views.append(snapshot_adapters(model))
    return views


# ---- what this CPU's GEMMs promise ------------------------------------------------------
def gemm_rows_invariant(k: int, n: int) -> bool:
    """Whether this machine's fp32 GEMM (x @ W^T) gives each row the same bits in a product
    of ``moe.row_count(m)`` rows as in a 300-row one, for m = 1..39, at a [k -> n] shape.

    Measured: yes with MKL's AVX-512 kernels at the tiny test shapes; no with its AVX2
    kernels (blocks of 6 rows: a remainder of 1-3 rows goes through another kernel, and
    from K of a few hundred only 56 rows and more agree). Where it is no, the engine's and
    the trainer's numbers agree within the ISA-independent bound (1e-5 of a logprob)
    instead of to the bit (docs/moe.md)."""
    from orbitrl.model import moe

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(300, k, generator=g), torch.randn(n, k, generator=g)
    with torch.no_grad():
        big = x @ w.T
        return all(torch.equal((x[:moe.row_count(m)] @ w.T)[:m], big[:m])
                   for m in range(1, 40))
