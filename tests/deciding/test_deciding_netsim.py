"""The deciding exchange on a simulated link whose rate changes mid-run (network namespaces
with tc tbf, as benchmarks/netsim): made slow, a new round of trials moves to a compressed
plan; made fast again, back to exact; each within the check period."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # `benchmarks` is not installed; import it from the checkout
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.netsim import NetnsUnavailable, SlowNetwork, list_namespaces  # noqa: E402

SLOW_AT, FAST_AT, EVERY = 16, 34, 5


@pytest.mark.netns
@pytest.mark.multiproc
def test_a_slower_then_faster_link_moves_the_plan_to_compressed_then_back_to_exact():
    net = SlowNetwork(n_ranks=2, rate=None)  # unshaped veth pair, reshaped by the ranks
    try:
        net.start()
    except NetnsUnavailable as err:
        pytest.skip(f"network namespaces unavailable: {err.reason}")
    with net:
        ranks = net.run_function(
            "benchmarks.netsim.changing_link:deciding_under_changing_link",
            {"steps": 54, "changes": {str(SLOW_AT): "100mbit", str(FAST_AT): None},
             "trial_steps": 3, "recheck_every": EVERY}, timeout=300)
    assert list_namespaces(net.prefix) == []
    a, b = ranks
    assert a["rounds"] == b["rounds"]  # agreed measurements, the same plans kept
    rounds = a["rounds"]
    starts = [r["start"] for r in rounds]
    slow = next(r for r in rounds if r["start"] > SLOW_AT)
    fast = next(r for r in rounds if r["start"] > FAST_AT)
    # a new round at the first check after each change (checks every EVERY steps after a
    # decision): never later than one check period plus the round in progress
    assert slow["start"] <= SLOW_AT + EVERY, starts
    assert fast["start"] <= FAST_AT + EVERY, starts
    by = {r["start"]: {p["label"]: p for p in r["plans"]} for r in rounds}
    exact_slow = by[slow["start"]]["exact (fused)"]["measured_s"]
    exact_fast = by[fast["start"]]["exact (fused)"]["measured_s"]
    assert exact_slow > 3 * exact_fast  # 4 MB of float32 per step at 100 Mbit/s
    assert slow["chosen"] != "exact (fused)"
    assert fast["chosen"] == "exact (fused)", fast
