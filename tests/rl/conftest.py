import signal

import pytest

# The RL loop runs the engine, a producer thread (overlapped mode) and reward workers: a
# deadlock must fail the test, not stall the suite. Generous: the machine is shared.
HARD_LIMIT_S = 600


@pytest.fixture(autouse=True)
def hard_timeout():
    def on_alarm(signum, frame):
        raise TimeoutError(f"test exceeded the hard limit of {HARD_LIMIT_S} s (deadlock?)")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(HARD_LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
