"""Where a step's time goes: the bandwidth ledger's transfers feeding the schedule simulator.

Per device and per step: the all-gathers and reduce-scatters of sharded training, host pulls
(a host-resident reference, offloaded optimizer or weights), the re-layout between training
shards and the generation layout, and (for separate pools) the weight sync. Transfers that
prefetch can overlap with compute are hidden up to that compute; the rest is exposed and
added to the phase that waits for it. Seconds throughout.
"""

from __future__ import annotations

import math

from orbitrl.ledger.bandwidth import (Links, allreduce_bytes, hide_behind, ring_gather_bytes, summarize,
                                      sync_transfer, train_compute_seconds, transfer)
from orbitrl.ledger.memory import PARAM_BYTES, Strategy, Workload, kv_cache_bytes, state_bytes
from orbitrl.ledger.models import ModelShape
from orbitrl.ledger.schedule import LengthDist, StepWork, balance_ratio, compare


def step_timing(shape: ModelShape, strategy: Strategy, work: Workload, links: Links, options,
                devices: int, tp: int) -> dict:
    """Bandwidth bill, four schedule shapes and the colocated breakdown, JSON-able."""
    n, roles = devices, options.roles
    dp = max(1, n // tp)
    st = state_bytes(shape, strategy)
    wdtype = strategy.base_dtype if strategy.kind == "adapter" else strategy.weight_dtype
    gathered = shape.gathered_layer_params * shape.num_layers * PARAM_BYTES[wdtype]
    adapter = shape.adapter_params(strategy.adapter_rank) if strategy.kind == "adapter" else 0

    body = max(1, round(work.completion_len * (1 - options.tail_fraction)))
    dist = LengthDist(work.samples_per_step, body, options.tail_fraction, cap=work.completion_len)
    lengths = tuple(dist.lengths())
    tokens = sum(work.prompt_len + x for x in lengths)
    micro = math.ceil(work.samples_per_step / (dp * work.micro_batch))
    models = 2 if roles.critic else 1

    train_s = train_compute_seconds(shape.active_params, tokens, work.recompute, links) * models / n
    fwd = 2 * shape.active_params * tokens / (links.device_tflops * 1e12)
    passes = 1 + (roles.reference != "none") + roles.critic  # old logprobs, reference, values
    score_s = (fwd * passes + 2 * roles.reward_params * tokens / (links.device_tflops * 1e12)) / n
    hide_train = train_s if options.prefetch_depth >= 1 else 0.0
    hide_score = score_s if options.prefetch_depth >= 1 else 0.0

    train_t, score_t, other_t = [], [], []  # transfers overlapping training, scoring, nothing
    ic = links.interconnect_gbps
    if n > 1:
        train_t.append(transfer("train all-gather", "interconnect",
                                2 * micro * ring_gather_bytes(gathered / tp, dp) * models, ic))
        score_t.append(transfer("score all-gather", "interconnect",
                                micro * ring_gather_bytes(gathered / tp, dp), ic))
        if strategy.kind == "adapter":
            other_t.append(transfer("adapter grad all-reduce", "interconnect",
                                    allreduce_bytes(2 * adapter, n), ic))
        else:
            g = shape.gathered_layer_params * shape.num_layers * PARAM_BYTES[strategy.grad_dtype]
            train_t.append(transfer("grad reduce-scatter", "interconnect",
                                    micro * ring_gather_bytes(g / tp, dp) * models, ic))
        other_t.append(transfer("re-layout train<->generate", "interconnect", 2 * st.weights / n, ic))
    if strategy.kind != "adapter" and roles.reference == "host":
        ref = shape.total_params * PARAM_BYTES[roles.ref_dtype]
        score_t.append(transfer("reference pull (host)", "host", ref / tp, links.host_gbps))
    if roles.offload >= 1:
        other_t.append(transfer("optimizer offload (grads down, weights up)", "host",
                                (st.weights + max(st.grads, st.weights)) / n, links.host_gbps))
    if roles.offload >= 2:
        train_t.append(transfer("cold weight pulls (host)", "host", 2 * micro * st.weights / n,
                                links.host_gbps))
        score_t.append(transfer("cold weight pulls (host)", "host", micro * st.weights / n,
                                links.host_gbps))
    t = hide_behind(train_t, hide_train) + hide_behind(score_t, hide_score) + other_t
    exposed = sum(x.exposed for x in t)

    mode = options.sync if options.sync != "auto" else ("adapter" if adapter else "full")
    sync = sync_transfer(mode, st.weights, 2 * adapter, options.changed_fraction, links,
                         senders=max(1, n // 2))
    slots = max(1, math.ceil(work.rollout_seqs / n))
    kv = kv_cache_bytes(shape, work.rollout_seqs, work.seq_len, work.kv_dtype, work.block_size) / n
    read = st.weights / n * (shape.active_params / shape.total_params) + kv
    decode_s = read / (links.hbm_gbps * 1e9)
    if roles.offload >= 2:
        decode_s += st.weights / n / (links.host_gbps * 1e9)
    step = StepWork(lengths, slots, decode_s, score_s * n, train_s * n, sync.seconds, exposed * n)
    shapes = compare(step, n, options.staleness)
    colo = shapes["colocated"]
    ratio = balance_ratio(shapes)
    return {
        "bandwidth": summarize(t + [sync]),
        "decode_step_s": decode_s,
        "tokens_per_step": tokens,
        "max_completion": max(lengths),
        "breakdown": {"rollout_s": colo.rollout_s, "score_s": score_s, "train_s": train_s,
                      "exposed_comm_s": exposed, "step_s": colo.step_s},
        "shapes": {k: v.as_dict() for k, v in shapes.items()},
        "balance": {"rollout_devices": ratio[0], "train_devices": ratio[1]} if ratio else None,
    }
