"""benchmarks/decide_paired.py: how paired blocks become the deciding exchange's ratios."""

from __future__ import annotations

import types

import pytest

from benchmarks.decide_paired import _ratios, report


def _result():
    # three blocks; the machine slows down in the second (every method alike)
    return {"times_s": {"cgx-decide": [1.0, 2.0, 1.1],
                        "cgx-optimizer": [1.0, 2.2, 1.0],
                        "ddp-fp32": [1.2, 1.8, 1.3]},
            "decide_steps": {"cgx-decide": 30},
            "trials": {"cgx-decide": [{"chosen": "fewest bytes"}]}}


def test_each_block_is_compared_with_the_fastest_other_method_of_that_block():
    per = _ratios(_result(), "cgx-decide", ["cgx-optimizer", "ddp-fp32"])
    assert per["cgx-optimizer"] == pytest.approx([1.0, 2.0 / 2.2, 1.1])
    # block 2's fastest other is DDP (1.8), the others' is cgx 4-bit
    assert per["fastest other"] == pytest.approx([1.0, 2.0 / 1.8, 1.1])


def test_the_report_names_the_kept_plan_and_the_median_ratio_to_the_fastest_method():
    args = types.SimpleNamespace(argv=["--rate", "none"], batch=8, rate="none", steps=5,
                                 blocks=3, trials="default")
    text = "\n".join(report(_result(), args))
    assert "kept 'fewest bytes' after 30 steps" in text
    # cgx-optimizer's median block (1.0) beats DDP's (1.3): the fastest by median
    assert "| cgx-optimizer (fastest by median) | 1.000x | 0.909-1.100 |" in text
    assert "| fastest other | 1.100x | 1.000-1.111 |" in text
