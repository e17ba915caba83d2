"""The deciding exchange on a simulated link whose rate changes mid-run (network namespaces
with tc tbf, as benchmarks/netsim): made slow, a new round of trials moves to a compressed
plan; made fast again, a new round brings exact back (kept, or tied by a plan sending fewer
bytes); each within the check period."""

from __future__ import annotations

import pytest

from benchmarks.netsim import NetnsUnavailable, SlowNetwork, list_namespaces

EVERY, TRIAL_STEPS, PLANS = 5, 5, 4  # PLANS: exact, uniform 4-bit, fewest bytes, planned
# The longest round: the default 3 warm-up steps, then each plan's settle step and its
# measured steps, none cut early (under load a compressed plan's turn is not). A change is
# seen within EVERY steps, so every phase gets EVERY + ROUND steps and a spare.
ROUND = 3 + PLANS * (1 + TRIAL_STEPS)
SLOW_AT = 26
FAST_AT = SLOW_AT + EVERY + ROUND + 4
STEPS = FAST_AT + EVERY + ROUND + 4


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
            {"steps": STEPS, "changes": {str(SLOW_AT): "100mbit", str(FAST_AT): None},
             "trial_steps": TRIAL_STEPS, "recheck_every": EVERY, "width": 192, "depth": 32,
             "trial_runoffs": 0},  # (rounds of one pass: each fits between the changes)
            timeout=300)
    assert list_namespaces(net.prefix) == []
    a, b = ranks
    assert a["rounds"] == b["rounds"]  # agreed measurements, the same plans kept
    rounds = a["rounds"]
    assert all(len(r["plans"]) <= PLANS for r in rounds), rounds  # (ROUND's bound holds)
    checks = [(c["step"], round(c["step_ratio"], 2), round(c["link_ratio"], 2), c["retrial"])
              for c in a["checks"]]
    seen = [(r["start"], r["step"], r["chosen"],
             {p["label"]: round(1e3 * p["measured_s"], 1) for p in r["plans"]}) for r in rounds] + checks
    for change in (SLOW_AT, FAST_AT):
        # the change is seen within one check period: a round starts at the first check
        # after it (or one in progress measures the new link)
        assert any(r["start"] <= change < r["step"] or 0 <= r["start"] - change <= EVERY
                   for r in rounds), (change, seen)

    def kept_before(step):  # the plan the last round decided before ``step`` kept
        return [r for r in rounds if r["step"] < step][-1]

    slow, fast = kept_before(FAST_AT), kept_before(STEPS)
    assert slow["step"] > SLOW_AT and fast["step"] > FAST_AT, seen
    measured = [{p["label"]: p["measured_s"] for p in r["plans"]} for r in (slow, fast)]
    exact = [m["exact (fused)"] for m in measured]
    assert exact[0] > 3 * exact[1], seen  # 4.8 MB of float32 per step at 100 Mbit/s
    # slow: a compressed plan, far ahead of exact
    assert slow["chosen"] != "exact (fused)", seen
    assert measured[0][slow["chosen"]] * 2 < exact[0], seen
    # fast again: exact is back among the fastest, and kept unless a plan measured faster
    # than the clock's resolution (exact's zero error wins every tie it is in): on two
    # shared CPU cores an unshaped link makes exact and 4-bit about even
    assert fast["chosen"] == "exact (fused)" or \
        measured[1][fast["chosen"]] <= exact[1] * 1.02, seen
    assert min(measured[1].values()) * 1.5 > exact[1], seen
