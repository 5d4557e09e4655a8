"""Assert tests split into probes (run inside the sandbox) and checks (run here)."""

import json

import pytest

from orbitrl.rewards.probes import RECORD, decode, judge_record, parse_assert


def record(*values):
    return b"noise printed by the program" + RECORD + json.dumps(
        [["ok", v] for v in values]).encode() + b"\n"


@pytest.mark.parametrize("src,probes", [
    ("assert add(2, 3) == 5", ("add(2, 3)",)),
    ("assert add(10**12, 1) == 10**12 + 1", ("add(10 ** 12, 1)",)),
    ("assert sorted(f([3, 1])) == [1, 3]", ("f([3, 1])",)),
    ("assert not is_anagram('abc', 'abd')", ("is_anagram('abc', 'abd')",)),
    ("assert math.isclose(root(2), 1.4142, rel_tol=1e-3)", ("root(2)",)),
    ("assert Stack().push(1).size() == 1", ("Stack().push(1).size()",)),
    ("assert LIMIT == 3\nassert f(1)[0] == 2", ("LIMIT", "f(1)")),
    ("assert sum(x for x in f(3)) == 6", ("f(3)",)),
])
def test_only_the_calls_into_the_program_are_probes(src, probes):
    t = parse_assert(src, "t")
    assert t.probes == probes
    assert not any(str(v) in " ".join(probes) for v in ("== 5", "[1, 3]", "1.4142"))


def test_verdict_is_computed_here_from_plain_values():
    t = parse_assert("assert add(2, 3) == 5", "t")
    assert judge_record(t, record(5)) == (True, "")
    ok, why = judge_record(t, record(4))
    assert not ok and "add(2, 3) = 4" in why
    assert judge_record(t, record(5.0))[0]  # as Python's == would say
    assert not judge_record(t, b"5\n")[0]  # no record: the program ended early
    assert not judge_record(t, record(5, 5))[0]  # more values than probes
    bad = RECORD + json.dumps([["error", "TypeError: a E, not plain data"]]).encode()
    assert not judge_record(t, bad)[0]


def test_the_last_record_counts_and_types_are_exact():
    t = parse_assert("assert pair() == (1, 2)\nassert s() == {1}\nassert d() == {1: 'a'}", "t")
    tagged = [{"t": [1, 2]}, {"s": [1]}, {"d": [[1, "a"]]}]
    good = RECORD + json.dumps([["ok", v] for v in tagged]).encode()
    assert judge_record(t, record([1, 2], [1], {"d": [[1, "a"]]}) + good)[0]
    assert not judge_record(t, good + record([1, 2], [1], {"d": [[1, "a"]]}))[0]  # list != tuple
    assert decode({"f": [1]}) == frozenset({1})
    with pytest.raises(KeyError):
        decode({"x": 1})
