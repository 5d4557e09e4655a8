"""Layer tiers in a full-parameter training step: step time and device peak of the resident
model against ``train.tiers: k`` (layers in pinned host memory, k prefetched on a side
stream), and the int8 reference's forward pulled layer by layer against an int8 reference
resident on the device, in one run.

    python benchmarks/bench_tiers.py              # on the GPU when there is one
    python benchmarks/bench_tiers.py --quick      # a smaller model

Method. One process; every configuration builds the same random Llama-shaped model (fp32,
seeded), the same batch and the same fused update (FusedSGD, two-pass exact clip), with
activation recomputation on in every row (tiers need it), so rows differ only in where
the layers live. Step time: the mean over the steps after the first (CUDA synchronized);
device peak: ``torch.cuda.max_memory_allocated`` over those steps, weights included (what
tiers lower). Per step, the residency's own accounting: bytes copied from the host and
prefetch hits / misses (a miss is a copy the compute waited for). On a CPU-only host the
"device" is the host (hot copies are distinct buffers, so the copy path runs), the device
peak column is the residency's accounting (non-layer weights + the resident layers), and
only the relative step times mean anything.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from orbitrl.observe.memory import tensor_bytes

MB = 1 << 20


def _model(args):
    from orbitrl.model.config import ModelConfig
    from orbitrl.model.decoder import Decoder

    if args.quick:
        h, layers, inter, vocab = 512, 8, 1536, 8000
    else:  # ~0.5B parameters, 24 layers of 17.8M, 32k untied vocabulary
        h, layers, inter, vocab = 1024, 24, 4096, 32000
    cfg = ModelConfig.from_hf(dict(
        model_type="llama", vocab_size=vocab, hidden_size=h, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=h // 64,
        num_key_value_heads=max(1, h // 256), head_dim=64, max_position_embeddings=4096,
        rms_norm_eps=1e-6, tie_word_embeddings=False), "bench_tiers")
    torch.manual_seed(0)
    return Decoder(cfg)


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _train_row(args, dev, tiers: int) -> dict:
    from orbitrl.train.logprobs import model_logprobs
    from orbitrl.train.optim import FusedSGD
    from orbitrl.train.residency import LayerResidency

    model = _model(args).train()
    model.recompute = True
    res = None
    if tiers:
        res = LayerResidency.on_device(model, dev, prefetch=tiers, copy_on_host=True,
                                       keep_timeline=False)
    else:
        model.to(dev)
    g = torch.Generator().manual_seed(1)
    V = model.config.vocab_size
    ids = torch.randint(0, V, (args.batch, args.seq), generator=g)
    tgt = torch.cat([ids[:, 1:], torch.full((args.batch, 1), -1)], 1)
    adv = torch.randn(args.batch, 1, generator=g)
    ids, tgt, adv = ids.to(dev), tgt.to(dev), adv.to(dev)
    n_tok = int((tgt >= 0).sum())
    opt = FusedSGD(list(model.parameters()), lr=1e-5)

    def closure():
        loss = -(model_logprobs(model, ids, tgt) * adv).sum() / n_tok
        loss.backward()
        return loss

    times, loss = [], None
    for i in range(args.steps):
        if i == 1:
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            if res is not None:
                res.reset_stats()
        _sync(dev)
        t0 = time.perf_counter()
        loss = opt.step(closure)
        _sync(dev)
        times.append(time.perf_counter() - t0)
    steps = max(1, args.steps - 1)
    out = dict(name=f"train, tiers k={tiers}" if tiers else "train, resident",
               step_s=sum(times[1:]) / steps, loss=float(loss.detach()))
    if dev.type == "cuda":
        out["peak"] = torch.cuda.max_memory_allocated(dev)
    elif res is None:  # on the host: the resident weights (the tiers' accounting's scope)
        out["peak"] = tensor_bytes(model)
    if res is not None:
        s = res.stats
        out.update(hits=s.hits / steps, misses=s.misses / steps,
                   from_host=s.bytes_from_host / steps, layers=s.peak_resident_layers)
        out.setdefault("peak", s.peak_device_bytes)
    del model, opt, res  # (the residency's hooks keep the model alive while it lives)
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _reference_row(args, dev, pulled: bool) -> dict:
    """A no-grad forward of an int8 reference (what scoring runs once per step)."""
    import tempfile

    from orbitrl.model.weights import save_pretrained
    from orbitrl.rl.policy import load_base
    from orbitrl.train.residency import LayerResidency

    with tempfile.TemporaryDirectory() as d:
        save_pretrained(_model(args), d)
        ref = load_base(d, "int8", "float32", "cpu" if pulled else dev)
    ref.requires_grad_(False)
    res = LayerResidency.on_device(ref, dev, prefetch=2, copy_on_host=True,
                                   keep_timeline=False) if pulled else None
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, ref.config.vocab_size, (args.batch, args.seq), generator=g).to(dev)
    times = []
    for i in range(args.steps):
        if i == 1:
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            if res is not None:
                res.reset_stats()
        _sync(dev)
        t0 = time.perf_counter()
        with torch.no_grad():
            ref(ids, return_hidden=True)
        _sync(dev)
        times.append(time.perf_counter() - t0)
    steps = max(1, args.steps - 1)
    out = dict(name="reference, pulled k=2" if pulled else "reference, resident",
               step_s=sum(times[1:]) / steps)
    if dev.type == "cuda":
        out["peak"] = torch.cuda.max_memory_allocated(dev)
    elif res is None:
        out["peak"] = tensor_bytes(ref)
    if res is not None:
        s = res.stats
        out.update(hits=s.hits / steps, misses=s.misses / steps,
                   from_host=s.bytes_from_host / steps, layers=s.peak_resident_layers)
        out.setdefault("peak", s.peak_device_bytes)
    del ref
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _table(rows: list[dict], base: dict) -> str:
    head = (f"{'configuration':<24} {'step s':>8} {'x time':>7} {'device peak MB':>15} "
            f"{'x peak':>7} {'host->dev MB/step':>18} {'hits':>6} {'misses':>7}")
    lines = [head]
    for r in rows:
        tail = ""
        if "hits" in r:
            tail = f" {r['from_host'] / MB:>18.1f} {r['hits']:>6.0f} {r['misses']:>7.0f}"
        lines.append(f"{r['name']:<24} {r['step_s']:>8.3f} {r['step_s'] / base['step_s']:>7.2f} "
                     f"{r['peak'] / MB:>15.0f} {r['peak'] / base['peak']:>7.2f}" + tail)
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--tiers", default="1,2,4", help="prefetch depths to run")
    args = ap.parse_args()
    name = args.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    print(f"device {dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'host'})"
          f", batch {args.batch} x {args.seq} tokens, {args.steps} steps (first dropped)")
    train = [_train_row(args, dev, 0)]
    train += [_train_row(args, dev, int(k)) for k in args.tiers.split(",") if int(k) > 0]
    for r in train[1:]:
        assert abs(r["loss"] - train[0]["loss"]) <= 1e-3 * abs(train[0]["loss"]) + 1e-5, \
            f"{r['name']}: loss {r['loss']} against {train[0]['loss']} resident"
    print(_table(train, train[0]))
    ref = [_reference_row(args, dev, False), _reference_row(args, dev, True)]
    print(_table(ref, ref[0]))


if __name__ == "__main__":
    main()
