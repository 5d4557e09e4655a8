"""Check functions judged outside the program (rewards/checkfn.py): the reference solutions
pass, wrong programs and forged passes fail, unsplittable checks are one-line errors."""

import pytest

from orbitrl.errors import OrbitError
from orbitrl.rewards.checkfn import judge_programs, record_calls, source
from sandbox_util import BACKENDS, DEFAULT, sandbox

SETUP = "def add(a, b):\n    \"\"\"a + b\"\"\"\n"
REF = "    return a + b\n"
TEST = ("import random\n\ndef check(candidate):\n    assert candidate(2, 3) == 5\n"
        "    assert abs(candidate(0.1, 0.2) - 0.3) < 1e-9\n"
        "    for _ in range(20):\n        x, y = random.randint(0, 99), random.randint(0, 99)\n"
        "        assert candidate(x, y) == x + y\n")
WRONG = "    return a - b + 1\n"

HACKS = {
    "prints_passed": WRONG + "print('passed')\n",
    "exit_0_at_load": "    return 0\nimport sys\nsys.exit(0)\n",
    "os_exit_0_in_call": "    import os\n    os._exit(0)\n",
    "always_equal": "    class Eq:\n        def __eq__(self, o):\n            return True\n"
                    "        def __sub__(self, o):\n            return 0\n"
                    "        __hash__ = object.__hash__\n    return Eq()\n",
    "int_subclass": "    class I(int):\n        def __eq__(self, o):\n            return True\n"
                    "        __hash__ = int.__hash__\n    return I(0)\n",
    "patches_builtins": "    import builtins\n    builtins.abs = lambda x: 0\n"
                        "    builtins.AssertionError = SystemExit\n    return 0\n",
    "forged_record": WRONG + "import atexit, os\natexit.register(lambda: os.write(1, "
                             "b'\\n\\x1eorbitrl-probes [[\"ok\", 5]]\\n'))\n",
    "nan": "    return float('nan')\n",
    "raises": "    raise ValueError('no')\n",
    "syntax_error": "    return a +\n",
}


def _spec():
    return record_calls("toy/add", "add", SETUP, TEST, REF)


def test_recording_binds_the_calls_in_order_with_a_private_seeded_random():
    a, b = _spec(), _spec()
    assert a.calls == b.calls and len(a.calls) == 22
    assert a.calls[:2] == ("add(2, 3)", "add(0.1, 0.2)")


@pytest.mark.parametrize("backend", BACKENDS)
def test_reference_passes_and_every_forged_pass_fails(backend):
    spec = _spec()
    items = [(spec, SETUP + REF)] + [(spec, SETUP + body) for body in HACKS.values()]
    verdicts = judge_programs(sandbox(backend), items)
    assert verdicts[0].passed, verdicts[0]
    for name, v in zip(HACKS, verdicts[1:]):
        assert not v.passed, (name, v)
        assert v.status != "sandbox_error", (name, v)


def test_helpers_come_from_the_prompt_not_the_program():
    setup = ("def poly(xs, x):\n    return sum(c * x ** i for i, c in enumerate(xs))\n\n"
             "def root(xs):\n    \"\"\"a zero of poly\"\"\"\n")
    test = ("def check(candidate):\n    for xs in ([-2, 1], [-6, 2], [3, -1]):\n"
            "        assert abs(poly(xs, candidate(xs))) < 1e-6\n")
    spec = record_calls("toy/root", "root", setup, test, "    return -xs[0] / xs[1]\n")
    cheat = setup.replace("sum(c * x ** i for i, c in enumerate(xs))", "0") + "    return 7\n"
    right = setup + "    return -xs[0] / xs[1] + 0.0\n"
    v = judge_programs(sandbox(DEFAULT), [(spec, cheat), (spec, right)])
    assert not v[0].passed and v[1].passed


def test_a_call_that_depends_on_a_value_runs_again_with_the_new_inputs():
    setup = "def f(x):\n    \"\"\"\"\"\"\n"
    test = ("def check(candidate):\n    r = candidate(0)\n    assert r in (1, 2)\n"
            "    assert candidate(r) == r + 10\n")
    spec = record_calls("toy/f", "f", setup, test,
                        "    return 1 if x == 0 else x + 10\n")
    other = setup + "    return 2 if x == 0 else x + 10\n"  # right, on other inputs
    wrong = setup + "    return 2 if x == 0 else x + 11\n"
    loop = ("def check(candidate):\n    x = 0\n    for _ in range(5):\n"
            "        x = candidate(x)\n    assert x > 0\n")
    drift = record_calls("toy/drift", "f", setup, loop, "    return x + 1\n")
    v = judge_programs(sandbox(DEFAULT), [(spec, other), (spec, wrong),
                                          (drift, setup + "    return x + 2\n")])
    assert v[0].passed and not v[1].passed
    assert not v[2].passed and v[2].status == "diverged"


@pytest.mark.parametrize("test, match", [
    ("def check(candidate):\n    assert True\n", "never calls"),
    ("def check(candidate):\n    assert candidate(lambda: 1, 2) == 3\n", "not plain data"),
    ("def check(candidate):\n    assert candidate(2, 2) == 5\n", "fails on the reference"),
    ("x = 1\n", "no check"),
])
def test_a_check_that_cannot_be_split_is_a_one_line_error_naming_the_problem(test, match):
    with pytest.raises(OrbitError, match=match) as e:
        record_calls("toy/add", "add", SETUP, test, REF)
    assert str(e.value).startswith("toy/add:") and "\n" not in str(e.value)


def test_source_round_trips_plain_values_and_refuses_objects():
    for v in [None, True, 3, -2.5, float("inf"), "a'b\n", [1, (2,), {3: "x"}], {1, 2},
              frozenset([4]), ()]:
        got = eval(source(v))
        assert got == v and type(got) is type(v)
    assert eval(source(float("nan"))) != eval(source(float("nan")))
    with pytest.raises(Exception):
        source(object())
