"""The data cursor on its own: epochs reshuffle, rewinds, and the trained position."""

from orbitrl.rl.cursor import DataCursor


def test_every_row_once_per_epoch_then_a_new_order():
    rows = [{"i": i} for i in range(5)]
    c = DataCursor(rows, seed=3)
    first = [r["i"] for r in c.draw(5)]
    second = [r["i"] for r in c.draw(5)]
    assert sorted(first) == sorted(second) == list(range(5)) and first != second
    assert DataCursor(rows, seed=3).draw(5) == [{"i": i} for i in first]  # seeded


def test_rewind_and_the_checkpointed_position():
    rows = [{"i": i} for i in range(7)]
    c = DataCursor(rows, seed=0)
    c.draw(3)
    at3 = c.position()
    want = c.draw(3)
    c.rewind(at3)
    assert c.draw(3) == want
    assert c.state_dict() == {"data_pos": 6, "order": c.order}
    # overlapped: the producer drew ahead; a checkpoint keeps the trained position
    c.trained(at3)
    c.draw(2)
    assert c.state_dict()["data_pos"] == 3
    d = DataCursor(rows, seed=0)
    d.load_state_dict(c.state_dict())
    c.rewind(at3)
    assert d.draw(4) == c.draw(4)
