"""benchmarks/training.py: how rounds of one method become its reported figure."""

from __future__ import annotations

import pytest

from benchmarks.training import _merge, _step


def test_rounds_report_the_median_of_their_means_and_keep_every_step():
    rounds = [{"method": "m", "times_s": [1.0, 3.0], "wire_bytes": 1, "plan": "first"},
              {"method": "m", "error": "rank 1 died"},
              {"method": "m", "times_s": [5.0, 5.0], "wire_bytes": 1, "plan": "last"},
              {"method": "m", "times_s": [0.5, 1.5], "wire_bytes": 1, "plan": "late"}]
    merged = _merge(rounds)
    assert merged["round_means"] == [2.0, 5.0, 1.0]  # the failed round left out
    assert merged["times_s"] == [1.0, 3.0, 5.0, 5.0, 0.5, 1.5]
    assert _step(merged) == 2.0  # the median round, not the mean of all steps (2.67)
    assert merged["plan"] == "late"  # the last successful round's details
    # one round: the mean of its steps, as before rounds existed
    assert _step({"times_s": [1.0, 2.0]}) == pytest.approx(1.5)


def test_a_method_that_failed_every_round_reports_its_error():
    assert _merge([{"method": "m", "error": "a"}, {"method": "m", "error": "b"}]) == {
        "method": "m", "error": "b"}
