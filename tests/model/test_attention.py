"""The engine's fp64 decode attention against fp64 SDPA (``sdpa(exact=True)``): the same
fp32 result, to the last bit but for a rare double rounding, over GQA shapes, context
lengths, windows and single-key rows."""

import pytest
import torch

from orbitrl.model.attention import decode_attention_exact, sdpa


@pytest.mark.parametrize("b,c,hkv,g,d", [(1, 1, 1, 1, 8), (9, 176, 2, 4, 64), (5, 33, 4, 1, 16),
                                         (3, 70, 1, 7, 32)])
@pytest.mark.parametrize("window", [None, 5])
def test_decode_attention_exact_matches_fp64_sdpa(b, c, hkv, g, d, window):
    gen = torch.Generator().manual_seed(b * 1000 + c)
    q = torch.randn(b, hkv, g, d, generator=gen)
    k = torch.randn(b, c, hkv, d, generator=gen) * 3
    v = torch.randn(b, c, hkv, d, generator=gen)
    pos = torch.randint(0, c, (b,), generator=gen)
    pos[0] = c - 1
    kpos = torch.arange(c)[None]
    allowed = kpos <= pos[:, None]
    if window is not None:
        allowed &= pos[:, None] - kpos < window
    allowed = allowed[:, None, None, :]
    got = decode_attention_exact(q, k, v, allowed, d ** -0.5)
    want = sdpa(q, k.transpose(1, 2), v.transpose(1, 2), allowed, d ** -0.5, exact=True)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1.2e-7, atol=1e-30)  # at most one ulp
    assert (got != want).float().mean() < 1e-3  # and almost always none
    # a key outside the allowed set does not count, whatever it holds
    k2, v2 = k.clone(), v.clone()
    blocked = ~allowed[:, 0, 0, :]
    k2[blocked], v2[blocked] = 1e4, -1e4
    assert torch.equal(decode_attention_exact(q, k2, v2, allowed, d ** -0.5), got)
