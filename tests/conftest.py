import os

import pytest
import torch

torch.set_num_threads(int(os.environ.get("ORBITRL_TEST_THREADS", "1")))

from hf_helpers import FAMILY_CONFIGS, make_hf_model  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are collected everywhere and skipped where CUDA is missing."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def needs_sandbox():
    """Skips a test where the code reward's sandbox cannot run (no bwrap, no user namespaces):
    use with ``pytestmark = pytest.mark.usefixtures("needs_sandbox")``."""
    from orbitrl.config import SandboxSection
    from orbitrl.errors import OrbitError
    from orbitrl.rewards.sandbox import Sandbox

    try:
        Sandbox(SandboxSection())
    except OrbitError as e:
        pytest.skip(f"no sandbox here: {e}")


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
    """family -> (directory, transformers model) saved with save_pretrained."""
    out = {}
    for fam in FAMILY_CONFIGS:
        d = tmp_path_factory.mktemp(fam)
        m = make_hf_model(fam)
        m.save_pretrained(d)
        out[fam] = (d, m)
    return out


# Tests that run the engine, a producer thread, reward workers or the sandbox get a hard time
# limit: a deadlock fails the test instead of stalling the suite. Generous: the machine is
# shared and noisy.
HARD_LIMIT_S = {"rl": 600, "rewards": 300, "engine": 300}


@pytest.fixture(autouse=True)
def hard_timeout(request):
    import signal
    from pathlib import Path

    part = Path(str(request.node.fspath)).parent.name
    limit = HARD_LIMIT_S.get(part)
    if limit is None:
        yield
        return

    def on_alarm(signum, frame):
        raise TimeoutError(f"test exceeded the hard limit of {limit} s (deadlock?)")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(limit)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
