"""The trainer's GEMMs on oneDNN (model/gemm.py): the bits of the engine's packed copies at
any row count, the gradients of ``F.linear``, routing scoped to its thread and its weights,
the chunked head over a column-major weight, and LoRA's own products."""

import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from orbitrl.model import gemm
from orbitrl.model.lora import LoRALinear
from orbitrl.train.logprobs import token_logprobs

pytestmark = pytest.mark.skipif(not gemm.available(), reason="this torch build has no oneDNN")


def _packed(x, w, b=None):
    """The engine's product (engine/packed.py): a prepacked copy of ``w``."""
    pk = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    return torch.ops.mkldnn._linear_pointwise(x, pk, b, "none", [None], "")


def test_onednn_linear_has_the_packed_bits_and_f_linear_gradients():
    torch.manual_seed(0)
    w = (torch.randn(96, 80) * 0.1).requires_grad_()
    b = torch.randn(96, requires_grad=True)
    x = torch.randn(300, 80, requires_grad=True)
    y = gemm.OneDNNLinear.apply(x, w, b)
    full = _packed(x.detach(), w.detach(), b.detach())
    assert torch.equal(y.detach(), full)
    for rows in (3, 4, 7, 12, 64, 129):  # a decode step's rows: the same bits
        assert torch.equal(_packed(x.detach()[:rows], w.detach(), b.detach()), full[:rows])
    x3 = x.detach()[:60].view(3, 20, 80)  # leading dimensions kept
    assert torch.equal(gemm.OneDNNLinear.apply(x3, w, b).detach(), full[:60].view(3, 20, 96))
    g = torch.randn_like(y)
    gx, gw, gb = torch.autograd.grad(y, (x, w, b), g)
    rx, rw, rb = torch.autograd.grad(F.linear(x, w, b), (x, w, b), g)
    for got, want in ((gx, rx), (gw, rw), (gb, rb)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_row_counts_past_a_batch_are_padded_to_few_buckets_with_the_same_bits(monkeypatch):
    """oneDNN keeps a primitive per row count it has seen (0.6 MiB each, never freed):
    past 64 rows a product is padded up to one of 16 row counts per power of two, so the
    training and prefill GEMMs, whose rows change every step, stay within a few; the
    padding costs at most 1/16 of the rows and no bits."""
    assert [gemm.row_bucket(m) for m in (1, 3, 64)] == [1, 3, 64]
    seen = set()
    for m in range(65, 4097):
        r = gemm.row_bucket(m)
        assert m <= r <= m * (1 + 1 / 16) and r >= gemm.row_bucket(m - 1)
        seen.add(r)
    assert len(seen) == 16 * 6  # 64 .. 4096: six powers of two
    calls = []
    op = torch.ops.mkldnn._linear_pointwise

    class Ops:
        @staticmethod
        def _linear_pointwise(x, *a):
            calls.append(x.numel() // x.shape[-1])
            return op(x, *a)

    torch.manual_seed(0)
    w, b = torch.randn(96, 80) * 0.1, torch.randn(96)
    x = torch.randn(2, 200, 80)
    ref = op(x.reshape(400, 80), w, b, "none", [None], "").view(2, 200, 96)
    monkeypatch.setattr(gemm.torch.ops, "mkldnn", Ops)
    for m in (70, 129, 200, 333, 400):
        y = gemm.onednn_mm(x.reshape(400, 80)[:m], w, b)
        assert y.shape == (m, 96) and torch.equal(y, ref.reshape(400, 96)[:m])
    assert torch.equal(gemm.onednn_mm(x, w, b), ref)
    assert calls == [72, 136, 200, 336, 400, 400]


def test_a_lone_row_is_padded_to_two_and_keeps_a_batchs_bits():
    # over a plain weight oneDNN takes one row as a matrix-vector product, which rounds
    # otherwise (the trainer's last token chunk, a one-row engine step)
    torch.manual_seed(0)
    w, b = torch.randn(576, 1536), torch.randn(576)
    x = torch.randn(64, 1536)
    ref = gemm.onednn_mm(x, w, b)
    one = torch.ops.mkldnn._linear_pointwise(x[:1].clone(), w, b, "none", [None], "")
    assert not torch.equal(one, ref[:1])  # what the floor is for
    assert torch.equal(gemm.onednn_mm(x[:1], w, b), ref[:1])
    assert torch.equal(gemm.onednn_mm(x[0], w, b), ref[0])  # a 1-D input too
    pk = torch.ops.mkldnn._reorder_linear_weight(w, 64)  # a packed copy: the same
    assert torch.equal(gemm.onednn_mm(x[:1], pk, b), ref[:1])


def test_a_frozen_weight_keeps_no_input_for_backward():
    w = torch.randn(64, 32)
    x = torch.randn(50, 32, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = gemm.OneDNNLinear.apply(x, w, None)
    assert [t.shape for t in saved] == [w.shape]  # the weight alone, as autograd keeps it
    (gx,) = torch.autograd.grad(y.sum(), (x,))
    torch.testing.assert_close(gx, torch.ones(50, 64) @ w)


def test_routing_is_scoped_to_its_thread_and_its_weights(monkeypatch):
    torch.manual_seed(1)
    lin, other = nn.Linear(48, 40), nn.Linear(48, 40)
    x = torch.randn(20, 48)
    plain, dnn = F.linear(x, lin.weight, lin.bias), _packed(x, lin.weight.detach(),
                                                           lin.bias.detach())
    calls = []
    real = gemm.onednn_mm
    monkeypatch.setattr(gemm, "onednn_mm", lambda *a: calls.append(threading.get_ident())
                        or real(*a))
    me, seen = threading.get_ident(), {}

    def counted(fn):
        calls.clear()
        out = fn()
        return out, len(calls)

    with torch.no_grad():
        with gemm.onednn_gemms([lin]):
            assert gemm.routed(lin.weight) and not gemm.routed(other.weight)
            y, n = counted(lambda: lin(x))
            assert n == 1 and torch.equal(y, dnn)
            y, n = counted(lambda: other(x))
            assert n == 0 and torch.equal(y, F.linear(x, other.weight, other.bias))
            calls.clear()
            t = threading.Thread(target=lambda: seen.update(y=lin(x), r=gemm.routed(lin.weight)))
            t.start()
            t.join()
            assert calls == []  # another thread: untouched
            with gemm.onednn_gemms([lin], mode=False):  # nested: still routed on exit
                y, n = counted(lambda: gemm.linear(x, lin.weight, lin.bias))
                assert n == 1 and torch.equal(y, dnn)
            assert gemm.routed(lin.weight)
        assert torch.equal(seen["y"], plain) and not seen["r"]
        assert not gemm.routed(lin.weight)
        y, n = counted(lambda: lin(x))
        assert n == 0 and torch.equal(y, plain)
        with gemm.onednn_gemms([lin], mode=False):  # explicit calls only
            y, n = counted(lambda: lin(x))
            assert n == 0 and torch.equal(y, plain)
            y, n = counted(lambda: gemm.linear(x, lin.weight, lin.bias))
            assert n == 1 and torch.equal(y, dnn)
    assert set(calls) == {me}


def test_head_tiles_of_a_column_major_head_have_the_whole_products_bits():
    torch.manual_seed(2)
    head = nn.Linear(64, 1000, bias=False)
    head.weight.data = head.weight.data.t().contiguous().t()  # column-major, as loaded
    h = torch.randn(30, 64)
    targets = torch.randint(0, 1000, (30,))
    with gemm.onednn_gemms([head]):
        tile = gemm.head_gemm(head.weight)
        assert tile is not None
        whole = _packed(h, head.weight.detach())
        for v0 in range(0, 1000, 300):
            assert torch.equal(tile(h, head.weight[v0:v0 + 300]), whole[:, v0:v0 + 300])
        lp = token_logprobs(h, head.weight, targets, vocab_chunk=300, token_chunk=8)
    assert gemm.head_gemm(head.weight) is None
    want = torch.log_softmax(whole, -1).gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(lp, want, rtol=0, atol=5e-6)


def test_lora_products_follow_the_routing_with_their_gradients():
    torch.manual_seed(3)
    layer = LoRALinear(nn.Linear(40, 56), rank=8, alpha=16)
    nn.init.normal_(layer.lora_B.weight, std=0.1)
    x = torch.randn(25, 40, requires_grad=True)
    params = (x, layer.lora_A.weight, layer.lora_B.weight)
    y0 = layer(x)
    g0 = torch.autograd.grad(y0.sum(), params)
    with gemm.onednn_gemms([layer.base_layer, layer.lora_A, layer.lora_B]):
        y1 = layer(x)
        g1 = torch.autograd.grad(y1.sum(), params)
    base = _packed(x.detach(), layer.base_layer.weight, layer.base_layer.bias)
    a = _packed(x.detach(), layer.lora_A.weight.detach())
    want = torch.add(base, _packed(a, layer.lora_B.weight.detach()), alpha=layer.scaling)
    assert torch.equal(y1.detach(), want)
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-5)
    for got, ref in zip(g1, g0):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_a_recomputed_layer_multiplies_as_its_forward_did(hf_dirs):
    """Activation recompute: the layers re-run in backward, after the forward's routing has
    exited, under that routing again (checkpoint would refuse other saved tensors), and the
    gradients are those of the routed forward without recompute."""
    import orbitrl

    model = orbitrl.load_model(hf_dirs["qwen2"][0])
    lins = [m for m in model.modules() if isinstance(m, nn.Linear)]
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    grads = []
    for recompute in (False, True):
        model.recompute = recompute
        model.zero_grad(set_to_none=True)
        with gemm.onednn_gemms(lins):
            out = model(ids)
        out.float().square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    model.recompute = False
    assert len(grads[0]) == len(grads[1]) > 0
    for a, b in zip(*grads):
        assert torch.equal(a, b)
