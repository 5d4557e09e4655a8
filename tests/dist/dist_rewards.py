"""A reward that a random model earns unevenly (the share of digits in its completion), so
GRPO groups have non-zero advantages and the multi-process tests train on a real signal."""


def digits(prompt: str, completion: str, **fields) -> float:
    return sum(c.isdigit() for c in completion) / max(1, len(completion))
