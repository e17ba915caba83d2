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


def test_trials_option_picks_the_deciding_methods_settings():
    import types
    from benchmarks.training import DECIDE, _cgx_compression
    made = []
    compression = types.SimpleNamespace(
        auto=lambda **kw: made.append(("auto", kw)) or "auto",
        planned=lambda **kw: made.append(("planned", kw)) or "planned",
        quantize=lambda **kw: made.append(("quantize", kw)) or "quantize")
    hvd = types.SimpleNamespace(Compression=compression)
    assert _cgx_compression(hvd, "cgx-decide-sfb", "default") == "auto"
    assert _cgx_compression(hvd, "cgx-decide", "short") == "auto"
    assert _cgx_compression(hvd, "cgx-optimizer-8bit", "default") == "quantize"
    assert _cgx_compression(hvd, "cgx-optimizer-sfb", "default") == "quantize"  # fixed 4-bit
    assert _cgx_compression(hvd, "keras-cgx-decide", "default") == "auto"
    assert made == [("auto", {"objective": "time"}), ("auto", DECIDE),
                    ("quantize", {"bits": 8}), ("quantize", {"bits": 4}),
                    ("auto", {"objective": "time"})]


def _trials(chosen):
    plan = dict(bytes=10, eligible=True, error=1.0, kind="uniform", label=chosen,
                measured_s=1.0, predicted_s=1.0, samples=3)
    return [{"chosen": chosen, "plans": [plan], "setup_s": 0.1}]


def test_deciding_method_is_compared_round_by_round_and_names_each_rounds_plan():
    """The machine's speed drifts between rounds; the same round's ratio cancels it."""
    from benchmarks.training import _decide_lines
    fixed = _merge([{"method": "cgx-optimizer", "times_s": [t]} for t in (1.0, 2.0, 1.0)])
    decide = _merge([{"method": "cgx-decide", "times_s": [t], "deciding_s": [1.0],
                      "trials": _trials(k)}
                     for t, k in ((1.1, "a"), (1.8, "b"), (1.05, "b"))])
    assert decide["kept_by_round"] == ["a", "b", "b"]
    text = "\n".join(_decide_lines([fixed, decide], warmup=0))
    # medians: 1.1 vs 1.0 (1.100x); round by round 1.1, 0.9, 1.05: median 1.050x
    assert "1.100x the fastest other method (cgx-optimizer)" in text
    assert "round by round 1.050x its step (median; 0.900-1.100" in text
    assert "kept by round: 'a', 'b', 'b'" in text


def test_a_failed_round_leaves_the_rounds_unpaired():
    from benchmarks.training import _paired
    whole = _merge([{"method": "x", "times_s": [1.0]}, {"method": "x", "times_s": [2.0]}])
    holed = _merge([{"method": "y", "error": "died"}, {"method": "y", "times_s": [2.0]},
                    {"method": "y", "times_s": [4.0]}])
    assert _paired(whole, whole) == [1.0, 1.0]
    assert _paired(whole, holed) is None
