import signal

import pytest

# A sandbox bug could hang a test (a pipe never closing, a process never reaped). Every test
# here gets a hard limit, generous because the machine is shared and noisy: a hang fails
# instead of stalling the suite.
HARD_LIMIT_S = 300


@pytest.fixture(autouse=True)
def hard_timeout():
    def on_alarm(signum, frame):
        raise TimeoutError(f"test exceeded the hard limit of {HARD_LIMIT_S} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(HARD_LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
