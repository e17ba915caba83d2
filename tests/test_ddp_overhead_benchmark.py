"""benchmarks/ddp_overhead.py: its figures from the turns, and one real turn on 2 ranks."""

from __future__ import annotations

import pytest

from benchmarks import ddp_overhead


def test_each_route_is_its_median_and_its_cpu_over_the_compute_route():
    times = {"compute": {"wall_s": [1.0, 9.0, 1.2], "cpu_s": [0.9, 5.0, 1.0]},
             "ddp-noop": {"wall_s": [1.3, 1.1, 1.2], "cpu_s": [1.1, 1.2, 1.3]}}
    rows = ddp_overhead.summarize(times, ["compute", "ddp-noop"])
    assert rows[0] == {"route": "compute", "step_s": 1.2, "cpu_s": 1.0,
                       "cpu_over_compute_s": 0.0}
    assert rows[1]["step_s"] == 1.2 and rows[1]["cpu_over_compute_s"] == pytest.approx(0.2)
    without = ddp_overhead.summarize(times, ["ddp-noop"])  # no compute route: no difference
    assert without[0]["cpu_over_compute_s"] is not None
    assert ddp_overhead.summarize({"ddp-noop": times["ddp-noop"]},
                                  ["ddp-noop"])[0]["cpu_over_compute_s"] is None


def test_an_unknown_route_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        ddp_overhead.main(["--routes", "compute,ddp-fast"])
    assert "ddp-fast" in capsys.readouterr().err


@pytest.mark.multiproc
def test_one_turn_of_each_kind_of_route_on_two_ranks(tmp_path):
    # one route of each builder: no DDP, DDP with the no-op hook, DDP with cgx's hook
    routes = ["compute", "ddp-noop-view", "cgx-ddp-hook-view"]
    out = tmp_path / "overhead"
    assert ddp_overhead.main(["--routes", ",".join(routes), "--steps", "1", "--warmup", "0",
                              "--out", str(out)]) == 0
    text = (tmp_path / "overhead.md").read_text()
    for route in routes:
        assert f"| {route} |" in text
    import json
    rows = json.loads((tmp_path / "overhead.json").read_text())["rows"]
    assert [r["route"] for r in rows] == routes
    assert all(r["step_s"] > 0 and r["cpu_s"] > 0 for r in rows)
