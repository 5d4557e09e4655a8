"""A reward that a random model earns unevenly (the share of digits in its completion), so
GRPO groups have non-zero advantages and the multi-process tests train on a real signal."""


def digits(prompt: str, completion: str, **fields) -> float:
    return sum(c.isdigit() for c in completion) / max(1, len(completion))


def digits_but_flat_on_rank1(prompt: str, completion: str, **fields) -> float:
    """``digits`` on every rank but rank 1, where every sample scores 0: with dynamic
    sampling rank 1 then keeps no group at all while rank 0 trains."""
    import os

    return 0.0 if os.environ.get("RANK") == "1" else digits(prompt, completion)


def slow_digits(prompt: str, completion: str, **fields) -> float:
    """``digits``, 1.5 s a call: judging a step of 16 samples (4 at a time) keeps the
    training leader busy for 6 s while a separated rollout rank sits idle."""
    import time

    time.sleep(1.5)
    return digits(prompt, completion)
