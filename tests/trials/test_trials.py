"""The trials' state machine on one process: which plan travels, what is measured, what is
kept, when a round starts again, and what a checkpoint keeps."""

from __future__ import annotations

import types

import pytest
import torch

from cgx.compression import Compression
from cgx.compression.trial_settings import TrialSettings
from cgx.policy.trials.rounds import (Event, Phase, PlanRecord, Trials, choose, format_trials,
                                 resolution, step_noise)

ONE = types.SimpleNamespace(size=1, rank=0, device=torch.device("cpu"))


def _records():
    return [PlanRecord("exact", "exact", 1000, 0.0, 0.010),
            PlanRecord("uniform", "uniform", 150, 1.0, 0.008),
            PlanRecord("model", "model", 100, 0.9, 0.006)]


def _run(trials, times, first=10):
    """Tick steps ``first, first + 1, ...``; the step that starts ``i``-th lasts
    ``times[i](plan)`` seconds (one clock per Trials object, as a process has)."""
    events, plans = [], []
    now = getattr(trials, "fake_clock", 0.0)
    for step in range(first, first + len(times)):
        events.append(trials.tick(step, now, ONE))
        k = trials.plan_at(step)
        plans.append(k)
        now += times[step - first](k)
    trials.fake_clock = now
    return events, plans


def test_choose_takes_the_fastest_within_the_budget_and_breaks_ties_by_error_then_bytes():
    r = _records()
    for rec, m in zip(r, (0.010, 0.0081, 0.008)):
        rec.measured_s = m
    assert choose(r, 0.0) == 2
    assert choose(r, 0.02) == 2  # 8.1 ms ties 8.0 ms; model has the smaller error anyway
    r[1].error = 0.5
    assert choose(r, 0.02) == 1  # the tie goes to uniform's smaller error, not model's bytes
    assert choose(r, 0.0) == 2  # (no tie: the fastest)
    r[1].error = r[2].error
    assert choose(r, 0.02) == 2  # equal errors: fewer bytes
    r[2].eligible = False  # over the error budget: never kept, however fast
    assert choose(r, 0.0) == 1
    r[1].measured_s = 0.0101
    assert choose(r, 0.02) == 0  # within 2% of exact's 10 ms: exact's zero error wins the tie
    assert choose(r, 0.0) == 0
    for rec in r:
        rec.eligible = False
    with pytest.raises(ValueError, match="within the error budget"):
        choose(r, 0.0)


def test_step_noise_pools_consecutive_differences_and_ignores_a_lone_outlier():
    # differences over each plan's median: 0.2, 0.1 and 0.1, 0.1 (a one-step plan: none)
    assert step_noise([[9.0, 11.0, 10.0], [20.0, 22.0, 20.0], [7.0]]) == pytest.approx(
        0.1 / 0.9539)
    assert step_noise([[5.0], []]) == 0.0
    # one step that also held an evaluation moves two differences of six, not the median
    assert step_noise([[1.0, 1.1, 1.0, 10.0, 1.0, 1.1, 1.0]]) == pytest.approx(0.1 / 0.9539)


def test_resolution_shrinks_with_more_steps_and_less_spread():
    assert resolution(0.0, 3, 3) == 0.0
    r3 = resolution(0.1, 3, 3)
    assert r3 == pytest.approx(1.2533 * 0.1 * (2 / 3) ** 0.5)
    assert resolution(0.1, 6, 6) < r3 and resolution(0.05, 3, 3) == pytest.approx(r3 / 2)


def test_a_difference_the_clock_cannot_resolve_is_a_tie_that_the_smaller_error_wins():
    r = _records()[:2]  # exact (error 0), uniform (error 1.0)
    r[0].measured_s, r[1].measured_s = 0.0110, 0.0100  # uniform measured 10% faster
    for rec in r:
        rec.samples = 3
    assert choose(r, 0.02) == 1  # no spread measured: 10% is a real difference
    assert choose(r, 0.02, noise=0.01) == 1  # steps within 1%: resolved
    assert choose(r, 0.02, noise=0.15) == 0  # steps spread 15%: a tie, exact's error wins
    r[0].measured_s = 0.0200  # twice as slow is resolved at that spread too
    assert choose(r, 0.02, noise=0.15) == 1


def test_noisy_steps_send_a_plan_further_behind_into_the_runoff():
    # the model plan measures 15% behind uniform, each plan's steps spread about +-20%:
    # outside runoff_margin 10%, inside the clock's resolution, so both run again
    steps = {0: (0.040, 0.040, 0.040), 1: (0.016, 0.024, 0.020), 2: (0.018, 0.028, 0.023)}
    t = Trials(TrialSettings(steps=3, settle_steps=0, warmup_steps=0, recheck_every=0,
                             runoffs=1, runoff_margin=0.1))
    t.begin(0, _records())
    seen = {0: 0, 1: 0, 2: 0}

    def clock(k):
        i = seen[k] % 3
        seen[k] += 1
        return steps[k][i]
    events, plans = _run(t, [clock] * 16, first=0)
    assert plans[:15] == [0] * 3 + [1] * 3 + [2] * 3 + [2] * 3 + [1] * 3
    assert t.history[-1]["step_noise"] > 0.1
    # without the spread (every step its plan's median) the same medians get no runoff
    flat = Trials(TrialSettings(steps=3, settle_steps=0, warmup_steps=0, recheck_every=0,
                                runoffs=1, runoff_margin=0.1))
    flat.begin(0, _records())
    _, plans = _run(flat, [lambda k: (0.040, 0.020, 0.023)[k]] * 10, first=0)
    assert plans[:10] == [0] * 3 + [1] * 3 + [2] * 3 + [1] and flat.runoffs == 0


def test_later_runoffs_run_only_the_plans_the_clock_still_ties_with_the_fastest():
    # exact steady 9% behind uniform (within runoff_margin: the first runoff pass), the
    # model plan 1.5% behind (a tie at tie_tolerance 2%): exact drops out after one pass,
    # the two tied plans keep alternating until the passes are spent
    steps = {0: (0.0218,) * 3, 1: (0.0198, 0.0202, 0.0200), 2: (0.0201, 0.0205, 0.0203)}
    t = Trials(TrialSettings(steps=3, settle_steps=0, warmup_steps=0, recheck_every=0,
                             runoffs=3, runoff_margin=0.1, tie_tolerance=0.02))
    t.begin(0, _records())
    seen = {0: 0, 1: 0, 2: 0}

    def clock(k):
        seen[k] += 1
        return steps[k][(seen[k] - 1) % 3]
    events, plans = _run(t, [clock] * 31, first=0)
    assert plans[:30] == ([0] * 3 + [1] * 3 + [2] * 3 + [2] * 3 + [1] * 3 + [0] * 3
                          + [1] * 3 + [2] * 3 + [2] * 3 + [1] * 3)
    assert t.runoffs == 3 and Event.DECIDED in events
    assert [r.samples for r in t.records] == [6, 12, 12]
    assert t.chosen == 2  # still a tie after 12 steps each: the smaller error wins it


def test_a_round_runs_each_plan_in_turn_measures_after_settling_and_keeps_the_fastest():
    s = TrialSettings(steps=2, settle_steps=1, warmup_steps=0, recheck_every=0)
    t = Trials(s)
    t.begin(10, _records())
    durations = {0: 0.030, 1: 0.020, 2: 0.025}
    # the first step of each turn (the switch) is slow: it must not count
    times = [lambda k, i=i: durations[k] + (1.0 if i % 3 == 0 else 0.0) for i in range(12)]
    events, plans = _run(t, times)
    assert plans[:9] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert events[9] is Event.DECIDED and t.phase is Phase.DECIDED
    assert [r.measured_s for r in t.records] == pytest.approx([0.030, 0.020, 0.025])
    assert t.chosen == 1 and plans[9:] == [1, 1, 1]
    assert t.history[-1]["start"] == 10 and t.history[-1]["step"] == 19
    # what the clock said against what the model said, per kind
    assert t.corrections == pytest.approx({"exact": 3.0, "uniform": 2.5, "model": 25 / 6})
    assert t.predicted(PlanRecord("m2", "model", 1, 0.0, 0.002)) == pytest.approx(0.002 * 25 / 6)
    table = format_trials(t.records, t.chosen)
    assert "uniform (kept) | 20.0 ms | 8.0 ms | 150" in table


def test_a_plan_that_cannot_win_ends_its_turn_after_two_measured_steps():
    t = Trials(TrialSettings(steps=3, settle_steps=1, warmup_steps=2, recheck_every=0))
    t.begin(0, _records())
    durations = {None: 5.0, 0: 0.010, 1: 0.050, 2: 0.012}
    events, plans = _run(t, [lambda k: durations[k]] * 14, first=0)
    # two warm-up steps (the plan in use: None), then plan 0; plan 1: a settling step, then
    # two measured steps 5x the best: cut
    assert plans == [None, None, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 0]
    assert events[13] is Event.DECIDED and t.chosen == 0
    assert [r.measured_s for r in t.records] == pytest.approx([0.010, 0.050, 0.012])
    assert [r.samples for r in t.records] == [3, 2, 3]


def test_one_slow_step_of_the_training_loop_does_not_cut_a_plan_or_move_its_median():
    # the fastest plan's first measured step also holds a 0.5 s evaluation of the user's
    # loop: judged on that step alone it would lose; it runs its turn and is kept
    t = Trials(TrialSettings(steps=3, settle_steps=1, warmup_steps=0, recheck_every=0,
                             runoffs=0))
    t.begin(0, _records())
    durations = {None: 5.0, 0: 0.010, 1: 0.008, 2: 0.012}
    times = [lambda k, i=i: durations[k] + (0.5 if i == 5 else 0.0) for i in range(13)]
    events, plans = _run(t, times, first=0)
    assert plans == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 1]
    assert events[12] is Event.DECIDED and t.chosen == 1
    assert t.records[1].samples == 3
    assert t.records[1].measured_s == pytest.approx(0.008)


def test_the_kept_plan_is_checked_and_a_drift_either_way_starts_again():
    s = TrialSettings(steps=1, settle_steps=0, warmup_steps=0, recheck_every=4,
                      drift_tolerance=0.2)
    t = Trials(s)
    t.begin(0, _records()[:2])
    base = {0: 0.010, 1: 0.020}
    events, _ = _run(t, [lambda k: base[k]] * 7, first=0)  # decided at 2; checks at 6, 10
    assert t.chosen == 0 and Event.RETRIAL not in events
    events, _ = _run(t, [lambda k: 0.011] * 4, first=7)  # +10%: within the tolerance
    assert events[3] is Event.NONE  # step 10's check
    events, _ = _run(t, [lambda k: 0.030] * 4, first=11)  # the link got slower
    assert events[3] is Event.RETRIAL  # step 14's check
    t.begin(14, _records()[:2])
    _run(t, [lambda k: {0: 0.030, 1: 0.021}[k]] * 3, first=14)
    assert t.chosen == 1 and t.rounds == 2
    events, _ = _run(t, [lambda k: 0.005] * 4, first=17)  # faster again: also a drift
    assert events[3] is Event.RETRIAL


def _probed(trials, readings, steps, first=0, step_s=0.010):
    """Tick ``steps`` steps of ``step_s`` with a link probe that returns ``readings`` in turn."""
    it = iter(readings)
    events, now = [], getattr(trials, "fake_clock", 0.0)
    for step in range(first, first + steps):
        events.append(trials.tick(step, now, ONE, probe=lambda: next(it)))
        trials.plan_at(step)
        now += step_s
    trials.fake_clock = now
    return events


@pytest.mark.parametrize("readings, retrial", [
    ((0.050, 0.050), True),  # the link got 5x slower during the round, and stays so
    ((0.050, 0.010), False),  # one slow probe (a descheduled rank), then the link as before
    ((0.050, 0.001), False),  # two readings that disagree on the direction: no change
    ((0.0105,), False),  # within LINK_CHANGE: read once
])
def test_a_link_change_during_a_round_reruns_it_only_when_a_second_probe_confirms_it(
        readings, retrial):
    t = Trials(TrialSettings(steps=1, settle_steps=0, warmup_steps=0, recheck_every=100,
                             runoffs=0))  # (equal plans: no runoff)
    t.begin(0, _records()[:2], link_s=0.010)
    events = _probed(t, readings, 3)
    assert events[2] is (Event.RETRIAL if retrial else Event.DECIDED)
    assert t.link_s == readings[-1]  # the latest reading is the decision's link


def test_plans_within_the_margin_run_again_in_reverse_order_and_their_times_pool():
    s = TrialSettings(steps=2, settle_steps=1, warmup_steps=0, recheck_every=0, runoffs=1,
                      runoff_margin=0.1)
    t = Trials(s)
    t.begin(0, _records())
    # first pass: exact 30 ms, uniform 21 ms, model 20 ms (within 10%: a runoff); on its
    # second turn the model plan measures 25 ms, uniform 20 ms: pooled, uniform wins
    by_turn = {0: 0.030, 1: 0.021, 2: 0.020, 3: 0.025, 4: 0.020}  # t.pos: the turn
    events, plans = _run(t, [lambda k: by_turn.get(t.pos, 0.020)] * 17, first=0)
    # the runoff: model (the last turn) first, then uniform; exact is out of it
    assert plans[:15] == [0] * 3 + [1] * 3 + [2] * 3 + [2] * 3 + [1] * 3
    assert events[15] is Event.DECIDED and t.order == [0, 1, 2, 2, 1]
    m = {r.label: (r.measured_s, r.samples) for r in t.records}
    assert m["exact"] == (pytest.approx(0.030), 2)
    assert m["uniform"] == (pytest.approx(0.0205), 4)  # median of 21, 21, 20, 20
    assert m["model"] == (pytest.approx(0.0225), 4)
    assert t.chosen == 1 and t.history[-1]["runoffs"] == 1
    assert "| 4 |" in format_trials(t.records, t.chosen)


@pytest.mark.parametrize("runoffs, model_s, order", [
    (0, 0.020, [0, 1, 2]),  # runoffs off: one pass
    (1, 0.010, [0, 1, 2]),  # the fastest is far ahead: no runoff
    (2, 0.020, [0, 1, 2, 2, 1, 1, 2]),  # two passes, each reversing the one before
])
def test_a_runoff_runs_only_when_plans_are_close_and_passes_are_left(runoffs, model_s, order):
    t = Trials(TrialSettings(steps=1, settle_steps=0, warmup_steps=0, recheck_every=0,
                             runoffs=runoffs))
    t.begin(0, _records())
    durations = {0: 0.030, 1: 0.020, 2: model_s}
    events, plans = _run(t, [lambda k: durations[k]] * (len(order) + 1), first=0)
    assert plans[:len(order)] == order and events[len(order)] is Event.DECIDED
    assert t.runoffs == (len(order) - 3) // 2


def test_a_checkpoint_taken_in_a_runoff_continues_it():
    s = TrialSettings(steps=2, settle_steps=0, warmup_steps=0, recheck_every=0, runoffs=1)
    a, b = Trials(s), Trials(s)
    a.begin(0, _records())
    times = [lambda k: (0.03, 0.02, 0.0201)[k]] * 8  # 6 steps of the first pass, 2 runoff
    _run(a, times, first=0)
    assert a.runoffs == 1 and a.phase is Phase.TRIAL
    b.load_state_dict(a.state_dict())
    rest = [lambda k: (0.03, 0.02, 0.0201)[k]] * 4
    _run(a, rest, first=8)
    _run(b, rest, first=8)  # (one step more: the first resumed step is not timed)
    assert a.chosen == b.chosen == 2  # ties uniform (within 2%), with the smaller error
    assert a.order == b.order == [0, 1, 2, 2, 1]
    assert [r.samples for r in b.records] == [2, 4, 4]
    assert b.records[2].samples == a.records[2].samples


def test_a_kept_plans_check_confirms_a_link_change_before_starting_again():
    t = Trials(TrialSettings(steps=1, settle_steps=0, warmup_steps=0, recheck_every=4,
                             drift_tolerance=0.5, runoffs=0))
    t.begin(0, _records()[:2], link_s=0.010)
    assert _probed(t, [0.010], 3)[2] is Event.DECIDED  # decided at step 2; checks at 6, 10
    assert _probed(t, [0.040, 0.011], 4, first=3)[3] is Event.NONE  # a jitter
    assert _probed(t, [0.040, 0.041], 4, first=7)[3] is Event.RETRIAL  # a change
    assert [c["retrial"] for c in t.checks] == [False, True]


def test_a_checkpoint_taken_mid_round_continues_the_round():
    s = TrialSettings(steps=2, settle_steps=1, warmup_steps=0, recheck_every=0)
    a, b = Trials(s), Trials(s)
    a.begin(0, _records())
    times = [lambda k: (0.03, 0.02, 0.01)[k]] * 5
    _run(a, times, first=0)
    b.load_state_dict(a.state_dict())
    assert b.plan_at(5) == a.plan_at(5) == 1 and b.phase is Phase.TRIAL
    rest = [lambda k: (0.03, 0.02, 0.01)[k]] * 6
    _run(a, rest, first=5)
    _run(b, rest, first=5)
    assert a.chosen == b.chosen == 2
    # the resumed run's first step is not timed against the old process's clock
    assert b.records[1].measured_s == pytest.approx(0.02)
    assert a.state_dict()["corrections"] == pytest.approx(b.state_dict()["corrections"])


def test_settings_are_checked_at_construction():
    with pytest.raises(ValueError, match="trial_steps=0"):
        Compression.auto(objective="time", trial_steps=0)
    with pytest.raises(ValueError, match="alpha=0"):
        Compression.auto(objective="time", alpha=0)
    with pytest.raises(ValueError, match="alpha=-1"):
        Compression.auto(objective="time", alpha=-1)
    with pytest.raises(ValueError, match="families is empty"):
        Compression.auto(objective="time", families=())
    with pytest.raises(ValueError, match="objective='fastest'"):
        Compression.auto(objective="fastest")
    with pytest.raises(ValueError, match="model_plans"):
        Compression.auto(objective="time", model_plans=-1)
    with pytest.raises(ValueError, match="drift_tolerance"):
        Compression.auto(objective="time", drift_tolerance=-0.1)
    with pytest.raises(ValueError, match="trial_runoffs=-1"):
        Compression.auto(objective="time", trial_runoffs=-1)
    with pytest.raises(ValueError, match="trial_runoffs=1.5"):
        Compression.planned(trial_runoffs=1.5)
    with pytest.raises(ValueError, match="runoff_margin"):
        TrialSettings(runoff_margin=-0.1)
    with pytest.raises(ValueError, match="at least one plan"):
        Trials(TrialSettings()).begin(0, [])


def test_the_environment_selects_the_deciding_exchange():
    from cgx.config import Config, ConfigError
    from cgx.exchange import GradientPlan
    cfg = Config.from_env({"CGX_COMPRESSION": "auto", "CGX_AUTO_OBJECTIVE": "time"})
    plan = GradientPlan(["w", "b"], [(64, 64), (64,)], config=cfg)
    assert plan.decider is not None and plan.compression.objective.value == "time"
    plain = GradientPlan(["w"], [(64, 64)], config=Config.from_env({"CGX_COMPRESSION": "auto"}))
    assert plain.decider is None  # bytes, the default objective
    with pytest.raises(ConfigError, match="CGX_AUTO_OBJECTIVE"):
        Config.from_env({"CGX_AUTO_OBJECTIVE": "fast"})


def test_a_round_that_is_never_re_tried_reads_no_link_at_its_end():
    t = Trials(TrialSettings(steps=1, settle_steps=0, warmup_steps=0, recheck_every=0,
                             runoffs=0))
    t.begin(0, _records()[:2], link_s=0.010)
    assert _probed(t, [], 3)[2] is Event.DECIDED  # no probe taken (none to give)
