"""The time-to-accuracy report claims a speed-up only beyond the spread of its runs.

Synthetic records (no training): the pairing of runs by seed and round, the
median and min-max of the ratios, and the verdict; and that ``--rounds``
interleaves the methods inside every round.
"""

from __future__ import annotations

import argparse

from benchmarks import train
from benchmarks.timetoacc import report


def _record(method, seed, rnd, final_loss, reach_s):
    """A run whose validation loss is 2.0 at 0 s, then ``final_loss`` from ``reach_s`` on."""
    return {"workload": "cnn", "topology": "2", "rate": "1gbit", "seed": seed, "round": rnd,
            "method": method, "curve": [{"step": 0, "train_s": 0.0, "loss": 2.0},
                                        {"step": 10, "train_s": reach_s, "loss": final_loss}]}


def _rows(records):
    lines = report.speedup_table(records, slack=0.02)
    return {line.split(" | ")[1]: line for line in lines[2:]}


def test_a_ratio_whose_spread_spans_one_is_a_tie():
    recs = []
    for seed, (base, fast, noisy) in enumerate([(10.0, 4.0, 6.0), (12.0, 5.0, 14.0),
                                                 (11.0, 4.5, 9.0)]):
        recs += [_record("ddp-fp32", seed, 0, 1.0, base), _record("cgx-4bit", seed, 0, 1.0, fast),
                 _record("cgx-planned", seed, 0, 1.0, noisy)]
    rows = _rows(recs)
    assert "faster in every run" in rows["cgx-4bit"]
    assert "2.44 (2.40-2.50)" in rows["cgx-4bit"]  # 10/4, 12/5, 11/4.5: each pair its own ratio
    assert "tie" in rows["cgx-planned"] and "(0.86-1.67)" in rows["cgx-planned"]


def test_one_run_is_not_claimed_and_slower_everywhere_is_said():
    one = [_record("ddp-fp32", 0, 0, 1.0, 10.0), _record("cgx-4bit", 0, 0, 1.0, 4.0)]
    assert "1 run: no spread, not claimed" in _rows(one)["cgx-4bit"]
    two = one + [_record("ddp-fp32", 0, 1, 1.0, 10.0), _record("cgx-4bit", 0, 1, 1.0, 20.0),
                 _record("cgx-2bit", 0, 0, 1.0, 30.0), _record("cgx-2bit", 0, 1, 1.0, 40.0)]
    rows = _rows(two)
    assert "tie" in rows["cgx-4bit"]
    assert "slower in every run" in rows["cgx-2bit"]


def test_a_method_that_never_reaches_the_target_has_no_ratio():
    recs = [_record("ddp-fp32", s, 0, 1.0, 10.0) for s in (0, 1)]
    recs += [_record("cgx-2bit", s, 0, 1.5, 5.0) for s in (0, 1)]
    row = _rows(recs)["cgx-2bit"]
    assert "not reached" in row and "faster" not in row and "tie" not in row


def test_rounds_interleave_the_methods():
    args = argparse.Namespace(suite=False, study=False, workloads=("cnn",), rates=("1gbit",),
                              topology="2", seeds=(0,), methods=("ddp-fp32", "cgx-4bit"),
                              steps=5, rounds=3)
    runs = train.plan_runs(args)
    assert [(r["round"], r["method"]) for r in runs] == [
        (rnd, m) for rnd in range(3) for m in ("ddp-fp32", "cgx-4bit")]
    assert len({train.run_key(r) for r in runs}) == 6


def test_benchmark_gives_local_methods_more_steps():
    def planned(*argv):
        import argparse
        args = argparse.Namespace(suite=False, study=False, workloads=("cnn", "lm"), topology="2",
                                  rates=("100mbit",), seeds=(0,), rounds=1, steps=None,
                                  methods=argv, local_steps=3)
        return {(r["workload"], r["method"]): r["steps"] for r in train.plan_runs(args)}

    steps = planned("ddp-fp32", "cgx-4bit", "cgx-diloco-h50", "torch-postlocal-sgd")
    assert steps == {("cnn", "ddp-fp32"): 100, ("cnn", "cgx-4bit"): 100,
                     ("cnn", "cgx-diloco-h50"): 300, ("cnn", "torch-postlocal-sgd"): 300,
                     ("lm", "ddp-fp32"): 200, ("lm", "cgx-4bit"): 200,
                     ("lm", "cgx-diloco-h50"): 600, ("lm", "torch-postlocal-sgd"): 600}
    # the table says after how many steps a local method's final loss was read
    curve = lambda last: [{"step": 0, "loss": 2.0, "train_s": 0.0, "accuracy": None},  # noqa
                          {"step": last, "loss": 1.0, "train_s": 1.0, "accuracy": None}]
    rec = dict(samples_per_s=1.0, step_s=1.0, compute_s=1.0, compression_s=0.0,
               link_bytes_per_step=1.0, accounted_bytes_per_step=1.0, peak_rss_bytes=1.0)
    lines, _ = report.scenario_table([{**rec, "method": "ddp-fp32", "curve": curve(100)},
                                      {**rec, "method": "cgx-diloco-h50", "curve": curve(300)}],
                                     0.02)
    rows = [line for line in lines if line.startswith("| ")]
    assert "1.0000 (after 300 steps)" in rows[-1] and "after" not in rows[-2]
    assert report.setting_title(("lm", "2", "100mbit")) == "lm, 2 ranks, 100 Mbit/s"


def test_without_ddp_the_target_comes_from_fsdp2_fp32_and_says_so():
    recs = [_record("fsdp-fp32", 0, 0, 1.0, 10.0), _record("cgx-fsdp-4bit", 0, 0, 1.5, 4.0)]
    assert report.target_loss(recs, 0.02) == 1.0 * 1.02
    assert "2% above FSDP2 fp32's final loss" in report.target_title(recs, 0.02)
    recs.append(_record("ddp-fp32", 0, 0, 1.2, 9.0))  # DDP fp32, when run, is the reference
    assert report.target_loss(recs, 0.02) == 1.2 * 1.02
    assert "DDP fp32's final loss" in report.target_title(recs, 0.02)


def test_the_compute_bound_is_the_baselines_steps_at_the_compute_step():
    def timed(method, reach_s, steps, compute_s):
        r = _record(method, 0, 0, 1.0, reach_s)
        r["curve"][1]["step"] = steps
        return {**r, "compute_s": compute_s, "step_s": reach_s / steps, "compression_s": 0.0,
                "samples_per_s": 1.0, "link_bytes_per_step": None,
                "accounted_bytes_per_step": 0.0, "peak_rss_bytes": 0,
                "curve": [{**p, "accuracy": None} for p in r["curve"]]}
    # DDP: 100 s over 50 steps; 4-bit: 20 s over 40; compute steps 0.1, 0.2, 0.3 (median 0.2)
    recs = [timed("ddp-fp32", 100.0, 50, 0.1), timed("cgx-4bit", 20.0, 40, 0.2),
            timed("cgx-diloco-h50", 12.0, 60, 0.3)]
    lines, _ = report.scenario_table(recs, slack=0.02)
    assert lines[-1].startswith("Compute alone: 0.200 s a step")
    assert "at most 10.0x sooner than DDP fp32 (its 50 steps)" in lines[-1]   # 100/(50*0.2)
    assert "at most 2.5x sooner than per-step 4-bit (its 40 steps)" in lines[-1]  # 20/(40*0.2)
    # no baseline that reached the target: no sentence
    lines, _ = report.scenario_table([timed("cgx-diloco-h50", 12.0, 60, 0.3)], slack=0.02)
    assert not lines[-1].startswith("Compute alone")


def test_final_losses_carry_their_standard_error_and_the_target_is_set_against_ddps():
    recs = [_record("ddp-fp32", 0, 0, 1.0, 10.0), _record("cgx-4bit", 0, 0, 1.01, 4.0)]
    for r, se in zip(recs, (0.05, 0.04)):
        r.update(compute_s=0.1, step_s=1.0, compression_s=0.0, samples_per_s=1.0,
                 link_bytes_per_step=None, accounted_bytes_per_step=0.0, peak_rss_bytes=0)
        r["curve"] = [{**p, "accuracy": None} for p in r["curve"]]
        r["curve"][-1]["loss_se"] = se
    lines, _ = report.scenario_table(recs, slack=0.02)
    rows = {line.split(" | ")[0][2:]: line for line in lines if line.startswith("| cgx")}
    assert "| 1.0100 ± 0.0400 |" in rows["cgx-4bit"]
    note = next(line for line in lines if line.startswith("± is"))
    assert "is 0.0200, 0.40 of DDP's standard error (0.0500)." in note  # 2% of 1.0 over 0.05
    assert "item by item" not in note  # no items kept: no paired difference
    # The items kept: the difference is paired. Item 0 is hard for both models, which widens
    # either model's error but not their difference's: (0.02, 0.00, 0.01) -> +0.01 ± 0.01/sqrt(3).
    recs[0]["curve"][-1]["item_losses"] = [2.98, 0.01, 0.01]
    recs[1]["curve"][-1]["item_losses"] = [3.00, 0.01, 0.02]
    lines, _ = report.scenario_table(recs, slack=0.02)
    note = next(line for line in lines if line.startswith("± is"))
    assert "(± its standard error): cgx-4bit +0.0100 ± 0.0058;" in note
    # Records made before the error was measured: no ± and no sentence.
    for r in recs:
        del r["curve"][-1]["loss_se"]
    lines, _ = report.scenario_table(recs, slack=0.02)
    assert not any("±" in line for line in lines)
