"""What the paged attention paths share, below all of them: the fp8 e4m3 KV format
(``dequantize``, used by ``KVCache``, the torch reference kernels and the decode runner's
reference), the split-K count of the paged decode kernel (``auto_splits``, used by the
Triton kernel and the decode runner) and the kernels' refusal of soft-capped scores
(``SOFTCAP_REFUSED``) and of latent KV rows (``LATENT_REFUSED``). Torch only: no Triton, no
other engine module, so ``paged_attention``, ``attention_kernels`` and ``triton_attention``
all import it without importing each other in a circle.
"""

from __future__ import annotations

from functools import lru_cache

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# the paged kernels have no attention soft-capping: a model with it (Gemma 2) attends with
# the torch reference, and asking for the kernels is refused with this line
SOFTCAP_REFUSED = ("attention backend 'triton': the paged kernels have no attention "
                   "soft-capping (config.json attn_logit_softcapping); use 'torch'")
# nor multi-head latent attention's cache of latent rows (DeepSeek-V3), expanded per step
LATENT_REFUSED = ("attention backend 'triton': the paged kernels do not read multi-head "
                  "latent attention's latent KV rows (config.json kv_lora_rank); use 'torch'")


@lru_cache(maxsize=None)
def _fp8_table() -> torch.Tensor:
    """The 256 fp8 e4m3 values as fp32, on the CPU."""
    with torch.inference_mode(False):
        return torch.arange(256, dtype=torch.uint8, device="cpu").view(FP8).float()


def dequantize(bits: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 e4m3 KV stored as uint8 ``bits`` [..., D] times their fp32 ``scale`` [..., 1],
    in ``dtype``. On a CPU the fp8 -> fp32 step is a lookup in a 256-entry table (the same
    values as ``bits.view(float8_e4m3fn).float()``, NaN codes included): PyTorch's CPU
    conversion is scalar, 1.0 ms for the K of a 32-row decode step of the benchmark model
    against 0.2 ms for the lookup."""
    if bits.device.type == "cpu":
        codes = bits.reshape(-1).view(torch.uint8).int()  # the bits, whatever the view
        vals = _fp8_table().index_select(0, codes).view(bits.shape)
    else:
        vals = bits.view(FP8).float()
    return (vals * scale).to(dtype)


def auto_splits(batch: int, num_kv_heads: int, max_context: int, device) -> int:
    """Key splits per (row, kv head) so that a small batch still fills the GPU: 1 when the
    batch alone gives every SM a program, else up to 16 splits of at least 512 keys."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = batch * num_kv_heads
    if programs >= sms:
        return 1
    return max(1, min(-(-2 * sms // programs), -(-max_context // 512), 16))
