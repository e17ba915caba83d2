"""Time to accuracy: real training over simulated links, cgx against DDP, PowerSGD and Horovod.

Two workloads (``benchmarks/timetoacc/workloads.py``): a VGG-style CNN on
scikit-learn's digits and a transformer LM on the Python standard library's
source. Every method trains the same steps on the same samples, each rank in
its own network namespace (``benchmarks/netsim``), over a ``tc tbf`` link of the
chosen rate, or 2 hosts x 2 ranks. Per method: samples/s, the step split
(compute / exposed communication / compression), bytes per step on the link
(measured at each host's interface, averaged over the hosts) and as counted by the
method (its busiest rank's: a broadcast is sent by its root only, so DiLoCo's anchors
count on rank 0 and on half the links), peak RSS, final
validation loss and accuracy, and the training time to reach the target loss
(DDP fp32's final loss, plus ``--slack``).

    .venv/bin/python benchmarks/train.py                         # 2 ranks, cnn, 1 Gbit/s
    .venv/bin/python benchmarks/train.py --workloads cnn,lm --rates 1gbit,10gbit,none
    .venv/bin/python benchmarks/train.py --topology 2x2 --methods ddp-fp32,cgx-4bit,cgx-4bit-flat
    .venv/bin/python benchmarks/train.py --rounds 3 --methods ddp-fp32,cgx-4bit  # interleaved
    .venv/bin/python benchmarks/train.py --study                 # accuracy: 3 seeds, unshaped
    .venv/bin/python benchmarks/train.py --suite                 # all of the above (make bench)

Writes ``<out>.json`` (every record, with loss curves), ``<out>.md`` and one
``<out>-<scenario>.png`` per scenario (loss versus wall time, throughput).
``--resume`` keeps the runs already in ``<out>.json``. A speed-up is claimed
only over several runs: the report pairs the runs of one seed and round, and a
ratio whose min-max over the pairs spans 1 is reported as a tie.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.timetoacc import methods as M  # noqa: E402
from benchmarks.timetoacc import report  # noqa: E402
from benchmarks.timetoacc.methods_diloco import DILOCO_METHODS, handles as is_local  # noqa: E402
from benchmarks.timetoacc.methods_fsdp import FSDP_METHODS  # noqa: E402
from benchmarks.timetoacc.workloads import WORKLOADS  # noqa: E402

STEPS = {"cnn": 100, "lm": 200}
STUDY_METHODS = ("ddp-fp32", "cgx-8bit", "cgx-8bit-ef", "cgx-4bit", "cgx-4bit-ef", "cgx-2bit",
                 "cgx-2bit-ef", "cgx-auto")
HOSTS_METHODS = ("ddp-fp32", "horovod-fp32", "cgx-4bit", "cgx-4bit-flat")
TOPOLOGIES = {"2": (2, 1), "4": (4, 1), "2x2": (4, 2)}  # name -> (ranks, ranks per host)
SLOW_LINK_METHODS = ("ddp-fp32", "cgx-4bit", *DILOCO_METHODS)  # --rates 100mbit in --suite
FSDP_HOSTS_METHODS = ("ddp-fp32", "fsdp-bf16", "cgx-fsdp-4bit", "cgx-fsdp-hier")  # 2x2 in --suite


def horovod_available() -> tuple[bool, str]:
    try:
        import importlib.metadata as md
        version = md.version("horovod")
    except Exception:
        return False, "Horovod is not installed (make test builds it: scripts/build-horovod.sh)"
    return (True, "") if version == "0.28.1" else (False, f"Horovod {version} installed, 0.28.1 needed")


def steps_of(method: str, workload: str, args) -> int:
    """A run's steps: the workload's (or ``--steps``), times ``--local-steps`` for the
    low-communication methods. Local steps change the loss per step (the ranks drift apart
    between syncs) but cost a fraction of a synchronous step on a slow link: the time to
    the target, not the loss after DDP's step count, is what a user of them compares."""
    steps = args.steps or STEPS[workload]
    return steps * getattr(args, "local_steps", 1) if is_local(method) else steps


def plan_runs(args) -> list[dict[str, Any]]:
    """Every run to make: workload, topology, rate, seed, method, steps."""
    runs = []

    def add(workloads, topology, rates, seeds, methods, kind, rounds=1):
        # Methods interleaved inside each seed and round: a drift of the machine's speed
        # over the minutes of a setting touches every method alike.
        for w in workloads:
            for rate in rates:
                for rnd in range(rounds):
                    for seed in seeds:
                        for m in methods:
                            runs.append({"workload": w, "topology": topology, "rate": rate,
                                         "seed": seed, "round": rnd, "method": m,
                                         "steps": steps_of(m, w, args), "kind": kind})

    if args.suite:  # the runs behind the targets first: an interrupted suite has them
        # The settings whose speed-ups README claims: 3 seeds, so a ratio has a spread.
        add(("cnn",), "2", ("1gbit",), (0, 1, 2), M.DEFAULT_METHODS, "time")
        add(("lm",), "2", ("1gbit",), (0, 1, 2), M.DEFAULT_METHODS, "time")
        add(("cnn",), "2", ("none",), (0,), M.DEFAULT_METHODS, "time")
        add(("cnn",), "2x2", ("1gbit",), (0,), HOSTS_METHODS, "time")
        add(WORKLOADS, "2", ("none",), (0, 1, 2), STUDY_METHODS, "study")
        add(("cnn",), "2", ("10gbit",), (0,), M.DEFAULT_METHODS, "time")
        add(("lm",), "2", ("none",), (0,), M.DEFAULT_METHODS, "time")
        # Slow links: local steps (DiLoCo, post-local SGD) against per-step compression.
        add(("lm", "cnn"), "2", ("100mbit",), (0, 1, 2), SLOW_LINK_METHODS, "time")
        # Sharded training (FSDP2): its own fp32/bf16 reduce-scatter against cgx's; DDP fp32
        # gives the target loss.
        add(("lm",), "2", ("1gbit", "none"), (0, 1, 2), ("ddp-fp32", *FSDP_METHODS), "time")
        add(("lm",), "2x2", ("1gbit",), (0,), FSDP_HOSTS_METHODS, "time")
    elif args.study:
        add(args.workloads, args.topology, ("none",), args.seeds or (0, 1, 2),
            args.methods or STUDY_METHODS, "study")
    else:
        add(args.workloads, args.topology, args.rates, args.seeds or (0,),
            args.methods or (HOSTS_METHODS if args.topology == "2x2" else M.DEFAULT_METHODS), "time",
            args.rounds)
    # A study run at seed 0 on an unshaped link is the same run as the timed one: made once.
    seen, unique = set(), []
    for r in runs:
        key = run_key(r)
        if key not in seen:
            seen.add(key)
            unique.append(r)
    return unique


def run_key(r: dict[str, Any]) -> tuple:
    """What makes a run distinct (a resumed suite skips the keys it has)."""
    return (r["workload"], r["topology"], r["rate"], r["seed"], r.get("round", 0), r["method"],
            r["steps"])


def run_one(run: dict[str, Any], args) -> dict[str, Any]:
    from benchmarks.netsim import RankFailedError, SlowNetwork
    n_ranks, per_host = TOPOLOGIES[run["topology"]]
    record = {k: run[k] for k in ("workload", "topology", "rate", "seed", "round", "method",
                                  "kind")}
    t0 = time.perf_counter()
    try:
        with SlowNetwork(n_ranks=n_ranks, ranks_per_host=per_host,
                         rate=None if run["rate"] == "none" else run["rate"]) as net:
            ranks = net.run_function(
                "benchmarks.timetoacc.rank:train",
                {"method": run["method"], "workload": run["workload"], "steps": run["steps"],
                 "eval_every": args.eval_every, "seed": run["seed"], "tiny": args.tiny,
                 "device": args.device, "bn_batches": args.bn_batches},
                timeout=args.timeout)
    except RankFailedError as exc:  # report a method that crashes, keep the others
        record["error"] = str(exc).splitlines()[-1][:300]
        return record
    r0 = ranks[0]
    record.update({k: v for k, v in r0.items() if k not in ("rank",)})
    # The slowest rank's step; the link bytes of every host's first rank, averaged.
    record["step_s"] = max(r["step_s"] for r in ranks)
    record["samples_per_s"] = r0["samples_per_step"] / record["step_s"]
    record["exposed_comm_s"] = max(0.0, record["step_s"] - r0["compute_s"] - r0["compression_s"])
    links = [r["link_bytes_per_step"] for r in ranks if r["link_bytes_per_step"] is not None]
    record["link_bytes_per_step"] = sum(links) / len(links) if links else None
    record["accounted_bytes_per_step"] = max(r["accounted_bytes_per_step"] for r in ranks)
    record["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in ranks)
    record["samples_trained_per_rank"] = [r["samples_trained"] for r in ranks]
    record["train_loss_finite"] = all(r["train_loss_finite"] for r in ranks)
    record["wall_s"] = time.perf_counter() - t0
    return record


def _gpu_name() -> str:
    import torch
    return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"


# png path -> digest of the records it was drawn from: a write after a run redraws only
# the plot of that run's scenario (drawing one takes most of a second)
_PLOTTED: dict[str, str] = {}


def _digest(value) -> str:
    return hashlib.sha1(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def write_outputs(records: list[dict[str, Any]], args, argv: list[str]) -> str:
    out = args.out
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    machine = (f"{os.cpu_count()} cores ({platform.processor() or platform.machine()}), no GPU, "
               "every rank 1 thread; all ranks share these cores (4 ranks on 2 cores run at about "
               "half speed each)") if args.device == "cpu" else (
        f"{_gpu_name()}, every rank's model on it (the ranks share the one GPU; their bytes go "
        f"over Gloo, staged through host memory), {os.cpu_count()} cores, every rank 1 thread")
    lines = [f"Command: `python benchmarks/train.py {' '.join(argv)}`", "", f"Machine: {machine}.", ""]
    summary = {}
    # A scenario gets a table when one of its runs was asked for as a timed run (the
    # study's seed-0 unshaped runs then serve both, as they are made once).
    timed_keys = {report.scenario(r) for r in records if r.get("kind") == "time"}
    timed = [r for r in records if report.scenario(r) in timed_keys]
    for key, recs in report.by_scenario(timed).items():
        title = report.scenario_title(key)
        table, times = report.scenario_table(recs, args.slack)
        summary[title] = times
        png = f"{out}-{'-'.join(str(k) for k in key)}.png"
        drawn_from = _digest([recs, args.slack])
        if any("curve" in r for r in recs) and (
                _PLOTTED.get(png) != drawn_from or not os.path.exists(png)):
            report.plot_scenario(recs, times["target_loss"], title, png)
            _PLOTTED[png] = drawn_from
        lines += [f"### {title}", ""]
        if key[1] == "2x2":
            lines += ["4 ranks share the 2 cores here: every step's compute takes about twice "
                      "as long as with 2 ranks, which hides more of the communication than a "
                      "real 2 x 2 cluster would. cgx's default on 2 hosts x 2 ranks is its "
                      "hierarchical reduction (inside a host, then across); `-flat` is one SRA "
                      "over all 4 ranks.", ""]
        lines += [*table, "", f"![{title}]({os.path.basename(png)})", ""]
        plans = [r for r in recs if r.get("plan")]
        for r in plans[:1]:
            lines += [f"Last plan ({r['method']}, rank 0):", "", "```", r["plan"], "```", ""]
    lines += ["### Time to target over seeds and rounds", "",
              "Each ratio compares runs of one seed and round (methods interleaved, minutes "
              "apart); a speed-up is claimed only when every run shows it, a ratio whose "
              "min-max spans 1 is a tie.", "", *report.speedup_table(timed, args.slack), ""]
    study = [r for r in records if r.get("kind") == "study" or
             (r.get("rate") == "none" and r.get("topology") == "2")]
    if any(r.get("kind") == "study" for r in records):
        lines += ["### Accuracy over seeds (2 ranks, unshaped link)", "",
                  *report.study_table(study), ""]
    md = "\n".join(lines)
    with open(out + ".md", "w") as f:
        f.write(md + "\n")
    with open(out + ".json", "w") as f:
        json.dump({"command": argv, "machine": machine, "slack": args.slack,
                   "time_to_target": summary, "records": records}, f, indent=1)
    return md


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    csv = lambda s: tuple(x for x in s.split(",") if x)  # noqa: E731
    p.add_argument("--workloads", type=csv, default=("cnn",), help=f"from {WORKLOADS}")
    p.add_argument("--rates", type=csv, default=("1gbit",), help="tc rates; 'none': unshaped")
    p.add_argument("--topology", default="2", choices=sorted(TOPOLOGIES),
                   help="'2'/'4' ranks, one per host; '2x2': 2 hosts x 2 ranks")
    p.add_argument("--methods", type=csv, default=None, help=M.__doc__.split("\n\n")[1])
    p.add_argument("--seeds", type=lambda s: tuple(int(x) for x in csv(s)), default=None)
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat every timed run this many times, methods interleaved")
    p.add_argument("--steps", type=int, default=None, help=f"training steps (default {STEPS})")
    p.add_argument("--local-steps", type=int, default=3,
                   help="the low-communication methods (DiLoCo, post-local SGD) train this many "
                        "times the steps (default 3): their time to the target counts")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--bn-batches", type=int, default=0,
                   help="evaluate a model with BatchNorm with its statistics re-estimated "
                        "from this many training batches (0: the running ones); every method")
    p.add_argument("--slack", type=float, default=0.02,
                   help="target loss = (1 + slack) x DDP fp32's final validation loss")
    p.add_argument("--study", action="store_true", help="accuracy study: 3 seeds, unshaped link")
    p.add_argument("--suite", action="store_true",
                   help="everything `make bench` runs (4 to 6 hours on 2 cores)")
    p.add_argument("--tiny", action="store_true", help="tiny models (the test suite's version)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where every rank's model trains (cuda: all ranks on one GPU, their "
                        "bytes over Gloo; DDP's, FSDP2's, post-local SGD's and cgx's methods)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--resume", action="store_true", help="keep the runs already in <out>.json")
    p.add_argument("--out", default="docs/results/train")
    return p


def _check(p: argparse.ArgumentParser, args) -> None:
    """What the parser cannot check alone; a bad value exits through ``p.error``."""
    for w in args.workloads:
        if w not in WORKLOADS:
            p.error(f"unknown workload {w!r}; choose from {WORKLOADS}")
    try:
        for m in args.methods or ():
            M.check(m)
    except ValueError as exc:
        p.error(str(exc))
    if args.eval_every < 1:
        p.error("--eval-every must be >= 1")
    if args.bn_batches < 0:
        p.error("--bn-batches must be >= 0")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.local_steps < 1:
        p.error("--local-steps must be >= 1")
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            p.error("--device cuda: torch sees no CUDA device here")
        unsupported = [m for m in args.methods or () if m.startswith("horovod")]
        if unsupported or not args.methods:
            p.error("--device cuda runs DDP's, FSDP2's, torch's post-local SGD and cgx's "
                    "methods (name them with "
                    f"--methods); not {', '.join(unsupported) or 'the default list'}")


def _kept_records(args) -> list[dict[str, Any]]:
    """The runs already in ``<out>.json`` that --resume keeps (none without it)."""
    records: list[dict[str, Any]] = []
    if args.resume and os.path.exists(args.out + ".json"):
        with open(args.out + ".json") as f:
            records = [r for r in json.load(f)["records"] if "error" not in r]
    return records


def _run_todo(todo: list, records: list, args, argv: list) -> int:
    """Run every run of ``todo``, appending to ``records`` and writing the outputs after each."""
    from benchmarks.netsim import NetnsUnavailable
    from cgx.console import progress

    have_hvd, why = horovod_available()
    bar = progress(todo, desc="training runs", unit="run")
    for run in bar:
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(f"{run['workload']} {run['topology']} {run['rate']} {run['method']}")
        if run["method"].startswith("horovod") and not have_hvd:
            records.append({**{k: run[k] for k in ("workload", "topology", "rate", "seed", "round",
                                                   "method", "kind")}, "error": f"skipped: {why}"})
            continue
        try:
            records.append(run_one(run, args))
        except NetnsUnavailable as exc:
            print(f"cannot build the simulated network: {exc}", file=sys.stderr)
            return 2
        write_outputs(records, args, argv)  # after every run: an interrupted suite keeps its results
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = _parser()
    args = p.parse_args(argv)
    _check(p, args)
    runs = plan_runs(args)
    records = _kept_records(args)
    done = {run_key(r) for r in records}
    todo = [r for r in runs if run_key(r) not in done]
    if args.suite:
        print(f"{len(todo)} training runs of 1 to 5 minutes each on 2 cores (4 to 6 hours in all; "
              f"--resume continues an interrupted suite). Results: {args.out}.md", file=sys.stderr)
    if _run_todo(todo, records, args, argv):
        return 2
    print(write_outputs(records, args, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
