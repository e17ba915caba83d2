"""Tables and plots from the run records (one record per workload, topology, link, seed, method)."""

from __future__ import annotations

import collections
import math
import statistics
from typing import Any, Iterable, Optional

from benchmarks.timetoacc.workloads import standard_error

Record = dict[str, Any]
BASELINE = "ddp-fp32"


def scenario(r: Record) -> tuple:
    """One run of every method: workload, topology, link, seed (and round, after the first)."""
    key = (r["workload"], r["topology"], r["rate"], r["seed"])
    return key + (r["round"],) if r.get("round", 0) else key


def setting(r: Record) -> tuple:
    """What a speed-up is claimed for: workload, topology, link (over every seed and round)."""
    return (r["workload"], r["topology"], r["rate"])


def setting_title(key: tuple) -> str:
    workload, topology, rate = key
    link = "unshaped" if rate == "none" else rate.replace("gbit", " Gbit/s").replace(
        "mbit", " Mbit/s")
    ranks = "2 hosts x 2 ranks" if topology == "2x2" else f"{topology} ranks"
    return f"{workload}, {ranks}, {link}"


def scenario_title(key: tuple) -> str:
    title = f"{setting_title(key[:3])}, seed {key[3]}"
    return title + (f", round {key[4]}" if len(key) > 4 else "")


TARGET_BASELINES = {BASELINE: "DDP fp32", "horovod-fp32": "Horovod fp32", "fsdp-fp32": "FSDP2 fp32"}


def _target_baseline(records: list[Record]) -> Optional[Record]:
    """The exact run the target comes from: DDP fp32, else Horovod fp32, else FSDP2 fp32."""
    for name in TARGET_BASELINES:
        for r in records:
            if r["method"] == name and "curve" in r:
                return r
    return None


def target_loss(records: list[Record], slack: float) -> Optional[float]:
    """(1 + slack) x the final validation loss of the exact baseline (:func:`_target_baseline`)."""
    base = _target_baseline(records)
    return base["curve"][-1]["loss"] * (1 + slack) if base is not None else None


def target_title(records: list[Record], slack: float) -> str:
    """The target's line over a scenario's table: the loss and the run it comes from."""
    source = _target_baseline(records)
    name = TARGET_BASELINES[source["method"]] if source is not None else "DDP fp32"
    return (f"Target: validation loss <= {_f(target_loss(records, slack), '.4f')} "
            f"({100 * slack:.0f}% above {name}'s final loss).")


def time_to(curve: list[dict], target: Optional[float]) -> tuple[Optional[float], Optional[int]]:
    """Training seconds and steps until the validation loss first reaches ``target``."""
    if target is None:
        return None, None
    for point in curve:
        if point["loss"] <= target:
            return point["train_s"], point["step"]
    return None, None


def _f(value: Optional[float], fmt: str, none: str = "-") -> str:
    return none if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def scenario_table(records: list[Record], slack: float) -> tuple[list[str], dict[str, Any]]:
    """Markdown lines for one scenario, and the time-to-target per method."""
    target = target_loss(records, slack)
    base = next((r for r in records if r["method"] == BASELINE and "curve" in r), None)
    base_t = time_to(base["curve"], target)[0] if base else None
    lines = [target_title(records, slack), "",
             "| method | samples/s | s/step: compute + exposed comm + compression | MB/step/rank "
             "(link, hosts' mean / counted, busiest rank) | peak RSS MB | final val loss "
             "| final val acc | time to target | vs DDP fp32 (this run) |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    reached = {}
    for r in records:
        if "error" in r:
            lines.append(f"| {r['method']} | failed: {r['error']} |  |  |  |  |  |  |  |")
            continue
        t, steps = time_to(r["curve"], target)
        reached[r["method"]] = t
        final = r["curve"][-1]
        link = _f(r["link_bytes_per_step"] / 1e6 if r["link_bytes_per_step"] else None, ".2f")
        exposed = max(0.0, r["step_s"] - r["compute_s"] - r["compression_s"])
        split = (f"{r['step_s']:.3f}: {r['compute_s']:.3f} + {exposed:.3f} + "
                 f"{r['compression_s']:.3f}")
        speed = f"{base_t / t:.2f}x" if base_t and t else "-"
        lines.append(
            f"| {r['method']} | {r['samples_per_s']:.0f} | {split} | "
            f"{link} / {r['accounted_bytes_per_step'] / 1e6:.2f} | {r['peak_rss_bytes'] / 2**20:.0f} | "
            f"{final['loss']:.4f}{_se(final)}{_steps_note(r, records)} | "
            f"{_f(final['accuracy'] and 100 * final['accuracy'], '.1f')} | "
            f"{_f(t, '.1f', 'not reached')}{' s' if t is not None else ''}"
            f"{f' ({steps} steps)' if steps is not None else ''} | {speed} |")
    for note in (resolution(records, slack), compute_bound(records, target)):
        if note:
            lines += ["", note]
    return lines, {"target_loss": target, "time_to_target_s": reached}


def _se(point: dict) -> str:
    """`` ± SE`` when the evaluation measured its loss's standard error."""
    return f" ± {point['loss_se']:.4f}" if point.get("loss_se") is not None else ""


def paired_difference(r: Record, base: Record) -> Optional[tuple[float, float]]:
    """``r``'s final loss minus ``base``'s over the same validation items, and that
    difference's standard error (paired: an item hard for one model is hard for both);
    None when either run did not keep its items' losses."""
    a, b = r["curve"][-1].get("item_losses"), base["curve"][-1].get("item_losses")
    if not a or not b or len(a) != len(b):
        return None
    d = [x - y for x, y in zip(a, b)]
    return statistics.fmean(d), standard_error(d)


def resolution(records: list[Record], slack: float) -> Optional[str]:
    """What the validation set resolves, as a sentence: the target's slack against DDP
    fp32's standard error and against each method's paired difference from it (None when
    the baseline's run did not measure its error)."""
    base = _target_baseline(records)
    se = base["curve"][-1].get("loss_se") if base else None
    if not se:
        return None
    margin = slack * base["curve"][-1]["loss"]
    text = (f"± is a final loss's standard error over the validation set (the CNN's images, "
            f"the LM's sequences). The target's {100 * slack:g}% above DDP fp32's final loss "
            f"is {margin:.4f}, {margin / se:.2f} of DDP's standard error ({se:.4f}).")
    pairs = []
    for r in records:
        diff = paired_difference(r, base) if r is not base and "curve" in r else None
        if diff is not None:
            pairs.append(f"{r['method']} {diff[0]:+.4f} ± {diff[1]:.4f}")
    if pairs:
        text += (" Final loss minus DDP fp32's, item by item on the same validation set "
                 f"(± its standard error): {', '.join(pairs)}; a difference within about "
                 "twice its error is not told apart by this validation set.")
    return text


def compute_bound(records: list[Record], target: Optional[float]) -> Optional[str]:
    """What the compute alone allows in this scenario, as a sentence (None when neither
    DDP fp32 nor per-step 4-bit reached the target, or no step time was measured).

    No step is shorter than a forward, backward and update without communication (each
    run measures it: ``compute_s``). A method that reached the target in as many steps as
    DDP fp32 (or per-step 4-bit) did, with free communication, would take those steps times
    that: the largest speed-up over that run any method needing at least as many steps can
    show on this machine.
    """
    ok = [r for r in records if "curve" in r and "compute_s" in r]
    compute = statistics.median(r["compute_s"] for r in ok) if ok else 0.0
    if not compute > 0:
        return None
    bounds = []
    for name, label in ((BASELINE, "DDP fp32"), ("cgx-4bit", "per-step 4-bit")):
        run = next((r for r in ok if r["method"] == name), None)
        t, steps = time_to(run["curve"], target) if run else (None, None)
        if t and steps:
            bounds.append(f"{t / (steps * compute):.1f}x sooner than {label} "
                          f"(its {steps} steps)")
    if not bounds:
        return None
    return (f"Compute alone: {compute:.3f} s a step (the runs' median). With free "
            f"communication, a method needing as many steps to the target would be at most "
            + ", at most ".join(bounds) + ".")


def _steps_note(r: Record, records: list[Record]) -> str:
    """`` (after N steps)`` when ``r`` trained other steps than DDP fp32 (local steps)."""
    base = next((b for b in records if b["method"] == BASELINE and "curve" in b), None)
    last = r["curve"][-1]["step"]
    return f" (after {last} steps)" if base and base["curve"][-1]["step"] != last else ""


def verdict(ratios: list[float]) -> str:
    """A speed-up claimed only beyond the spread: every run faster (or slower), else a tie."""
    if len(ratios) < 2:
        return "1 run: no spread, not claimed"
    if min(ratios) > 1.0:
        return "faster in every run"
    if max(ratios) < 1.0:
        return "slower in every run"
    return "tie (within the spread)"


def speedup_table(records: list[Record], slack: float) -> list[str]:
    """Per setting and method: time to target and the ratio to DDP fp32 over paired runs.

    Runs are paired by scenario (same seed and round): each pair's target is that
    pair's DDP fp32 final loss (+ slack), so a ratio compares runs made minutes
    apart on the same data; the table shows the median and the min-max over pairs.
    """
    lines = ["| setting | method | runs | time to target, s (median, min-max) | vs DDP fp32 "
             "(median, min-max) | verdict |", "|---|---|---:|---:|---:|---|"]
    settings: dict[tuple, dict[str, list]] = collections.OrderedDict()
    for recs in by_scenario(records).values():
        target = target_loss(recs, slack)
        base = next((r for r in recs if r["method"] == BASELINE and "curve" in r), None)
        base_t = time_to(base["curve"], target)[0] if base else None
        for r in recs:
            if "curve" not in r:
                continue
            t = time_to(r["curve"], target)[0]
            per = settings.setdefault(setting(r), collections.OrderedDict())
            per.setdefault(r["method"], []).append((t, base_t / t if base_t and t else None))
    for key, per in settings.items():
        for method, runs in per.items():
            times = [t for t, _ in runs if t is not None]
            ratios = [x for _, x in runs if x is not None]
            span = lambda xs, f: (f"{statistics.median(xs):{f}} ({min(xs):{f}}-{max(xs):{f}})"  # noqa: E731
                                  if xs else "not reached")
            lines.append(f"| {setting_title(key)} | {method} | {len(runs)} | {span(times, '.1f')} | "
                         f"{span(ratios, '.2f') if method != BASELINE else '1'} | "
                         f"{'-' if method == BASELINE or not ratios else verdict(ratios)} |")
    return lines


def study_table(records: list[Record]) -> list[str]:
    """Mean and spread over seeds of the final validation loss/accuracy, per workload and method."""
    groups: dict[tuple, list[Record]] = collections.defaultdict(list)
    for r in records:
        if "curve" in r:
            groups[(r["workload"], r["method"])].append(r)
    lines = ["| workload | method | seeds | final val loss (mean +- sd) | vs fp32 | final val acc "
             "(mean +- sd) | vs fp32 (points) | holds the target? |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for workload in sorted({w for w, _ in groups}):
        base = groups.get((workload, BASELINE))
        base_loss = statistics.mean(r["curve"][-1]["loss"] for r in base) if base else None
        accs = [r["curve"][-1]["accuracy"] for r in base or [] if r["curve"][-1]["accuracy"] is not None]
        base_acc = statistics.mean(accs) if accs else None
        for (w, method), rs in sorted(groups.items(), key=lambda kv: (kv[0][1] != BASELINE, kv[0][1])):
            if w != workload:
                continue
            losses = [r["curve"][-1]["loss"] for r in rs]
            acc = [r["curve"][-1]["accuracy"] for r in rs if r["curve"][-1]["accuracy"] is not None]
            mean_loss = statistics.mean(losses)
            d_loss = (mean_loss / base_loss - 1) if base_loss else None
            mean_acc = statistics.mean(acc) if acc else None
            d_acc = 100 * (mean_acc - base_acc) if mean_acc is not None and base_acc is not None else None
            # Target: within 0.5 accuracy points, or within 2% validation loss.
            holds = "-" if method == BASELINE or d_loss is None else (
                "yes" if (d_acc is not None and d_acc >= -0.5) or d_loss <= 0.02 else "no")
            sd = lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0  # noqa: E731
            lines.append(
                f"| {workload} | {method} | {len(rs)} | {mean_loss:.4f} +- {sd(losses):.4f} | "
                f"{_f(d_loss and 100 * d_loss, '+.1f')}{'%' if d_loss is not None else ''} | "
                f"{_f(mean_acc and 100 * mean_acc, '.1f')}{(' +- %.1f' % (100 * sd(acc))) if acc else ''} | "
                f"{_f(d_acc, '+.1f')} | {holds} |")
    return lines


def plot_scenario(records: list[Record], target: Optional[float], title: str, path: str) -> None:
    """Validation loss versus training wall time (one curve per method) and throughput bars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if "curve" in r]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    for r in ok:
        xs = [p["train_s"] for p in r["curve"]]
        ys = [p["loss"] for p in r["curve"]]
        style = "-" if r["method"].startswith("cgx") else "--"
        ax.plot(xs, ys, style, label=r["method"], lw=1.4)
    if target is not None:
        ax.axhline(target, color="k", lw=0.8, ls=":", label="target")
    ax.set(xlabel="training wall time, s (evaluation excluded)", ylabel="validation loss",
           title=title)
    ax.set_yscale("log")
    ax.legend(fontsize=7, ncol=2)
    names = [r["method"] for r in ok]
    rates = [r["samples_per_s"] for r in ok]
    colors = ["#1f77b4" if n.startswith("cgx") else "#2ca02c" if n.startswith("horovod") else "#ff7f0e"
              for n in names]
    bx.barh(names, rates, color=colors)
    for i, v in enumerate(rates):
        bx.text(v, i, f" {v:.0f}", va="center", fontsize=7)
    bx.invert_yaxis()
    bx.set(xlabel="samples/s (all ranks; higher is better)")
    bx.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def by_scenario(records: Iterable[Record]) -> dict[tuple, list[Record]]:
    out: dict[tuple, list[Record]] = collections.OrderedDict()
    for r in records:
        out.setdefault(scenario(r), []).append(r)
    return out
