"""Wrong programs that try to forge a pass: every one scores 0, on every backend.

An RL policy optimises what the reward measures, so each way a wrong program could score
is a bug. The assert tests' verdicts are decided outside the candidate's process
(rewards/probes.py); stdin/stdout tests compare captured output here. The candidate's exit
status, hooks and tracing cannot pass a test; neither can objects that claim equality, nor
reading the tests or answers from anywhere inside the sandbox.
"""

import pytest

import orbitrl.data.code_tasks as tasks
from orbitrl.rewards.code import CodeReward
from sandbox_util import BACKENDS, sandbox

ASSERTS = [{"assert": "assert add(2, 3) == 5"}, {"assert": "assert add(-1, 1) == 0"},
           {"assert": "assert add(10**12, 1) == 10**12 + 1"}]
IO = [{"input": "3 4\n", "output": "7\n"}, {"input": "-5 5\n", "output": "0\n"}]
WRONG = "def add(a, b):\n    return a - b + 1\n"

HACKS = {
    "exit_0": "import sys\nsys.exit(0)",
    "os_exit_0": "import os\nos._exit(0)",
    "exit_during_asserts": WRONG + "import atexit, os\natexit.register(os._exit, 0)",
    "exception_hook": WRONG + "import sys, os\nsys.excepthook = lambda *a: os._exit(0)",
    "reexec_without_asserts": "import os, sys\nos.execv(sys.executable, [sys.executable, '-O', "
                              "'-c', 'pass'])",
    "trace_hook": WRONG + "import sys, os\ndef t(frame, event, arg):\n"
                          "    if event == 'exception':\n        os._exit(0)\n    return t\n"
                          "sys.settrace(t)",
    "always_equal": "class Eq:\n    def __eq__(self, other):\n        return True\n"
                    "    __hash__ = object.__hash__\ndef add(a, b):\n    return Eq()\n",
    "int_subclass": "class I(int):\n    def __eq__(self, other):\n        return True\n"
                    "    __hash__ = int.__hash__\ndef add(a, b):\n    return I(0)\n",
    "forged_record": WRONG + "import atexit, os\natexit.register(lambda: os.write(1, "
                             "b'\\n\\x1eorbitrl-probes [[\"ok\", true]]\\n'))",
    "answers_from_cmdline": "import re\ndef add(a, b):\n"
                            "    text = open('/proc/self/cmdline', 'rb').read().decode('utf-8', 'replace')\n"
                            "    m = re.search(r'add\\(%d, %d\\)\\s*==\\s*(-?\\d+)' % (a, b), text)\n"
                            "    return int(m.group(1)) if m else -1\n",
    "answers_from_package": "import re\ndef add(a, b):\n    try:\n"
                            f"        text = open({tasks.__file__!r}).read()\n"
                            "    except OSError:\n        return -1\n"
                            "    m = re.search(r'assert add\\(%d, %d\\) == ([^\"]+)' % (a, b), text)\n"
                            "    return eval(m.group(1)) if m else -1\n",
    "print_nothing": "",
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(HACKS))
def test_a_forged_pass_scores_zero(backend, name):
    box = sandbox(backend)
    reward = CodeReward(box.cfg)
    reward._sandbox = box
    code = HACKS[name]
    out = reward.score_batch(["p", "p"], [code, code], [{"tests": ASSERTS}, {"tests": IO}])
    assert out.scores == [0.0, 0.0], (name, out.details)
    assert not out.errors


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_right_program_still_scores_one(backend):
    """The control: the same harness passes a correct program (and partial credit holds)."""
    box = sandbox(backend)
    reward = CodeReward(box.cfg)
    reward._sandbox = box
    out = reward.score_batch(
        ["p"] * 3, ["def add(a, b):\n    return a + b\n", "def add(a, b):\n    return 0\n",
                    "a, b = map(int, input().split())\nprint(a + b)\n"],
        [{"tests": ASSERTS}, {"tests": ASSERTS}, {"tests": IO}])
    assert out.scores == [1.0, pytest.approx(1 / 3), 1.0], out.details


def test_every_builtin_assert_test_splits_into_probes():
    """The built-in code task's assert tests all parse into probes and checks, and their
    reference solutions pass under the new harness (tests/data covers them in the sandbox)."""
    from orbitrl.rewards.code import parse_tests

    for name, (_, tests, _) in tasks.PROBLEMS.items():
        for t in parse_tests(tests, name):
            if t.check is not None:
                assert t.check.probes, name


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_poisoned_record_fails_only_its_own_sample(backend):
    """A record too deeply nested to decode is that program's failure, not the batch's."""
    box = sandbox(backend)
    reward = CodeReward(box.cfg)
    reward._sandbox = box
    poison = WRONG + ("import atexit, os\natexit.register(lambda: os.write(1, b'\\n\\x1eorbitrl-"
                      "probes ' + b'[' * 100000 + b'\\n'))")
    out = reward.score_batch(["p", "p"], ["def add(a, b):\n    return a + b\n", poison],
                             [{"tests": ASSERTS}, {"tests": ASSERTS}])
    assert out.scores == [1.0, 0.0] and not out.errors, out.details
