"""The unbiased pass@k estimator against hand-computed values."""

import math

import pytest

from orbitrl.observe.passk import mean_pass_at_k, pass_at_k


@pytest.mark.parametrize("n, c, k, want", [
    (10, 1, 1, 0.1),                 # c / n
    (10, 3, 1, 0.3),
    (10, 0, 10, 0.0),                # nothing right
    (10, 1, 10, 1.0),                # all 10 drawn: the right one is among them
    (10, 2, 5, 1 - 56 / 252),        # 1 - C(8,5)/C(10,5) = 0.7777...
    (5, 2, 2, 1 - 3 / 10),           # 1 - C(3,2)/C(5,2) = 0.7
    (4, 1, 2, 0.5),                  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (3, 2, 2, 1.0),                  # n - c < k
])
def test_pass_at_k_matches_hand_computed_values(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)


def test_large_n_is_stable_and_equals_the_binomial_form():
    n, c, k = 200, 13, 100
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)  # Python ints: exact, then one division
    assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12)
    assert 0.0 <= pass_at_k(2000, 1, 1000) <= 1.0
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5, abs=1e-12)


def test_mean_over_problems_and_bad_counts():
    assert mean_pass_at_k([(10, 1), (10, 3)], 1) == pytest.approx(0.2)
    assert mean_pass_at_k([], 1) == 0.0
    for bad in [(5, 6, 1), (5, 1, 6), (5, 1, 0), (5, -1, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)
