"""benchmarks/integration_steps.py: how the routes' rounds become the reported figures."""

from __future__ import annotations

import types

import pytest

from benchmarks.integration_steps import Clock, summarize, table


def _ranks(route, *steps, cpu=1.0):
    return [{"route": route, "step_s": s, "cpu_s": cpu} for s in steps]


def test_a_clock_times_the_steps_after_the_warmup_from_one_step_end_to_the_next(monkeypatch):
    import benchmarks.integration_steps as mod
    wall = iter([0.0, 5.0, 6.0, 8.0, 9.0])  # the first step (warm-up) ends at 5 s
    cpu = iter([0.0, 1.0, 1.5, 2.5, 3.0])
    monkeypatch.setattr(mod.time, "perf_counter", lambda: next(wall))
    monkeypatch.setattr(mod.time, "process_time", lambda: next(cpu))
    clock = Clock(warmup=1)
    for _ in range(5):
        clock.tick()
    r = clock.result("x")
    assert r["times_s"] == [1.0, 2.0, 1.0]
    assert r["step_s"] == pytest.approx(4.0 / 3)
    assert r["cpu_s"] == pytest.approx(2.0 / 3)


def test_a_clock_with_too_few_steps_says_so():
    clock = Clock(warmup=2)
    clock.tick()
    with pytest.raises(RuntimeError, match="too few"):
        clock.result("lightning")


def test_each_route_is_its_slowest_rank_against_the_same_rounds_optimizer():
    rounds = [{"cgx-optimizer": _ranks("cgx-optimizer", 1.0, 1.2),
               "lightning": _ranks("lightning", 1.1, 1.26, cpu=0.5)},
              {"cgx-optimizer": _ranks("cgx-optimizer", 2.0, 1.0),   # a slow round
               "lightning": _ranks("lightning", 2.04, 2.0, cpu=0.5)},
              {"cgx-optimizer": _ranks("cgx-optimizer", 1.0, 1.0),
               "lightning": [{"route": "lightning", "error": "rank 1 died"}]}]
    rows = {r["route"]: r for r in summarize(rounds, ["cgx-optimizer", "lightning"], cores=2)}
    assert rows["cgx-optimizer"]["steps_s"] == [1.2, 2.0, 1.0]
    assert rows["lightning"]["steps_s"] == [1.26, 2.04]  # the failed round left out
    assert rows["lightning"]["ratios"] == pytest.approx([1.05, 1.02])  # paired by round
    assert rows["lightning"]["vs_optimizer"] == pytest.approx(1.035)
    assert rows["lightning"]["cpu_floor_s"] == pytest.approx(0.5)  # 2 ranks x 0.5 s / 2 cores


def test_a_route_that_failed_every_round_is_reported_with_its_error():
    rounds = [{"cgx-optimizer": _ranks("cgx-optimizer", 1.0, 1.0),
               "hf-trainer": [{"route": "hf-trainer", "error": "Gloo: size mismatch"}]}]
    rows = summarize(rounds, ["cgx-optimizer", "hf-trainer"], cores=2)
    assert rows[1] == {"route": "hf-trainer", "error": "Gloo: size mismatch"}
    args = types.SimpleNamespace(argv=[], rate="1gbit", batch=8, steps=12, warmup=4, rounds=1)
    text = table(rows, args, compute=0.5)
    assert "| hf-trainer | failed: Gloo: size mismatch |" in text
    assert "| cgx-optimizer | 1.000 | 1.000x | 2.00x | 1.000 |" in text


def test_the_optimizer_route_is_required():
    from benchmarks.integration_steps import main
    with pytest.raises(SystemExit):
        main(["--routes", "lightning"])
