import pytest
import torch

import orbitrl
from orbitrl.errors import OrbitError
from orbitrl.train.optim import FusedSGD
from orbitrl.train.residency import LayerResidency

from hf_helpers import make_hf_model

N_LAYERS = 6


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("deep")
    make_hf_model("qwen2", num_hidden_layers=N_LAYERS).save_pretrained(d)
    return d


def _ids():
    return torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(0))


def _layer_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.model.layers.parameters())


def test_forward_prefetch_accounting_and_same_logits(deep_dir):
    ref = orbitrl.load_model(deep_dir)
    m = orbitrl.load_model(deep_dir)
    total = _layer_bytes(m)
    res = LayerResidency(m, prefetch=2, copy_on_host=True)
    # cold: the layers show their host copies (what a checkpoint reads), no hot copy
    assert all(p.data_ptr() == L.host[n].data_ptr() and L.hot is None
               for L in res.layers for n, p in L.params.items())
    with torch.no_grad():
        out = m(_ids())
        torch.testing.assert_close(out, ref(_ids()), atol=0, rtol=0)
    s = res.stats
    assert (s.misses, s.hits) == (1, N_LAYERS - 1)  # only layer 0 is fetched on demand
    assert s.peak_resident_layers == 3  # computing + 2 prefetched
    assert s.bytes_from_host == total and s.host_bytes == total
    assert all(L.state == "cold" for L in res.layers)
    per_layer = total // N_LAYERS
    assert s.peak_device_bytes == res.fixed_bytes + 3 * per_layer
    # a second forward with k=3
    res.detach()
    res = LayerResidency(m, prefetch=3, copy_on_host=True)
    with torch.no_grad():
        torch.testing.assert_close(m(_ids()), out, atol=0, rtol=0)
    assert res.stats.peak_resident_layers == 4 and res.stats.misses == 1


def _closure(model, ids):
    def run():
        loss = model(ids).float().logsumexp(-1).mean()
        loss.backward()
        return loss
    return run


def test_training_step_with_tiers_matches_resident(deep_dir):
    ids = _ids()
    ref = orbitrl.load_model(deep_dir).train()
    ref.recompute = True
    m = orbitrl.load_model(deep_dir).train()
    m.recompute = True
    res = LayerResidency(m, prefetch=2, copy_on_host=True)
    opt_ref = FusedSGD(ref.parameters(), lr=0.5)
    opt = FusedSGD(m.parameters(), lr=0.5)
    for _ in range(2):
        opt_ref.step(_closure(ref, ids))
        opt.step(_closure(m, ids))
    res.detach()
    for (n, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=n)
    s = res.stats
    assert s.misses == 4  # layer 0 once per forward (2 steps x 2 passes)
    # written back only after the update pass (2 steps), not after the norm-only pass
    assert s.hits > 0 and s.bytes_written_back == 2 * _layer_bytes(ref)
    # forward: 1 + k; backward: computing + k prefetched + one trailing layer whose
    # gradient hooks (the update) have not all run yet when the next layer starts
    assert s.peak_resident_layers <= 2 + 2
    assert s.peak_resident_layers < N_LAYERS
    events = [e[0] for e in s.timeline]
    assert "backward" in events and events[-1] == "end"


def test_refusals(deep_dir):
    m = orbitrl.load_model(deep_dir).train()
    LayerResidency(m, prefetch=2)
    with pytest.raises(OrbitError, match="recompute"):
        m(_ids())
    m.recompute = True
    # an unfused optimizer would need the gradient after the layer left the device
    with pytest.raises(Exception, match="fused optimizer"):
        m(_ids()).sum().backward()
    with pytest.raises(OrbitError, match="prefetch"):
        LayerResidency(orbitrl.load_model(deep_dir), prefetch=0)


def test_recompute_saves_only_layer_inputs(deep_dir):
    """What an outer saved-tensor hook (``decoder.ActivationOffload``, used by
    offload_activations) sees under recompute: the layer inputs only, not the activations
    inside each layer."""
    m = orbitrl.load_model(deep_dir).train()
    counts = {}
    for recompute in (False, True):
        m.recompute = recompute
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t,
                                                      lambda t: t):
            m(_ids(), return_hidden=True)
        counts[recompute] = len(packed)
    assert counts[True] <= N_LAYERS * 3 + 10 < counts[False]
    m.offload_activations = True  # each layer's hidden-state input moves; cos / sin stay
    m(_ids()).sum().backward()
    off, moved = m.activation_offload, N_LAYERS * 2 * 10 * m.config.hidden_size * 4
    assert off.tensors_stored == off.tensors_restored == N_LAYERS
    assert off.bytes_to_host == off.bytes_from_host == moved
