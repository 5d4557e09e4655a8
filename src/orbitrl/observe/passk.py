"""pass@k: the unbiased estimator of Chen et al. (2021) from n samples per problem.

For one problem with n samples of which c are correct, the probability that at least one
of k samples drawn without replacement is correct is 1 - C(n-c, k) / C(n, k). The binomials
overflow floats for large n, so the ratio is computed as the product
prod_{i=n-c+1}^{n} (1 - k / i), which stays in [0, 1].
"""

from __future__ import annotations

import math


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem.

    Args:
        n: samples drawn; c: correct ones (0 <= c <= n); k: 1 <= k <= n.

    Raises:
        ValueError: counts out of range (k > n would need samples that were not drawn).
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, "
                         f"k={k})")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_pass_at_k(counts: list[tuple[int, int]], k: int) -> float:
    """Mean pass@k over problems given as (n, c) pairs; problems with n < k are refused
    (ValueError), not skipped, so the mean is over every problem."""
    if not counts:
        return 0.0
    return sum(pass_at_k(n, c, k) for n, c in counts) / len(counts)
