"""benchmarks/integrations.py's arithmetic on made-up runs (the runs themselves are the
integration tests')."""

from __future__ import annotations

import pytest

from benchmarks.integrations import ring_bytes, summarize, table


def test_ring_bytes_of_two_ranks_is_the_tensor_once():
    assert ring_bytes(1000) == 4000
    assert ring_bytes(1000, world=4) == 6000


def test_summary_judges_bytes_and_the_seed_range():
    runs = [{"plain": (800.0, 2.0), "cgx": (100.0, 2.1)},
            {"plain": (800.0, 2.4), "cgx": (100.0, 2.3)},
            {"plain": (800.0, 2.2), "cgx": (100.0, 2.2)}]
    s = summarize("toy", runs)
    assert s["fewer_bytes"] == 8.0 and s["at_least_7x"]
    assert s["plain_spread"] == [2.0, 2.4] and s["within_spread"]
    assert s["paired_difference"] == pytest.approx([0.1, -0.1, 0.0])
    worse = summarize("toy", [{"plain": (700.0, 2.0), "cgx": (200.0, 3.0)}] * 2)
    assert not worse["at_least_7x"] and not worse["within_spread"]
    assert "| toy | 800 | 100 | 8.00x |" in table([s])
