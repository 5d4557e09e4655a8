"""KV-cache bytes: the one formula the engine (pool sizing) and the planner share."""

from __future__ import annotations

import math

# bytes per stored element
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
               "fp8": 1, "float8_e4m3fn": 1, "int8": 1}


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str,
                       scale_bytes_per_head: int = 0, latent_dim: int = 0) -> int:
    """Bytes of K and V for one token across all layers.

    fp8 storage keeps one fp32 scale per (token, kv head) for K and for V, passed as
    ``scale_bytes_per_head`` (4 for that scheme, 0 for unscaled storage). ``latent_dim``
    (multi-head latent attention, DeepSeek-V3): each layer keeps one row of that many
    values per token (kv_lora_rank + qk_rope_head_dim: the compressed KV and the rotary
    key), with one scale under fp8, instead of K and V per kv head.
    """
    elem = DTYPE_BYTES[kv_dtype]
    if latent_dim:
        return num_layers * (latent_dim * elem + scale_bytes_per_head)
    return 2 * num_layers * num_kv_heads * (head_dim * elem + scale_bytes_per_head)


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                       kv_dtype: str, scale_bytes_per_head: int = 0,
                       latent_dim: int = 0) -> int:
    """Bytes of one KV block (``block_size`` token slots, all layers, K and V)."""
    return block_size * kv_bytes_per_token(num_layers, num_kv_heads, head_dim, kv_dtype,
                                           scale_bytes_per_head, latent_dim)


def kv_blocks_for_budget(budget_bytes: int, block_bytes: int) -> int:
    """How many whole blocks fit a byte budget."""
    if block_bytes <= 0:
        raise ValueError("block_bytes must be positive")
    return max(0, budget_bytes // block_bytes)


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)


def waiting_kv_bytes(contexts: list[int], block_size: int, block_bytes: int,
                     kv_wait: str) -> dict:
    """The bill of trajectories parked while their environments run, each holding
    ``contexts[i]`` tokens of KV: ``device`` bytes (whole blocks, resident) and ``host``
    bytes (the computed tokens only, swapped out), by ``kv_wait`` ("resident" or "swap").
    Per turn and trajectory, swapping moves ``host`` bytes out and back (the bandwidth
    bill); keeping them resident costs ``device`` bytes of the pool for the whole wait."""
    if kv_wait not in ("resident", "swap"):
        raise ValueError(f"kv_wait {kv_wait!r}: resident or swap")
    per_token = block_bytes // block_size
    resident = sum(blocks_for_tokens(c, block_size) for c in contexts) * block_bytes
    host = sum(contexts) * per_token
    if kv_wait == "resident":
        return {"device": resident, "host": 0, "moved": 0}
    return {"device": 0, "host": host, "moved": 2 * host}
