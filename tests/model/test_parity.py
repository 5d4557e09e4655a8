"""Our decoder against transformers' logits, per family, with and without packing."""

import pytest
import torch

import orbitrl
from hf_helpers import FAMILY_CONFIGS


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_logits_match_transformers(hf_dirs, family):
    path, ref = hf_dirs[family]
    ours = orbitrl.load_model(path, dtype="float32")
    assert ours.config.num_params == sum(p.numel() for p in ref.parameters())
    torch.manual_seed(1)
    ids = torch.randint(0, 97, (3, 11))
    with torch.no_grad():
        want = ref(ids).logits
        got = ours(ids)
    assert got.shape == want.shape == (3, 11, 97)
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_packed_row_equals_one_by_one(hf_dirs, family):
    path, ref = hf_dirs[family]
    ours = orbitrl.load_model(path)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (7, 3, 9)]
    ids, pos, sid = ours.packed_inputs(seqs)
    with torch.no_grad():
        packed = ours(ids, positions=pos, seq_ids=sid)[0]
        start = 0
        for s in seqs:
            alone = ref(torch.tensor([s])).logits[0]
            assert (packed[start:start + len(s)] - alone).abs().max().item() < 1e-5
            start += len(s)


def test_padding_rows_do_not_leak(hf_dirs):
    path, _ = hf_dirs["qwen2"]
    ours = orbitrl.load_model(path)
    ids = torch.randint(0, 97, (1, 6))
    pad = torch.cat([ids, torch.zeros(1, 3, dtype=torch.long)], 1)
    sid = torch.tensor([[0] * 6 + [-1] * 3])
    pos = torch.tensor([list(range(6)) + [0, 0, 0]])
    with torch.no_grad():
        a = ours(ids)
        b = ours(pad, positions=pos, seq_ids=sid)
    assert torch.isfinite(b).all()
    assert (a - b[:, :6]).abs().max().item() < 1e-6


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "smollm3", "olmo3", "gemma2",
                                    "gemma3_text", "phi3"])
def test_export_round_trip(hf_dirs, family, tmp_path):
    from transformers import AutoModelForCausalLM

    path, ref = hf_dirs[family]
    ours = orbitrl.load_model(path)
    orbitrl.save_pretrained(ours, tmp_path / "out")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    ids = torch.randint(0, 97, (2, 8))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, ref(ids).logits)


def test_sharded_checkpoint_loads(hf_dirs, tmp_path):
    path, ref = hf_dirs["llama"]
    ours = orbitrl.load_model(path)
    from orbitrl.model.weights import save_pretrained

    save_pretrained(ours, tmp_path / "sharded", max_shard_bytes=20_000)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    again = orbitrl.load_model(tmp_path / "sharded")
    ids = torch.randint(0, 97, (1, 5))
    with torch.no_grad():
        assert torch.equal(again(ids), ours(ids))


def test_bf16_load_keeps_dtype(hf_dirs):
    path, _ = hf_dirs["qwen3"]
    m = orbitrl.load_model(path, dtype="bf16")
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    assert not any(p.is_meta for p in m.parameters())


def test_recompute_gives_same_gradients(hf_dirs):
    path, _ = hf_dirs["llama"]
    m = orbitrl.load_model(path).train()
    ids = torch.randint(0, 97, (2, 7))
    m(ids).sum().backward()
    g1 = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    m.recompute = True
    m(ids).sum().backward()
    for a, p in zip(g1, m.parameters()):
        assert torch.allclose(a, p.grad, atol=1e-6)


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # a tied and an untied head
def test_column_major_head_same_logits_and_gradients(hf_dirs, family):
    """load_model stores the head column-major on the CPU (memory neutral); the forward,
    the gradients (through a tied embedding too) and the update land as with a row-major
    head."""
    path, _ = hf_dirs[family]
    col = orbitrl.load_model(path)
    row = orbitrl.load_model(path)
    w = row.lm_head.weight
    w.data = w.data.contiguous()
    assert col.lm_head.weight.stride() == (1, col.config.vocab_size)
    assert col.lm_head.weight.untyped_storage().nbytes() == w.numel() * 4
    assert (col.model.embed_tokens.weight is col.lm_head.weight) == (family == "qwen2")
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    for m in (col, row):
        m.train()
        torch.log_softmax(m(ids), -1)[..., 5].sum().backward()
    gc, gr = col.lm_head.weight.grad, row.lm_head.weight.grad
    assert (gc - gr).abs().max().item() < 1e-5
    with torch.no_grad():
        col.lm_head.weight.add_(gc, alpha=-0.1)
        w.add_(gr, alpha=-0.1)
        assert (col(ids) - row(ids)).abs().max().item() < 1e-5


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_transformers_form_to_the_bit(x_dtype, w_dtype):
    """RMSNorm on a CPU goes through F.rms_norm: the same bits as transformers' explicit
    ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`` (computed in fp32), values and
    gradients, for every input / weight dtype a model here can have."""
    from orbitrl.model.decoder import RMSNorm

    torch.manual_seed(0)
    m = RMSNorm(96, 1e-6).to(w_dtype)
    with torch.no_grad():
        m.weight.normal_()
    x = torch.randn(2, 5, 96).to(x_dtype).requires_grad_()
    xf = x.float()
    want = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    want = m.weight * (want if x_dtype == torch.float32 else want.to(x_dtype))
    got = m(x)
    assert got.dtype == want.dtype and torch.equal(got, want)
    g = torch.randn_like(want)
    gw = torch.autograd.grad(want, (x, m.weight), g)
    gg = torch.autograd.grad(got, (x, m.weight), g)
    assert all(torch.equal(a, b) for a, b in zip(gg, gw))
    # without a graph (rollout, reference passes: an fp32 model takes in-place ops there)
    with torch.no_grad():
        assert torch.equal(m(x), want)
        for shape in [(1, 3, 96), (7, 96), (4, 2, 3, 96)]:
            y = (torch.randn(shape) * 5).to(x_dtype)
            yf = y.float()
            ref = yf * torch.rsqrt(yf.pow(2).mean(-1, keepdim=True) + 1e-6)
            ref = m.weight * (ref if x_dtype == torch.float32 else ref.to(x_dtype))
            assert torch.equal(m(y), ref)
    with torch.inference_mode():
        assert torch.equal(m(x.detach()), want)


def test_q_and_k_side_by_side_rotate_as_one():
    """Without a graph, q and k heads that lie side by side in one GEMM's output (the
    engine's packed q/k/v on a CPU) are rotated as one view: the same bits as rotating
    each; anything else (separate tensors, another layout) rotates them one by one."""
    from orbitrl.model.decoder import _side_by_side
    from orbitrl.model.rope import apply_rotary

    torch.manual_seed(0)
    b, t, hq, hkv, d = 1, 5, 8, 2, 16
    y = torch.randn(b, t, (hq + 2 * hkv) * d)
    q, k, v = (z.view(b, t, -1, d) for z in y.split((hq * d, hkv * d, hkv * d), -1))
    pos = torch.arange(t)[None]
    freqs = pos.float()[..., None] * (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))
    cos = torch.cat((freqs, freqs), -1).cos()[:, :, None]
    sin = torch.cat((-freqs.sin(), freqs.sin()), -1)[:, :, None]
    qk = _side_by_side(q, k)
    assert qk is not None and qk.shape == (b, t, hq + hkv, d)
    q2, k2 = apply_rotary(qk, cos, sin).split((hq, hkv), 2)
    assert torch.equal(q2, apply_rotary(q, cos, sin)) and torch.equal(k2, apply_rotary(k, cos, sin))
    assert _side_by_side(q, v) is None  # k's place holds other heads
    assert _side_by_side(q.clone(), k) is None and _side_by_side(q, k.clone()) is None
    assert _side_by_side(k, q) is None
