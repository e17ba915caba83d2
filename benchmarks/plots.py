"""The benchmarks page's plots and tables, from the stored results (no benchmark is run).

    python benchmarks/plots.py              # writes docs/results/plots/*.png
    python benchmarks/plots.py --tables     # prints the page's tables (markdown)

Each figure reads the JSON files named in ``SOURCES`` (under docs/results/) and nothing
else: time to accuracy from ``make bench``'s suite, the VGG-11 step at each link rate from
the paired runs of ``benchmarks/decide_paired.py``, the bytes per step from
``benchmarks/training.py`` and the suite, and the 100 Mbit/s local-step methods from
``benchmarks/train.py --rates 100mbit``. docs/benchmarks/index.md embeds the plots and
shows the tables; tests/test_benchmark_plots.py regenerates both from the JSON.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
from typing import Optional

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
PLOTS = RESULTS / "plots"

# plot name -> the JSON files (docs/results/) it is drawn from
SOURCES = {
    "time-to-accuracy": ["train.json"],
    "step-time": ["decide-paired-1gbit.json", "decide-paired-10gbit.json",
                  "decide-paired-none.json"],
    "bytes-per-step": ["decide-quiet-1gbit-default.json", "train.json"],
    "slow-links": ["train-slowlink.json", "train-slowlink-bn.json", "train-slowlink-cuda.json"],
}

LABELS = {
    "compute": "compute only (no exchange)",
    "ddp-fp32": "DDP fp32",
    "ddp-fp16": "DDP fp16 hook",
    "ddp-bf16": "DDP bf16 hook",
    "ddp-powersgd": "DDP PowerSGD rank 1",
    "ddp-powersgd-r1": "DDP PowerSGD rank 1",
    "ddp-powersgd-r4": "DDP PowerSGD rank 4",
    "horovod-fp32": "Horovod fp32",
    "horovod-fp16": "Horovod fp16",
    "cgx-optimizer-8bit": "cgx 8-bit",
    "cgx-8bit": "cgx 8-bit",
    "cgx-8bit-ef": "cgx 8-bit + EF",
    "cgx-optimizer": "cgx 4-bit",
    "cgx-4bit": "cgx 4-bit",
    "cgx-4bit-ef": "cgx 4-bit + EF",
    "cgx-4bit-flat": "cgx 4-bit, flat over 4 ranks",
    "cgx-optimizer-sfb": "cgx 4-bit + factors",
    "cgx-4bit-sfb": "cgx 4-bit + factors",
    "cgx-2bit": "cgx 2-bit",
    "cgx-2bit-ef": "cgx 2-bit + EF",
    "cgx-auto": "cgx auto",
    "cgx-planned": "cgx planned",
    "cgx-planned-sfb": "cgx planned + factors",
    "cgx-decide": "cgx deciding (the default)",
    "cgx-decide-sfb": "cgx deciding, given the model",
    "torch-postlocal-sgd": "torch post-local SGD (H = 50)",
    "torchft-diloco": "torchft DiLoCo (H = 50)",
    "torchft-diloco-streaming": "torchft Streaming DiLoCo",
    "cgx-diloco-h50": "cgx DiLoCo (H = 50)",
    "cgx-diloco-h50-followlr": "cgx DiLoCo, follow_inner_lr",
    "cgx-diloco-auto": "cgx DiLoCo, sync_every=\"auto\"",
    "cgx-diloco-streaming": "cgx Streaming DiLoCo",
    "cgx-diloco-streaming-followlr": "cgx Streaming DiLoCo, follow_inner_lr",
    "cgx-localsgd": "cgx local SGD (4-bit)",
}

RATES = [("1gbit", "1 Gbit/s"), ("10gbit", "10 Gbit/s"), ("none", "unshaped")]


def label(method: str) -> str:
    return LABELS.get(method, method)


def load(name: str, results: pathlib.Path = RESULTS):
    return json.loads((results / name).read_text())


def _color(method: str) -> str:
    if method == "compute":
        return "#888888"
    if method.startswith("cgx"):
        return "#1f77b4"
    if method.startswith("horovod"):
        return "#2ca02c"
    if method.startswith("torch"):
        return "#9467bd"
    return "#ff7f0e"


# ---------------------------------------------------------------- time to accuracy

# (scenario key in train.json's time_to_target, column title)
TTA_SCENARIOS = [
    ("cnn, 2 ranks, 1 Gbit/s, seed 0", "CNN, 1 Gbit/s"),
    ("cnn, 2 ranks, 10 Gbit/s, seed 0", "CNN, 10 Gbit/s"),
    ("cnn, 2 ranks, unshaped, seed 0", "CNN, unshaped"),
    ("lm, 2 ranks, 1 Gbit/s, seed 0", "LM, 1 Gbit/s"),
    ("lm, 2 ranks, unshaped, seed 0", "LM, unshaped"),
    ("cnn, 2 hosts x 2 ranks, 1 Gbit/s, seed 0", "CNN, 2 x 2 ranks, 1 Gbit/s"),
]


def time_to_accuracy(results: pathlib.Path = RESULTS):
    """{column title: {method: seconds to the target or None}} and the method order."""
    ttt = load("train.json", results)["time_to_target"]
    out, order = {}, []
    for key, title in TTA_SCENARIOS:
        times = ttt[key]["time_to_target_s"]
        out[title] = times
        order += [m for m in times if m not in order]
    return out, order


def _grid(first: str, columns, rows) -> str:
    """A markdown table: ``first`` and ``columns`` head it, each ``(name, cells)`` is a row."""
    lines = [f"| {first} | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    lines += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows]
    return "\n".join(lines)


def _tta_cell(times: dict, m: str) -> str:
    if m not in times:
        return ""
    if times[m] is None:
        return "not reached"
    return f"{times[m]:.1f} s ({times['ddp-fp32'] / times[m]:.2f}x)"


def time_to_accuracy_table(results: pathlib.Path = RESULTS) -> str:
    data, order = time_to_accuracy(results)
    return _grid("method", list(data),
                 [(label(m), [_tta_cell(times, m) for times in data.values()]) for m in order])


def plot_time_to_accuracy(out: pathlib.Path, results: pathlib.Path = RESULTS) -> pathlib.Path:
    plt = _pyplot()
    data, order = time_to_accuracy(results)
    fig, axes = plt.subplots(2, 3, figsize=(13, 8.5))
    for ax, (title, times) in zip(axes.flat, data.items()):
        methods = [m for m in order if m in times]
        ys = range(len(methods))
        vals = [times[m] or 0.0 for m in methods]
        ax.barh(ys, vals, color=[_color(m) for m in methods])
        top = max(v for v in vals if v) * 1.45
        for y, m in zip(ys, methods):
            t = times[m]
            text = "not reached" if t is None else f" {t:.0f} s, {times['ddp-fp32'] / t:.2f}x"
            ax.text(t or 0.0, y, text, va="center", fontsize=7,
                    color="#aa0000" if t is None else "black")
        ax.set_yticks(list(ys), [label(m) for m in methods], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, top)
        ax.axvline(times["ddp-fp32"], color="k", lw=0.7, ls=":")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("seconds of training to DDP fp32's loss + 2% (lower is better)", fontsize=7)
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle("Time to accuracy (one run per method; x: speed-up over DDP fp32, dotted line)",
                 fontsize=11)
    return _save(fig, out / "time-to-accuracy.png")


# ---------------------------------------------------------------- step time

def step_time(results: pathlib.Path = RESULTS):
    """{rate title: {method: (median, min, max) of the blocks' s/step}} and the method order."""
    out, order = {}, []
    for (rate, title), name in zip(RATES, SOURCES["step-time"]):
        d = load(name, results)
        assert d["rate"] == rate, (name, d["rate"])
        methods = d["others"] + d["deciding"]
        out[title] = {m: (statistics.median(d["times_s"][m]), min(d["times_s"][m]),
                          max(d["times_s"][m])) for m in methods}
        order += [m for m in methods if m not in order]
    return out, order


def step_time_table(results: pathlib.Path = RESULTS) -> str:
    data, order = step_time(results)

    def cell(steps: dict, m: str) -> str:
        med, lo, hi = steps[m]
        return f"{med:.3f} ({lo:.3f}-{hi:.3f}), {steps['ddp-fp32'][0] / med:.2f}x"

    return _grid("method", [f"{t}: s/step (blocks' range), vs DDP fp32" for t in data],
                 [(label(m), [cell(steps, m) for steps in data.values()]) for m in order])


def plot_step_time(out: pathlib.Path, results: pathlib.Path = RESULTS) -> pathlib.Path:
    plt = _pyplot()
    data, order = step_time(results)
    fig, axes = plt.subplots(1, len(data), figsize=(13, 4.2), sharey=True)
    ys = list(range(len(order)))
    for ax, (title, steps) in zip(axes, data.items()):
        med = [steps[m][0] for m in order]
        err = [[steps[m][0] - steps[m][1] for m in order], [steps[m][2] - steps[m][0] for m in order]]
        ax.barh(ys, med, xerr=err, color=[_color(m) for m in order], error_kw={"lw": 0.8})
        for y, m in zip(ys, order):
            ax.text(steps[m][2], y, f" {steps[m][0]:.2f}", va="center", fontsize=7)
        ax.set_title(f"link {title}", fontsize=10)
        ax.set_xlabel("s per step: median of 16 blocks, bar: range (lower is better)", fontsize=7)
        ax.set_xlim(0, max(s[2] for s in steps.values()) * 1.2)
        ax.tick_params(labelsize=7)
    axes[0].set_yticks(ys, [label(m) for m in order])
    axes[0].invert_yaxis()
    fig.suptitle("VGG-11 training step, 2 ranks, every method in every block "
                 "(benchmarks/decide_paired.py)", fontsize=11)
    return _save(fig, out / "step-time.png")


# ---------------------------------------------------------------- bytes per step

def bytes_per_step(results: pathlib.Path = RESULTS):
    """{workload title: {method: bytes one rank's link carried per step}}."""
    vgg = load(SOURCES["bytes-per-step"][0], results)
    out = {"VGG-11 (28.1 M parameters)": {r["method"]: r["link_bytes"] for r in vgg["results"]
                                          if r["method"] != "compute"}}
    train = load("train.json", results)["records"]
    for workload, title in (("cnn", "CNN (19.2 M parameters)"), ("lm", "LM (1.5 M parameters)")):
        out[title] = {r["method"]: r["link_bytes_per_step"] for r in train
                      if r["workload"] == workload and r["topology"] == "2"
                      and r["rate"] == "1gbit" and r["kind"] == "time"}
    return out


def bytes_table(results: pathlib.Path = RESULTS) -> str:
    data = bytes_per_step(results)
    order: list[str] = []
    for per in data.values():
        order += [label(m) for m in per if label(m) not in order]
    by_label = {t: {label(m): b for m, b in per.items()} for t, per in data.items()}

    def cell(per: dict, name: str) -> str:
        b, fp32 = per.get(name), per["DDP fp32"]
        if b is None:
            return ""
        if fp32 / b < 1.05:  # DDP fp32 itself, and what sends as much
            return f"{b / 1e6:.2f}"
        return f"{b / 1e6:.2f} ({fp32 / b:.1f}x fewer)"

    return _grid("method", [f"{t}: MB/step/rank" for t in data],
                 [(name, [cell(per, name) for per in by_label.values()]) for name in order])


def plot_bytes(out: pathlib.Path, results: pathlib.Path = RESULTS) -> pathlib.Path:
    plt = _pyplot()
    data = bytes_per_step(results)
    fig, axes = plt.subplots(1, len(data), figsize=(13, 4.6))
    for ax, (title, per) in zip(axes, data.items()):
        methods = list(per)
        ys = range(len(methods))
        vals = [per[m] / 1e6 for m in methods]
        ax.barh(ys, vals, color=[_color(m) for m in methods])
        for y, v in zip(ys, vals):
            ax.text(v, y, f" {v:.2f}", va="center", fontsize=7)
        ax.set_xscale("log")
        ax.set_xlim(min(vals) / 1.5, max(vals) * 4)
        ax.set_yticks(list(ys), [label(m) for m in methods], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("MB per step a rank's link carried (log scale; lower is better)", fontsize=7)
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle("Bytes per step on the link, 1 Gbit/s, 2 ranks", fontsize=11)
    return _save(fig, out / "bytes-per-step.png")


# ---------------------------------------------------------------- slow links

SLOW = [("train-slowlink.json", "lm", "LM (AdamW), CPU"),
        ("train-slowlink-bn.json", "cnn", "CNN (SGD), CPU"),
        ("train-slowlink-cuda.json", "lm", "LM (AdamW), H200")]


def slow_links(results: pathlib.Path = RESULTS):
    """{column title: {method: (per-seed DDP fp32 / method ratios, seeds run)}}, the method
    order, and each column's DDP fp32 seconds to the target per seed. A method counts where it
    ran in every seed of its column; a seed where it missed the target has no ratio."""
    out, order, ddp = {}, [], {}
    for name, workload, title in SLOW:
        ttt = load(name, results)["time_to_target"]
        seeds = [v["time_to_target_s"] for k, v in ttt.items() if k.startswith(workload + ",")]
        everywhere = [m for m in seeds[0] if all(m in s for s in seeds)]
        ddp[title] = [s["ddp-fp32"] for s in seeds]
        out[title] = {m: ([s["ddp-fp32"] / s[m] for s in seeds if s[m]], len(seeds))
                      for m in everywhere if m != "ddp-fp32"}
        order += [m for m in everywhere if m not in order and m != "ddp-fp32"]
    return out, order, ddp


def _ratio(ratios: list[float], seeds: int) -> str:
    if not ratios:
        return f"not reached in {seeds} seeds"
    text = f"{statistics.median(ratios):.1f}x ({min(ratios):.1f}-{max(ratios):.1f})"
    return text if len(ratios) == seeds else f"{text}, {len(ratios)} of {seeds} seeds reached"


def slow_links_table(results: pathlib.Path = RESULTS) -> str:
    data, order, ddp = slow_links(results)
    lines = ["| 100 Mbit/s, time to target: vs DDP fp32, median (min-max) of seeds | "
             + " | ".join(f"{t}, {len(ddp[t])} seeds" for t in data) + " |",
             "|---|" + "---:|" * len(data),
             "| DDP fp32: seconds to the target (min-max) | "
             + " | ".join(f"{statistics.median(s):.0f} s ({min(s):.0f}-{max(s):.0f})"
                          for s in ddp.values()) + " |"]
    for m in order:
        cells = ["" if m not in per else _ratio(*per[m]) for per in data.values()]
        lines.append(f"| {label(m)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_slow_links(out: pathlib.Path, results: pathlib.Path = RESULTS) -> pathlib.Path:
    plt = _pyplot()
    data, order, _ = slow_links(results)
    fig, axes = plt.subplots(1, len(data), figsize=(13, 4.6), sharey=True)
    ys = list(range(len(order)))
    for ax, (title, per) in zip(axes, data.items()):
        for y, m in zip(ys, order):
            if m not in per:
                continue
            ratios, seeds = per[m]
            if not ratios:
                ax.text(1.0, y, f" not reached ({seeds} seeds)", va="center", fontsize=7,
                        color="#aa0000")
                continue
            med = statistics.median(ratios)
            ax.barh(y, med, xerr=[[med - min(ratios)], [max(ratios) - med]], color=_color(m),
                    error_kw={"lw": 0.8})
            note = "" if len(ratios) == seeds else f" ({len(ratios)} of {seeds} seeds)"
            ax.text(max(ratios), y, f" {med:.1f}x{note}", va="center", fontsize=7)
        ax.axvline(1.0, color="k", lw=0.7, ls=":")
        ax.set_xscale("log")
        ax.set_xlim(0.8, 120)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("sooner than DDP fp32 to its loss + 2% (median, bar: seeds' range; log)",
                      fontsize=7)
        ax.tick_params(labelsize=7)
    axes[0].set_yticks(ys, [label(m) for m in order])
    axes[0].invert_yaxis()
    fig.suptitle("Local-step methods at 100 Mbit/s, 2 ranks (3x DDP's steps; "
                 "benchmarks/train.py --rates 100mbit)", fontsize=11)
    return _save(fig, out / "slow-links.png")


# ---------------------------------------------------------------- driver

def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: pathlib.Path) -> pathlib.Path:
    fig.tight_layout()
    # no Software entry: the same JSON and matplotlib give the same bytes
    fig.savefig(path, dpi=100, metadata={"Software": None})
    _pyplot().close(fig)
    return path


PLOTTERS = {"time-to-accuracy": plot_time_to_accuracy, "step-time": plot_step_time,
            "bytes-per-step": plot_bytes, "slow-links": plot_slow_links}
TABLES = {"time-to-accuracy": time_to_accuracy_table, "step-time": step_time_table,
          "bytes-per-step": bytes_table, "slow-links": slow_links_table}


def write_plots(out: pathlib.Path = PLOTS, results: pathlib.Path = RESULTS) -> list[pathlib.Path]:
    out.mkdir(parents=True, exist_ok=True)
    return [plot(out, results) for plot in PLOTTERS.values()]


def tables(results: pathlib.Path = RESULTS) -> dict[str, str]:
    return {name: make(results) for name, make in TABLES.items()}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=PLOTS, help="folder for the PNGs")
    ap.add_argument("--results", type=pathlib.Path, default=RESULTS,
                    help="folder of the JSON files (docs/results)")
    ap.add_argument("--tables", action="store_true", help="print the tables, write no plot")
    args = ap.parse_args(argv)
    if args.tables:
        for name, text in tables(args.results).items():
            print(f"<!-- {name}: benchmarks/plots.py --tables -->\n{text}\n")
        return 0
    for path in write_plots(args.out, args.results):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
