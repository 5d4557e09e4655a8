"""The engine with the paged Triton kernels as its attention (what CUDA runs by default),
here in Triton's interpreter on CPU: the general path (decode tokens with GRPO prefix
groups, chunked prefill over a paged prefix) and the static decode runner give the tokens
of the plain gather + SDPA path, with logprobs within fp32 summation noise, for sliding
windows and fp8 KV too."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import orbitrl  # noqa: E402
from orbitrl.engine import Engine, SamplingParams  # noqa: E402
from orbitrl.errors import OrbitError  # noqa: E402
from hf_helpers import GREEDY, random_prompts  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _run(model, backend, static, kv_dtype=None):
    eng = Engine(model, kv_budget_bytes=1 << 21, block_size=4, max_num_batched_tokens=16,
                 static_decode=static, attention_backend=backend, kv_dtype=kv_dtype,
                 packed_bytes=0)
    # n=3: each prompt's samples share its blocks (prefix groups); 16-token steps chunk
    # the 23- and 31-token prompts (prefill over a paged prefix)
    outs = eng.generate(random_prompts([5, 23, 9, 31]),
                        SamplingParams(n=3, max_tokens=7, **GREEDY))
    return eng, [[(s.token_ids, s.raw_logprobs) for s in o.samples] for o in outs]


@pytest.mark.parametrize("family,kv_dtype", [("qwen2", None), ("mistral", None),
                                             ("llama", "fp8"), ("gemma3_text", None),
                                             ("gpt_oss", None)])  # sinks, windows
@pytest.mark.parametrize("static", [False, True])
def test_kernels_match_the_plain_path(hf_dirs, family, kv_dtype, static):
    model = orbitrl.load_model(hf_dirs[family][0], device=DEV)
    eng, got = _run(model, "triton", static, kv_dtype)
    _, want = _run(model, "torch", static, kv_dtype)
    assert eng.attention_backend == "triton"
    if static:
        assert sum(n == k for n, k, _ in eng.timeline) >= 5  # the runner's decode steps ran
    for g, w in zip(got, want):
        for (gt, gl), (wt, wl) in zip(g, w):
            assert gt == wt
            assert max(abs(a - b) for a, b in zip(gl, wl)) < (5e-2 if kv_dtype else 1e-4)


def test_general_path_calls_the_kernels(hf_dirs, monkeypatch):
    """Every attention call of a step goes through the kernels: decode with prefix groups
    built once per step, prefill once per chunk."""
    from orbitrl.engine import attention_kernels as ak

    calls = {"decode": 0, "groups": 0, "prefill": 0}
    for name, key in (("paged_decode", "decode"), ("shared_prefix_groups", "groups"),
                      ("paged_prefill", "prefill")):
        fn = getattr(ak, name)

        def counted(*a, _fn=fn, _key=key, **k):
            calls[_key] += 1
            return _fn(*a, **k)
        monkeypatch.setattr(ak, name, counted)
    model = orbitrl.load_model(hf_dirs["qwen2"][0], device=DEV)
    _run(model, "triton", False)
    layers = model.config.num_layers
    assert calls["prefill"] >= 4 * layers and calls["decode"] >= 6 * layers
    assert 1 <= calls["groups"] and calls["groups"] * layers <= calls["decode"]
    for k in calls:
        calls[k] = 0
    eng = Engine(model, kv_budget_bytes=1 << 21, block_size=4, attention_backend="triton",
                 static_decode=False)
    eng.generate(random_prompts([5, 9, 7]), SamplingParams(max_tokens=6, **GREEDY))
    assert calls["decode"] >= 5 * layers and calls["groups"] == 0  # nothing shared


def test_bad_backend(hf_dirs, monkeypatch):
    model = orbitrl.load_model(hf_dirs["qwen2"][0], device=DEV)
    with pytest.raises(OrbitError, match="attention backend 'cuda'"):
        Engine(model, kv_budget_bytes=1 << 20, attention_backend="cuda")
    assert Engine(model, kv_budget_bytes=1 << 20).attention_backend == (
        "triton" if DEV == "cuda" else "torch")
    if DEV == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(OrbitError, match="set TRITON_INTERPRET=1"):
            Engine(model, kv_budget_bytes=1 << 20, attention_backend="triton")


def test_soft_capped_attention_never_reaches_the_kernels(hf_dirs):
    """The kernels have no soft-capping: a Gemma 2 engine on "auto" attends with the
    reference (even where "auto" means Triton), an explicit "triton" is refused with one
    line naming the config key, never run without its cap."""
    from orbitrl.engine.paged_attention import KVCache, PagedAttention

    model = orbitrl.load_model(hf_dirs["gemma2"][0], device=DEV)
    assert Engine(model, kv_budget_bytes=1 << 20).attention_backend == "torch"
    with pytest.raises(OrbitError, match="attn_logit_softcapping"):
        Engine(model, kv_budget_bytes=1 << 20, attention_backend="triton")
    cache = KVCache(2, 2, 16, 4, 4, torch.float32, DEV)
    with pytest.raises(OrbitError, match="attn_logit_softcapping"):
        PagedAttention(cache, [None, None], 0.2, backend="triton", softcap=50.0)
