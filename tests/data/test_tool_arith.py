"""The tool task's data: disjoint splits of products, and warm-start pairs that never hold
environment tokens as targets."""

from orbitrl.data.tool_arith import SPLITS, tool_rows


def test_splits_are_disjoint_products():
    seen = {}
    for split in ("heldout", "rl"):
        rows = tool_rows(split)
        assert len(rows) == SPLITS[split][1] - SPLITS[split][0]
        for r in rows:
            a, b = map(int, r["prompt"][:-1].split("*"))
            assert r["prompt"].endswith("=") and int(r["answer"]) == a * b
            assert 100 <= a < 1000 and 10 <= b < 100
            assert r["prompt"] not in seen
            seen[r["prompt"]] = split
    sft = {p["prompt"] for p in tool_rows("sft") if "[" not in p["prompt"]}
    assert len(sft) == 4000 and not sft & set(seen)


def test_sft_pairs_are_the_two_model_turns():
    pairs = tool_rows("sft")
    assert len(pairs) == 8000
    for call, final in zip(pairs[::2], pairs[1::2]):
        a, b = map(int, call["prompt"][:-1].split("*"))
        assert call["answer"] == f"[{a}*{b}]"
        # the result between the call and the answer is prompt, never a target
        assert final["prompt"] == f"{a}*{b}=[{a}*{b}]({a * b})" and final["answer"] == str(a * b)
