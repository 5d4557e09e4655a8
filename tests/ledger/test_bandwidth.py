"""Bandwidth ledger: ring collectives, bucketed weight sync, hiding behind compute."""

import pytest

from orbitrl.ledger.bandwidth import (Links, hide_behind, ring_gather_bytes, sync_transfer,
                                      transfer)


def test_ring_gather():
    assert ring_gather_bytes(100.0, 1) == 0
    assert ring_gather_bytes(100.0, 4) == 75.0


def test_sync_modes_order():
    links = Links()
    full = sync_transfer("full", 2e12, 2e9, 0.1, links, senders=8)
    changed = sync_transfer("changed", 2e12, 2e9, 0.1, links, senders=8)
    adapter = sync_transfer("adapter", 2e12, 2e9, 0.1, links, senders=8)
    assert full.seconds > changed.seconds > adapter.seconds > 0
    assert sync_transfer("none", 2e12, 2e9, 0.1, links).seconds == 0


def test_compute_hides_prefetched_transfers_once():
    a, b = transfer("a", "x", 10e9, 10.0), transfer("b", "x", 10e9, 10.0)
    out = hide_behind([a, b], 1.5)
    assert [t.exposed for t in out] == [0.0, pytest.approx(0.5)]


def test_links_must_be_positive():
    with pytest.raises(ValueError):
        Links(host_gbps=0)
