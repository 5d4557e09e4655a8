"""Memory-lean training: chunked logprobs, stateless optimizers fused into backward,
parameter tiers with prefetch (see docs/training.md)."""

from orbitrl.train.logprobs import model_logprobs, token_logprobs
from orbitrl.train.optim import (FusedAdaLomo, FusedOptimizer, FusedSGD, FusedStats,
                                 build_optimizer, is_fused)
from orbitrl.train.residency import LayerResidency, TierStats

__all__ = ["token_logprobs", "model_logprobs", "FusedOptimizer", "FusedSGD", "FusedAdaLomo",
           "FusedStats", "build_optimizer", "is_fused", "LayerResidency", "TierStats"]
