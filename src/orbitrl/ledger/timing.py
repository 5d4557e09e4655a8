"""Where a step's time goes: the bandwidth ledger's transfers feeding the schedule simulator.

Per device and per step: the all-gathers and reduce-scatters of sharded training, host pulls
(a host-resident reference, offloaded optimizer or weights), the re-layout between training
shards and the generation layout, and (for separate pools) the weight sync. Transfers that
prefetch can overlap with compute are hidden up to that compute; the rest is exposed and
added to the phase that waits for it. Seconds throughout.

Micro steps: a step's sequences are packed into micro batches of ``micro_batch x seq_len``
tokens per tp group, so each data-parallel rank runs ``ceil(step tokens / (dp x micro
tokens))`` micro steps. Each micro step gathers every sharded layer once in its forward and
once in its backward (and scoring once in its forward); a replicated frozen base, or
``dp == 1``, gathers nothing. With the stateless update each micro step's backward also
applies the update (a PPO mini-batch per micro step: no gradient is accumulated anywhere).
"""

from __future__ import annotations

import math

from orbitrl.ledger.bandwidth import (Links, allreduce_bytes, hide_behind, ring_gather_bytes, summarize,
                                      sync_transfer, train_compute_seconds, transfer)
from orbitrl.ledger.dispatch import rollout_ops, score_ops, train_ops, train_ops_outside_layers
from orbitrl.ledger.memory import (PARAM_BYTES, ROW_TOKENS, Strategy, Workload, kv_cache_bytes,
                                   shares_prompt, state_bytes)
from orbitrl.ledger.models import ModelShape
from orbitrl.ledger.schedule import LengthDist, StepWork, balance_ratio, compare

MAX_AUTO_MICRO_BATCH = 64  # sequences; the auto micro batch never asks for more


def _lengths(work: Workload, options) -> tuple[int, ...]:
    if work.reply_len:  # the typical reply, and the long tail beyond it
        reply = min(work.reply_len, work.completion_len)
        dist = LengthDist(work.samples_per_step, reply, options.tail_fraction,
                          cap=work.completion_len)
        return tuple([reply] * (dist.num_seqs - dist.num_tail) + [dist.tail_len] * dist.num_tail)
    body = max(1, round(work.completion_len * (1 - options.tail_fraction)))
    dist = LengthDist(work.samples_per_step, body, options.tail_fraction, cap=work.completion_len)
    return tuple(dist.lengths())


def packed_tokens(work: Workload, lengths: tuple[int, ...]) -> int:
    """Positions the trainer computes for these completions: a group of ``group_size``
    samples holds one copy of its prompt where ``shares_prompt`` lays it out so (its
    prompt and completions fit one row of ``max(longest sample, ROW_TOKENS)``, or its
    attention costs no more than its samples' own rows); other samples their own."""
    P, g = work.prompt_len, max(1, work.group_size)
    width = max(P + max(lengths), ROW_TOKENS)
    total = 0
    for i in range(0, len(lengths), g):
        grp = lengths[i:i + g]
        total += P + sum(grp) if shares_prompt(P, list(grp), width) else sum(P + x for x in grp)
    return total


def _gathered_bytes(shape: ModelShape, strategy: Strategy) -> float:
    """Bytes of every gathered layer (routed experts excluded) in the stored format."""
    return shape.gathered_layer_params * shape.num_layers * strategy.bytes_per_param()


def micro_comm(shape: ModelShape, strategy: Strategy, links: Links, options, devices: int,
               tp: int, replicated: bool = False) -> dict:
    """Bytes one device moves per training micro step (forward and backward), by link.

    ``{"interconnect": B, "host": B}``: the layer gathers of sharded weights (forward and
    backward), the gradients' reduce-scatter (full-parameter strategies) and, with
    ``offload >= 2``, the cold layers pulled from the host in both passes.
    """
    dp = max(1, devices // tp)
    roles = options.roles
    models = 2 if roles.critic else 1
    ic = host = 0.0
    rep = replicated and strategy.kind == "adapter" and roles.offload < 2
    if dp > 1 and not rep:
        ic += 2 * ring_gather_bytes(_gathered_bytes(shape, strategy) / tp, dp) * models
    if dp > 1 and strategy.kind != "adapter":
        g = shape.gathered_layer_params * shape.num_layers * PARAM_BYTES[strategy.grad_dtype]
        ic += ring_gather_bytes(g / tp, dp) * models
    if roles.offload >= 2:
        host += 2 * state_bytes(shape, strategy).weights / devices
    return {"interconnect": ic, "host": host}


def auto_micro_batch(shape: ModelShape, strategy: Strategy, work: Workload, links: Links,
                     options, devices: int, tp: int, replicated: bool = False) -> int:
    """The fewest sequences per micro step whose forward+backward compute hides that micro
    step's gathers and reduce-scatter (1 when nothing is gathered, or when nothing can be
    hidden because ``prefetch_depth`` is 0), at most the rank's share of the step and
    :data:`MAX_AUTO_MICRO_BATCH`. Memory may lower it further (the planner's fit)."""
    c = micro_comm(shape, strategy, links, options, devices, tp, replicated)
    comm_s = c["interconnect"] / (links.interconnect_gbps * 1e9) + c["host"] / (links.host_gbps * 1e9)
    if comm_s <= 0 or options.prefetch_depth < 1:
        return 1
    models = 2 if options.roles.critic else 1
    per_token_s = train_compute_seconds(shape.active_params, 1, work.recompute, links,
                                        strategy.kind == "adapter") * models / tp
    tokens = comm_s / per_token_s
    dp = max(1, devices // tp)
    share = math.ceil(work.samples_per_step / dp)
    return max(1, min(math.ceil(tokens / work.seq_len), share, MAX_AUTO_MICRO_BATCH))


def _head_seconds(shape: ModelShape, completion_tokens: int, frozen: bool, links: Links) -> float:
    """The output layer in training, over the completion positions only (the loss reads
    nothing else): chunked logprobs' forward, its backward's recomputed logits and input
    gradient (and the weight gradient when the head trains), plus ~6 passes over the
    [tokens, vocab] tiles (exp, the softmax's gradient) at copy bandwidth."""
    vh = shape.vocab * shape.hidden * completion_tokens
    flops = (6 if frozen else 8) * vh
    return flops / (links.device_tflops * 1e12) + 6 * 4 * completion_tokens * shape.vocab / (
        links.hbm_gbps * 1e9)


def bandwidth_bill(shape: ModelShape, strategy: Strategy, work: Workload, links: Links, options,
                   devices: int, tp: int, replicated: bool = False) -> dict:
    """Transfers per device per step and the compute they hide behind (no schedule).

    Returns ``{"transfers", "exposed_s", "train_s", "score_s", "forward_s", "micro_steps",
    "tokens", "lengths", "sync"}``; ``train_s``/``score_s`` are per-device compute seconds,
    ``forward_s`` the device-seconds of one policy forward over the step's tokens.
    """
    n, roles = devices, options.roles
    dp = max(1, n // tp)
    st = state_bytes(shape, strategy)
    adapter = shape.adapter_params(strategy.adapter_rank) if strategy.kind == "adapter" else 0
    rep = replicated and strategy.kind == "adapter" and roles.offload < 2

    lengths = _lengths(work, options)
    tokens = packed_tokens(work, lengths)
    micro = math.ceil(tokens / (dp * work.micro * work.seq_len))  # packed micro steps per rank
    models = 2 if roles.critic else 1

    if links.train_layer_token_s > 0:  # the layers as timed at the model's widths, the head apart
        micro = max(micro, links.train_workers)  # cut into at least one part per worker
        train_s = (tokens * shape.num_layers * links.train_layer_token_s
                   + _head_seconds(shape, sum(lengths), strategy.kind == "adapter", links)) * models / n
        train_s += links.host_seconds("train", train_ops_outside_layers(
            strategy.kind, shape.num_layers, micro)) * models
    else:
        train_s = train_compute_seconds(shape.active_params, tokens, work.recompute, links,
                                        strategy.kind == "adapter") * models / n
        train_s += links.host_seconds("train", train_ops(strategy.kind, shape.num_layers, micro)) * models
    fwd = 2 * shape.active_params * tokens / (links.device_tflops * 1e12)
    # old logprobs, reference, values; one epoch's old logprobs come from the update's own
    # forward (rl/score.py old_from_update), except for PPO and a fused update over several
    # micro-batches or ranks
    old = roles.critic or (strategy.kind == "stateless" and (micro > 1 or n > 1))
    passes = old + (roles.reference != "none") + roles.critic
    score_s = (fwd * passes + 2 * roles.reward_params * tokens / (links.device_tflops * 1e12)) / n
    score_s += links.host_seconds("score", score_ops(shape.num_layers, micro, passes))
    hide_train = train_s if options.prefetch_depth >= 1 else 0.0
    hide_score = score_s if options.prefetch_depth >= 1 else 0.0

    train_t, score_t, other_t = [], [], []  # transfers overlapping training, scoring, nothing
    ic = links.interconnect_gbps
    gathered = _gathered_bytes(shape, strategy)
    if n > 1:
        if dp > 1 and not rep:
            gather = ring_gather_bytes(gathered / tp, dp)  # one pass over every layer
            train_t.append(transfer("train all-gather", "interconnect", 2 * micro * gather * models, ic))
            score_models = 1 if strategy.kind == "adapter" else models  # critic shares an adapter base
            score_t.append(transfer("score all-gather", "interconnect", micro * gather * score_models, ic))
        if strategy.kind == "adapter":
            other_t.append(transfer("adapter grad all-reduce", "interconnect",
                                    allreduce_bytes(2 * adapter * models, n), ic))
            # the frozen base never moves: its training shards double as the generation layout
            other_t.append(transfer("re-layout train<->generate (adapters)", "interconnect",
                                    2 * 2 * adapter * models / n, ic))
        else:
            if dp > 1:
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
    mode = options.sync if options.sync != "auto" else ("adapter" if adapter else "full")
    frac = shape.changed_fraction if options.changed_fraction is None else options.changed_fraction
    sync = sync_transfer(mode, st.weights, 2 * adapter, frac, links, senders=max(1, n // 2))
    return {"transfers": t, "exposed_s": sum(x.exposed for x in t), "train_s": train_s,
            "score_s": score_s, "forward_s": fwd, "micro_steps": micro, "tokens": tokens,
            "lengths": lengths, "old_pass": bool(old),
            "sync": sync}


def step_timing(shape: ModelShape, strategy: Strategy, work: Workload, links: Links, options,
                devices: int, tp: int, replicated: bool = False, rollout: dict | None = None) -> dict:
    """Bandwidth bill, four schedule shapes and the colocated breakdown, JSON-able.

    ``rollout``: the generation layout per device, ``{"weights_bytes", "kv_bytes",
    "concurrent_seqs"}`` (resident weights and KV pool per device, sequences decoding at once
    in the cluster); default: weights sharded over all devices and the workload's reserve.
    """
    n, roles = devices, options.roles
    st = state_bytes(shape, strategy)
    bw = bandwidth_bill(shape, strategy, work, links, options, n, tp, replicated)
    lengths, tokens, exposed, sync = bw["lengths"], bw["tokens"], bw["exposed_s"], bw["sync"]
    train_s, score_s = bw["train_s"], bw["score_s"]

    if rollout is None:
        seqs = work.kv_reserve_seqs(n)
        rollout = {"weights_bytes": st.weights / n, "concurrent_seqs": seqs,
                   "kv_bytes": kv_cache_bytes(shape, seqs, work.seq_len, work.kv_dtype,
                                              work.block_size) / n}
    slots = max(1, math.ceil(rollout["concurrent_seqs"] / n))
    read = rollout["weights_bytes"] * (shape.active_params / shape.total_params) + rollout["kv_bytes"]
    # one engine step: the weights and KV read once (bandwidth) or the batch's FLOPs
    # (compute), whichever is longer, plus the ops it dispatches
    flops = 2 * shape.active_params * slots
    decode_s = max(read / (links.hbm_gbps * 1e9), flops / (links.device_tflops * 1e12))
    quantized = strategy.kind == "adapter" and strategy.base_dtype not in ("bf16", "fp32")
    decode_s += links.host_seconds("rollout", rollout_ops(strategy.kind, quantized, shape.num_layers))
    if roles.offload >= 2:
        decode_s += st.weights / n / (links.host_gbps * 1e9)
    # the prompts' prefill: every sequence's prompt through the layers (the head runs at its
    # last position only), compute bound; prefix-cache hits within a group are not counted
    body = shape.active_params - shape.vocab * shape.hidden
    prefill = 2 * body * work.prompt_len * work.samples_per_step / (links.device_tflops * 1e12)
    # scoring's first forward recomputes the sampling policy's logprobs (async's proximal pass)
    step = StepWork(lengths, slots, decode_s, score_s * n, train_s * n, sync.seconds, exposed * n,
                    prompt_len=work.prompt_len, forward_device_s=bw["forward_s"],
                    scoring_recomputes=bw["old_pass"], prefill_device_s=prefill)
    shapes = compare(step, n, options.staleness)
    colo = shapes["colocated"]
    ratio = balance_ratio(shapes)
    return {
        "bandwidth": summarize(bw["transfers"] + [sync]),
        "decode_step_s": decode_s,
        "tokens_per_step": tokens,
        "max_completion": max(lengths),
        "micro_steps_per_rank": bw["micro_steps"],
        "rollout_slots_per_device": slots,
        "breakdown": {"rollout_s": colo.rollout_s, "score_s": score_s, "train_s": train_s,
                      "exposed_comm_s": exposed, "step_s": colo.step_s},
        "shapes": {k: v.as_dict() for k, v in shapes.items()},
        "balance": {"rollout_devices": ratio[0], "train_devices": ratio[1]} if ratio else None,
    }
