"""Run by test_mechanisms.py on 2 ranks (gloo): each check compares a sharded mechanism
with its one-process original on the same data and exits non-zero on a mismatch."""

from __future__ import annotations

import sys

import torch
import torch.distributed as td

from orbitrl.distributed.env import Dist, exit_now


def _model(seed=0, layers=3):
    from orbitrl.model.config import ModelConfig
    from orbitrl.model.decoder import Decoder

    cfg = ModelConfig.from_hf(dict(model_type="llama", vocab_size=32, hidden_size=32,
                                   intermediate_size=48, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=32, rms_norm_eps=1e-6,
                                   tie_word_embeddings=False))
    torch.manual_seed(seed)
    m = Decoder(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    return m


def _loss(m, ids):
    h = m(ids, return_hidden=True)
    return m.lm_head(h).float().log_softmax(-1).mean() * -1.0


def check_fused_optimizers(d: Dist):
    """FusedSGD / FusedAdaLomo (two-pass global clip, and AdaLomo's one-pass grouped
    normalization with its per-tensor spike check) on FSDP2 shards (each rank half the
    batch, gradients summed) against the same optimizer on the whole model with the whole
    batch, 3 steps."""
    from orbitrl.distributed.fsdp import shard_model
    from orbitrl.train.optim import build_optimizer

    for name, lr, clip in (("sgd", 0.5, "global"), ("adalomo", 1e-2, "global"),
                           ("adalomo", 1e-2, "grouped")):
        tag = f"{name}/{clip}"
        ref, sh = _model(), _model()
        shard_model(sh, d)
        o_ref = build_optimizer(name, list(ref.parameters()), lr, clip=clip)
        o_sh = build_optimizer(name, list(sh.parameters()), lr, clip=clip)
        seen = []  # one pass: the norm so far after each tensor, the same on every rank
        o_sh.veto = lambda n: seen.append(n) or False
        o_sh.reduce_sum = d.all_sum
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            ids = torch.randint(0, 32, (4, 12), generator=g)
            mine = ids[d.rank * 2:(d.rank + 1) * 2]
            # the loss of the whole batch is the mean over 4 rows: each rank's rows / 4 * 2
            o_ref.step(lambda: (_loss(ref, ids)).backward())
            o_sh.step(lambda: (_loss(sh, mine) / d.world).backward())
        assert o_sh.stats.steps == 3 and o_sh.stats.held == 0, (tag, o_sh.stats)
        if clip == "grouped":  # every rank saw the same (whole-tensor) bounds
            assert len(seen) == 3 * len(list(sh.parameters()))
            theirs = d.gather_objects(seen)
            assert all(t == seen for t in theirs), (tag, theirs)
        assert abs(o_ref.stats.last_grad_norm - o_sh.stats.last_grad_norm) < 1e-5 * max(
            1.0, o_ref.stats.last_grad_norm), (tag, o_ref.stats.last_grad_norm,
                                              o_sh.stats.last_grad_norm)
        ref_p = dict(ref.named_parameters())
        for n, p in sh.named_parameters():
            diff = float((p.detach().full_tensor() - ref_p[n].detach()).abs().max())
            assert diff < 1e-5, (tag, n, diff)
        moved = max(float((p.detach() - q.detach()).abs().max()) for p, q in
                    zip(ref.parameters(), _model().parameters()))
        assert moved > 1e-3, (tag, moved)


def check_lockstep(d: Dist):
    """Ranks running different numbers of forwards (3 and 1) finish together, with the
    outputs of the unsharded model."""
    from orbitrl.distributed.fsdp import lockstep, shard_model

    ref, sh = _model(), _model()
    shard_model(sh, d)
    n = 3 if d.rank == 0 else 1
    ids = [torch.randint(0, 32, (1, 5), generator=torch.Generator().manual_seed(i))
           for i in range(n)]
    with torch.no_grad(), lockstep(sh, d):
        outs = [sh.lm_head(sh(x, return_hidden=True)) for x in ids]
    with torch.no_grad():
        for x, o in zip(ids, outs):
            assert float((ref(x) - o).abs().max()) < 1e-5


def check_global_batch(d: Dist):
    """Whitening over both ranks' rows (uneven counts and lengths) equals whitening the
    whole batch at once."""
    from orbitrl.distributed.batch import on_global_batch
    from orbitrl.rl.advantages import whiten

    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 7, generator=g)
    m = (torch.rand(5, 7, generator=g) > 0.3).float()
    rows = (0, 2) if d.rank == 0 else (2, 5)
    width = 4 if d.rank == 0 else 7  # rank 0's rows are shorter (padding cut)
    m[0:2, 4:] = 0
    mine = on_global_batch(d, whiten, x[rows[0]:rows[1], :width], m[rows[0]:rows[1], :width])
    want = whiten(x, m)[rows[0]:rows[1], :width]
    assert mine.shape == want.shape and float((mine - want).abs().max()) < 1e-6


def check_empty_rank(d: Dist):
    """A rank left with no rows joins the whitening of the others' rows."""
    from orbitrl.distributed.batch import join_empty, on_global_batch
    from orbitrl.rl.advantages import whiten

    g = torch.Generator().manual_seed(4)
    x, m = torch.randn(3, 5, generator=g), torch.ones(3, 5)
    if d.rank == 0:
        out = on_global_batch(d, lambda r_, x_, m_, k_: whiten(x_, m_), torch.zeros(3), x, m,
                              None)
        assert float((out - whiten(x, m)).abs().max()) < 1e-6
    else:
        join_empty(d, 4, "cpu")


def check_prefetch_depth(d: Dist):
    """``prefetch_layers`` k: when layer i's forward starts, layers i .. i+k are gathered or
    their all-gathers in flight (fewer only at the end). The depth is read from FSDP2's
    parameter groups (gathered, or an all-gather pending); the loss does not change with
    it."""
    from orbitrl.distributed.fsdp import shard_model

    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(2))
    outs = []
    for k in (0, 1, 2, 3):
        m = _model(layers=6)
        shard_model(m, d, prefetch_layers=k)
        layers = list(m.model.layers)

        def depth():
            groups = [lyr._get_fsdp_state()._fsdp_param_group for lyr in layers]
            return sum(bool(g.is_unsharded or g._all_gather_result is not None)
                       for g in groups)

        seen = []
        hooks = [lyr.register_forward_pre_hook(lambda *a: seen.append(depth()))
                 for lyr in layers]
        loss = _loss(m, ids)
        loss.backward()
        for h in hooks:
            h.remove()
        n = len(layers)
        # layer i and the next min(k, n-1-i) (the one before was resharded after its forward)
        assert seen == [1 + min(k, n - 1 - i) for i in range(n)], (k, seen)
        outs.append(float(loss))
    assert len(set(outs)) == 1, outs


def check_metrics(d: Dist):
    from orbitrl.distributed.metrics import reduce_row

    row = {"step": 3, "reward_mean": [0.5, 1.0][d.rank], "groups_kept": [1, 3][d.rank],
           "time_train_s": [1.0, 2.0][d.rank], "mem_train_measured_bytes": [10, 20][d.rank],
           "spike_layer": "model.layers.1"}
    if d.rank == 1:  # a key only one rank has (a rank that kept no samples logs none)
        row["mem_train_positions"] = 128
    out = reduce_row(row, d)
    assert out["mem_train_positions"] == 128
    assert out["step"] == 3 and out["groups_kept"] == 4 and out["time_train_s"] == 2.0
    assert abs(out["reward_mean"] - (0.5 * 1 + 1.0 * 3) / 4) < 1e-12
    assert out["mem_train_measured_bytes_by_rank"] == [10, 20]


if __name__ == "__main__":
    torch.set_num_threads(1)
    td.init_process_group("gloo")
    d = Dist(rank=td.get_rank(), world=td.get_world_size(), backend="gloo")
    for name in sys.argv[1:]:
        globals()[f"check_{name}"](d)
        print(f"rank {d.rank}: {name} ok", flush=True)
    td.barrier()
    td.destroy_process_group()
    exit_now(0)  # skip the interpreter's teardown (see orbitrl.distributed.env)
