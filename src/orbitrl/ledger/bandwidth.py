"""Bandwidth ledger: bytes moved per step, on which link, and how much of it compute hides.

Units: bytes, seconds, and link speeds in GB/s (1e9 bytes per second). A transfer
overlapping compute (prefetched ``prefetch_depth >= 1`` layers ahead) is hidden up to the
compute time it runs beside; with no prefetch it is all exposed (the measured 6x slowdown
of offload without prefetch, against 1.8x with it).
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Links:
    """Per-device link and compute speeds.

    Args:
        interconnect_gbps: device<->device for collectives (all-gather, reduce-scatter).
        host_gbps: host<->device (PCIe) for offload and host-resident layers.
        sync_gbps: trainer -> separate rollout pool, per device, for weight sync.
        device_tflops: sustained bf16 dense throughput per device (not peak).
        hbm_gbps: device memory bandwidth (decode is bound by it).
        bucket_mb: weight-sync bucket size; bucket_latency_s: fixed cost per bucket.
        op_us: host microseconds per framework op the step dispatches (Python, the
            dispatcher, a kernel launch), paid on top of the op's own compute: the floor of a
            small model's step (ledger/dispatch.py counts the ops). 0 (default): launches
            overlap the device's work, as in a graph-captured decode on an accelerator.
        host: per-phase costs per op (``ledger.dispatch.HostCost``) in place of ``op_us``:
            a CPU's, measured by ``orbitrl plan --this-machine``.
        train_layer_token_s: seconds one decoder layer's forward + backward adds per trained
            token (amortised over the micro-batches trained side by side), timed at the
            model's widths (``observe/calibrate.py`` ``layer_token_seconds``); the training
            phase then prices its layers by it instead of by FLOPs and per-layer op costs.
            0 (default): FLOPs at ``device_tflops`` plus the host's op costs.
        train_workers: micro-batches trained side by side on one device (a CPU's
            ``train.workers``): with ``train_layer_token_s`` the batch is cut into at least
            that many.
    """

    interconnect_gbps: float = 50.0
    host_gbps: float = 25.0
    sync_gbps: float = 25.0
    device_tflops: float = 400.0
    hbm_gbps: float = 3000.0
    bucket_mb: float = 512.0
    bucket_latency_s: float = 0.002
    op_us: float = 0.0
    host: object = None  # ledger.dispatch.HostCost
    train_layer_token_s: float = 0.0
    train_workers: int = 1

    def __post_init__(self):
        for k, v in self.__dict__.items():
            if k != "host" and (v < 0 or (v == 0 and k not in ("op_us", "train_layer_token_s"))):
                raise ValueError(f"{k} must be positive")

    def host_seconds(self, phase: str, ops: tuple[int, int]) -> float:
        """Host seconds of ``ops`` (fixed, per-layer) dispatched in ``phase``."""
        if self.host is not None:
            return self.host.seconds(phase, ops)
        return (ops[0] + ops[1]) * self.op_us * 1e-6


@dataclass(frozen=True)
class Transfer:
    """One stream of bytes per step: ``seconds`` on its link, ``exposed`` not hidden."""

    name: str
    link: str
    bytes: int
    seconds: float
    exposed: float


def transfer(name: str, link: str, nbytes: float, gbps: float, overlap_s: float = 0.0) -> Transfer:
    """A transfer of ``nbytes`` at ``gbps``, hidden behind up to ``overlap_s`` of compute."""
    t = nbytes / (gbps * GB)
    return Transfer(name, link, int(nbytes), t, max(0.0, t - overlap_s))


def hide_behind(transfers: list[Transfer], compute_s: float) -> list[Transfer]:
    """Transfers sharing one span of compute: together they hide at most ``compute_s``."""
    out, left = [], compute_s
    for t in transfers:
        hidden = min(t.seconds, left)
        left -= hidden
        out.append(Transfer(t.name, t.link, t.bytes, t.seconds, t.seconds - hidden))
    return out


def ring_gather_bytes(total_bytes: float, n: int) -> float:
    """Bytes one device receives to all-gather (or sends to reduce-scatter) ``total_bytes``."""
    return total_bytes * (n - 1) / n if n > 1 else 0.0


def allreduce_bytes(total_bytes: float, n: int) -> float:
    """Ring all-reduce: reduce-scatter plus all-gather, per device."""
    return 2 * ring_gather_bytes(total_bytes, n)


def sync_transfer(mode: str, weight_bytes: float, adapter_bytes: float, changed_fraction: float,
                  links: Links, senders: int = 1) -> Transfer:
    """Weight sync from the trainer to a separate rollout pool, bucketed.

    ``mode``: ``full`` (the whole model), ``adapter`` (adapters only, the base is shared),
    ``changed`` (only the parameters that changed, ``changed_fraction`` of the weights),
    ``none`` (colocated: the same modules serve both, nothing moves). ``senders`` devices push
    disjoint shards in parallel.
    """
    nbytes = {"full": weight_bytes, "adapter": adapter_bytes,
              "changed": weight_bytes * changed_fraction, "none": 0.0}[mode]
    per_sender = nbytes / max(1, senders)
    buckets = -(-per_sender // (links.bucket_mb * 1e6)) if per_sender else 0
    t = per_sender / (links.sync_gbps * GB) + buckets * links.bucket_latency_s
    return Transfer(f"weight sync ({mode})", "sync", int(nbytes), t, t)


def train_compute_seconds(active_params: int, tokens: float, recompute: bool,
                          links: Links, frozen: bool = False) -> float:
    """Forward+backward device-seconds: 6 flops/param/token, 8 with recompute.

    ``frozen``: the weights train no gradient of their own (an adapter's base): the backward
    computes only input gradients, 4 flops/param/token, 6 with recompute (adapters: noise).
    """
    per = (2 if recompute else 0) + (4 if frozen else 6)
    return per * active_params * tokens / (links.device_tflops * 1e12)


def summarize(transfers: list[Transfer]) -> dict:
    """JSON-able bill: each transfer plus totals of bytes, link seconds and exposed seconds."""
    return {
        "transfers": [t.__dict__ for t in transfers],
        "total_bytes": sum(t.bytes for t in transfers),
        "total_seconds": sum(t.seconds for t in transfers),
        "exposed_seconds": sum(t.exposed for t in transfers),
    }
