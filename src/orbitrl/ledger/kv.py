"""KV-cache bytes: the one formula the engine (pool sizing) and the planner share."""

from __future__ import annotations

import math

# bytes per stored element
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
               "fp8": 1, "float8_e4m3fn": 1, "int8": 1}


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str,
                       scale_bytes_per_head: int = 0) -> int:
    """Bytes of K and V for one token across all layers.

    fp8 storage keeps one fp32 scale per (token, kv head) for K and for V, passed as
    ``scale_bytes_per_head`` (4 for that scheme, 0 for unscaled storage).
    """
    elem = DTYPE_BYTES[kv_dtype]
    return 2 * num_layers * num_kv_heads * (head_dim * elem + scale_bytes_per_head)


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                       kv_dtype: str, scale_bytes_per_head: int = 0) -> int:
    """Bytes of one KV block (``block_size`` token slots, all layers, K and V)."""
    return block_size * kv_bytes_per_token(num_layers, num_kv_heads, head_dim, kv_dtype,
                                           scale_bytes_per_head)


def kv_blocks_for_budget(budget_bytes: int, block_bytes: int) -> int:
    """How many whole blocks fit a byte budget."""
    if block_bytes <= 0:
        raise ValueError("block_bytes must be positive")
    return max(0, budget_bytes // block_bytes)


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)
