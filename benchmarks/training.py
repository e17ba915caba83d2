"""Training step time over a slow link: cgx against PyTorch DDP's own options.

VGG-11 on 32x32 inputs (28.1 M parameters, 112 MB of fp32 gradients per
step), batch 8 per rank, one thread per rank, 2 ranks, each in its own
network namespace behind a ``tc tbf``-shaped veth link (``benchmarks/netsim``):

    .venv/bin/python benchmarks/training.py                 # 1 Gbit/s
    .venv/bin/python benchmarks/training.py --rate 10gbit --steps 8

Methods: ``compute`` (no communication: the floor), DDP fp32, DDP with
PyTorch's ``fp16_compress_hook``, ``bf16_compress_hook`` (its body: torch's refuses Gloo)
and ``powerSGD_hook`` (rank 1,
error feedback, warm start; run with a single DDP bucket, the only way it does not crash on
Gloo here), cgx's DDP hook and cgx's ``DistributedOptimizer`` (both fixed 4-bit,
``Compression.quantize(bits=4)``; ``cgx-optimizer-8bit``: 8 bits), ``cgx-planned`` (``Compression.planned()``: each
tensor exact or 4-bit, as ``cgx.policy.planner`` predicts is fastest on the measured link) and
``cgx-decide`` (``Compression.auto(objective="time")``: the model proposes whole plans,
trials measure them, the fastest within the error budget is kept; its steps run until the
decision, then ``--warmup`` and the timed steps follow; what deciding cost, every step
before the decision beyond the kept plan's step, is reported apart; ``cgx-decide-sfb``:
the same given the model, so that its linear layers may travel as sufficient factors). The Keras path:
``keras-compute`` (no communication), ``keras-cgx`` (cgx's Keras
``DistributedOptimizer``, fixed 4-bit, in ``train_on_batch``: each bucket starts as its
gradients exist) and ``keras-cgx-one-call`` (the same, all gradients in one exchange
after backward), ``keras-cgx-decide`` (the deciding exchange, as ``cgx-decide``) and
``keras-cgx-sfb`` (4-bit, the Dense layers' gradients as sufficient
factors, exchanged from their custom gradients during backward). Reports
seconds per step (mean over the timed steps, slowest rank; with ``--rounds N`` every
method runs N times in turn and the median of the N means is reported) and the bytes
each rank sends per timed step, twice: as the method counts them (cgx: what each rank
handed to its transport, ``hvd.stats()``; DDP: its ring allreduce of the gradients) and as
the rank's link carried them (its veth's counter: TCP/IP headers, the timing's barriers,
and for DDP PowerSGD its first exact steps included), as ``<out>.json``, ``<out>.md`` and
``<out>.png``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import statistics
import sys
import time
import types
from typing import Any, Optional

from cgx.console import progress

METHODS = ["compute", "ddp-fp32", "ddp-fp16", "ddp-bf16", "ddp-powersgd", "cgx-ddp-hook",
           "cgx-ddp-hook-view", "cgx-optimizer",
           "cgx-optimizer-8bit", "cgx-optimizer-sfb", "cgx-planned", "cgx-planned-sfb",
           "cgx-decide", "cgx-decide-sfb", "keras-compute", "keras-cgx", "keras-cgx-one-call", "keras-cgx-sfb",
           "keras-cgx-decide"]
VGG11 = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]


def vgg11(num_classes: int = 10):
    import torch.nn as nn

    layers, channels = [], 3
    for v in VGG11:
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(channels, v, 3, padding=1), nn.BatchNorm2d(v), nn.ReLU(True)]
            channels = v
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(512, 4096), nn.ReLU(True),
                         nn.Linear(4096, 4096), nn.ReLU(True), nn.Linear(4096, num_classes))


def timed_steps(step, steps: int = 1) -> float:
    """``steps`` steps after a barrier: the slowest rank's seconds per step."""
    import torch
    import torch.distributed as dist
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    dt = torch.tensor([(time.perf_counter() - t0) / steps], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return dt.item()


def _timed(step, warmup: int, steps: int, counted=None) -> tuple[list[float], Any, float]:
    """Run ``warmup + steps`` steps; per timed step the slowest rank's seconds, the bytes
    sent as counted (with ``counted``: anything with cgx's ``stats()``), and as this rank's
    link carried them."""
    from benchmarks.netsim import link_tx_bytes

    times, before, tx0 = [], None, 0
    for i in range(warmup + steps):
        if i == warmup:
            tx0 = link_tx_bytes()
            if counted is not None:
                before = counted.stats().wire_bytes
        dt = timed_steps(step)
        if i >= warmup:
            times.append(dt)
    link = (link_tx_bytes() - tx0) / steps
    wire = (counted.stats().wire_bytes - before) / steps if counted is not None else None
    return times, wire, link


# The deciding exchange in these runs: statistics over 2 steps, then one round of trials
# (a warm-up step, then each plan: a settling step and 2 measured steps).
DECIDE = dict(objective="time", window=2, trial_steps=2, trial_warmup_steps=1)
# --trials: "short" (DECIDE) or "default", Compression.auto(objective="time")'s own
# settings (statistics over 10 steps, 3 warm-up steps, 3 measured steps a plan).
TRIALS = {"short": DECIDE, "default": dict(objective="time")}


def _until_decided(step, decided, cap: int = 120) -> list[float]:
    """Run steps until ``decided()``; each step's seconds (slowest rank), as ``_timed``."""
    times = []
    while not decided() and len(times) < cap:
        times.append(timed_steps(step))
    return times


def _deciding(out: dict, opt, deciding: list) -> dict:
    """The deciding exchange's trials and what deciding cost into ``out``."""
    out["deciding_s"] = deciding
    out["trials"] = opt.exchange_trials()
    return out


def keras_vgg11(num_classes: int = 10):
    """VGG-11 in Keras 3 (channels last), the same layers as :func:`vgg11`."""
    import keras

    layers = [keras.Input((32, 32, 3))]
    for v in VGG11:
        if v == "M":
            layers.append(keras.layers.MaxPooling2D(2))
        else:
            layers += [keras.layers.Conv2D(v, 3, padding="same"),
                       keras.layers.BatchNormalization(), keras.layers.ReLU()]
    layers += [keras.layers.Flatten(), keras.layers.Dense(4096, activation="relu"),
               keras.layers.Dense(4096, activation="relu"), keras.layers.Dense(num_classes)]
    return keras.Sequential(layers)


def keras_rank(method: str, steps: int, warmup: int, batch: int,
               trials: str = "short") -> dict[str, Any]:
    """The Keras path: ``model.train_on_batch`` (a compiled train step) without exchange
    (``keras-compute``) or with cgx's Keras ``DistributedOptimizer`` (4-bit)."""
    import torch
    import torch.distributed as dist

    import cgx.tensorflow.keras as hvd  # before TensorFlow: it orders the native libraries
    import keras
    import tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(2)  # bucket starts beside backward
    tf.config.threading.set_intra_op_parallelism_threads(1)
    rank = dist.get_rank()
    keras.utils.set_random_seed(0)
    model = keras_vgg11()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, 32, 32, 3, generator=g).numpy()
    y = torch.randint(0, 10, (batch,), generator=g).numpy()
    opt = keras.optimizers.SGD(0.01, momentum=0.9)
    if method.startswith("keras-cgx"):
        hvd.init()
        opt = hvd.DistributedOptimizer(
            opt, sufficient_factors=model if method == "keras-cgx-sfb" else None,
            compression=_cgx_compression(hvd, method, trials))
        if method == "keras-cgx-one-call":  # every gradient in one exchange after backward
            import cgx.tensorflow.gradients as grads
            grads.ready_order_buckets = lambda nbytes, cap: [list(range(len(nbytes)))]
    model.compile(optimizer=opt, jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    counted = hvd if method.startswith("keras-cgx") else None
    deciding = _until_decided(lambda: model.train_on_batch(x, y),
                              lambda: bool(opt.exchange_trials())) \
        if method == "keras-cgx-decide" else None
    times, wire, link = _timed(lambda: model.train_on_batch(x, y), warmup, steps, counted)
    wire = wire if wire is not None else 0.0
    out = {"method": method, "times_s": times, "params": int(model.count_params()),
           "wire_bytes": wire, "link_bytes": link}
    return _deciding(out, opt, deciding) if deciding is not None else out


def _cgx_compression(hvd, method: str, trials: str):
    """A cgx method's ``compression=``, always explicit (the default is itself the deciding
    exchange): fixed 4-bit unless the name says otherwise. Planned: each tensor exact or
    4-bit as cgx.policy.planner predicts is fastest, confirmed by trials (traced 5 steps, then
    tried: timed once the trials kept a plan)."""
    if method.startswith("cgx-planned"):
        return hvd.Compression.planned()
    if "decide" in method:
        return hvd.Compression.auto(**TRIALS[trials])
    if method.endswith("-8bit"):
        return hvd.Compression.quantize(bits=8)
    return hvd.Compression.quantize(bits=4)


@dataclasses.dataclass
class TorchMethod:
    """One PyTorch method ready to train: ``step()`` runs one training step; ``opt`` is the
    optimizer the loop steps (cgx's when the method is cgx's), ``counted`` anything with
    cgx's ``stats()`` (None: DDP, whose bytes are computed)."""

    method: str
    model: Any
    opt: Any
    step: Any
    counted: Any = None

    @property
    def decides(self) -> bool:
        """Whether the method decides by trials (run it until it kept a plan)."""
        return self.method.startswith(("cgx-decide", "cgx-planned"))


def _noop_hook(state, bucket):
    """A DDP comm hook that returns the bucket untouched."""
    import torch
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _ddp(model, method: str):
    """``model`` under DDP with ``method``'s communication hook (the DDP methods, cgx's hook)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    # PyTorch's PowerSGD hook issues its collectives in a different order on
    # different ranks when several buckets are in flight (Gloo then fails with
    # "Received data size doesn't match expected size"); one bucket avoids it.
    # -view: gradients are views of DDP's buckets (no copy from the buckets after the hook)
    ddp = DDP(model, bucket_cap_mb=1024) if method == "ddp-powersgd" else \
        DDP(model, gradient_as_bucket_view=method.endswith("-view"))
    counted = None
    if method in ("ddp-fp16", "ddp-bf16"):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from benchmarks.timetoacc.methods import bf16_gloo_hook
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook
                               if method == "ddp-fp16" else bf16_gloo_hook)
    elif method == "ddp-powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
        state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                 start_powerSGD_iter=2, min_compression_rate=2,
                                 use_error_feedback=True, warm_start=True)
        ddp.register_comm_hook(state, ps.powerSGD_hook)
    elif method.startswith("ddp-noop"):  # DDP's own cost: a hook that sends nothing
        ddp.register_comm_hook(None, _noop_hook)
    elif method.startswith("cgx-ddp-hook"):
        import cgx.torch
        state = cgx.torch.CGXState(ddp, compression=_cgx_compression(cgx.torch, method, "short"))
        ddp.register_comm_hook(state, cgx.torch.cgx_hook)
        # the hook's own reducer (and transport) counts
        counted = types.SimpleNamespace(stats=lambda: state.reducer().snapshot())
    return ddp, counted


def torch_method(method: str, x, y, trials: str = "short") -> TorchMethod:
    """VGG-11 (seed 0) with ``method``'s exchange and SGD, training on the batch ``x, y``
    (``trials``: the deciding methods' settings, a key of :data:`TRIALS`)."""
    import torch

    torch.manual_seed(0)
    model = vgg11()
    opt_model, counted = model, None
    if method.startswith(("ddp", "cgx-ddp-hook")):
        opt_model, counted = _ddp(model, method)
    opt = torch.optim.SGD(opt_model.parameters(), lr=0.01, momentum=0.9)
    if method.startswith(("cgx-optimizer", "cgx-planned", "cgx-decide")):
        import cgx.torch as hvd
        hvd.init()
        # -sfb: the fully connected layers' weight gradients travel as sufficient factors
        opt = hvd.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(),
            sufficient_factors=model if method.endswith("-sfb") else None,
            compression=_cgx_compression(hvd, method, trials))
        counted = hvd

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(opt_model(x), y).backward()
        opt.step()
    return TorchMethod(method, model, opt, step, counted)


def rank_main(method: str, steps: int, warmup: int, batch: int,
              trials: str = "short") -> dict[str, Any]:
    """Train ``warmup + steps`` steps with ``method``; return this rank's timings
    (``trials``: the deciding methods' settings, a key of :data:`TRIALS`)."""
    if method.startswith("keras"):
        return keras_rank(method, steps, warmup, batch, trials)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    m = torch_method(method, x, y, trials)
    # the deciding exchange and the planned mode decide by trials: time what they keep
    deciding = _until_decided(m.step, lambda: bool(m.opt.exchange_trials())) \
        if m.decides else None
    times, wire, link = _timed(m.step, warmup, steps, m.counted)
    params = sum(p.numel() for p in m.model.parameters())
    if wire is None:  # ring allreduce of the gradients (DDP) or of their compressed form
        from benchmarks.timetoacc.counters import ring_bytes
        from benchmarks.timetoacc.methods import powersgd_values
        values = powersgd_values(m.model, 1) if method == "ddp-powersgd" else params
        width = {"compute": 0, "ddp-fp32": 4, "ddp-fp16": 2, "ddp-bf16": 2,
                 "ddp-powersgd": 4}[method]
        wire = ring_bytes(width * values, world)
    out = {"method": method, "times_s": times, "params": params, "wire_bytes": wire,
           "link_bytes": link}
    plan = m.opt.exchange_plan() if method.startswith("cgx-planned") else None
    if plan is not None:  # what the planner saw and decided
        out["plan"] = {"predicted_s": plan.step_s, "backward_s": plan.backward_s,
                       "cpu_s": plan.timeline.cpu_s, "cost": plan.model.to_dict(),
                       "choices": dict(collections.Counter(o.name for o in plan.chosen))}
    return _deciding(out, m.opt, deciding) if deciding is not None else out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="1gbit", help="tc rate of each link ('none': unshaped)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=1,
                   help="run every method this many times, in turn; report the median")
    p.add_argument("--trials", choices=sorted(TRIALS), default="short",
                   help="the deciding methods' settings: short (statistics over 2 steps, "
                        "2 measured steps a plan) or default (Compression.auto's own)")
    p.add_argument("--out", default="benchmarks/results/training")
    return p


def _run_rounds(args, methods: list, rate: Optional[str]) -> dict[str, list]:
    """Every method's runs, one simulated network each; a crashing method keeps its error.

    Raises:
        NetnsUnavailable: this machine cannot build the network.
    """
    from benchmarks.netsim import RankFailedError, SlowNetwork

    runs: dict[str, list] = {m: [] for m in methods}
    # Rounds run every method once each, in turn: on a shared machine the speed drifts over
    # minutes, and interleaving spreads that drift over all methods alike.
    cases = [m for _ in range(args.rounds) for m in methods]
    for method in progress(cases, desc="training", unit="run"):
        try:
            with SlowNetwork(n_ranks=2, rate=rate) as net:
                res = net.run_function("benchmarks.training:rank_main",
                                       {"method": method, "steps": args.steps,
                                        "warmup": args.warmup, "batch": args.batch,
                                        "trials": args.trials},
                                       timeout=1800)[0]
        except RankFailedError as exc:  # report a method that crashes, keep the others
            res = {"method": method, "error": str(exc).splitlines()[-1][:300]}
        runs[method].append(res)
    return runs


def _table(results: list, args, argv) -> list[str]:
    """The command, the setting and one row per method: s/step against DDP fp32 and compute."""
    base = next((_step(r) for r in results if r["method"] == "ddp-fp32" and "times_s" in r), None)
    many = args.rounds > 1
    lines = [f"Command: `python benchmarks/training.py {' '.join(argv or sys.argv[1:])}`", "",
             f"VGG-11 (28.1 M parameters), batch {args.batch}/rank, 2 ranks x 1 thread, "
             f"link {args.rate}" + (f"; s/step: the median of {args.rounds} rounds' means, "
                                    "each round every method in turn" if many else ""), "",
             "| method | s/step | vs DDP fp32 | step / compute-only step | MB sent/step/rank "
             "(counted) | MB/step/rank on the link |" + (" rounds (min-max s/step) |" if many
                                                       else ""),
             "|---|---:|---:|---:|---:|---:|" + ("---:|" if many else "")]
    floor = {r["method"]: _step(r) for r in results
             if r["method"] in ("compute", "keras-compute") and "times_s" in r}
    for r in results:
        if "error" in r:
            lines.append(f"| {r['method']} | failed: {r['error']} | | | | |"
                         + (" |" if many else ""))
            continue
        lines.append(_row(r, base, floor, many))
    return lines


def _row(r: dict, base: Optional[float], floor: dict, many: bool) -> str:
    t = _step(r)
    wire = "-" if r["wire_bytes"] is None else f"{r['wire_bytes'] / 1e6:.1f}"
    link = f"{r['link_bytes'] / 1e6:.1f}" if r.get("link_bytes") is not None else "-"
    speed = f"{base / t:.2f}x" if base else "-"
    own = floor.get("keras-compute" if r["method"].startswith("keras") else "compute")
    vs_floor = f"{t / own:.2f}" if own else "-"
    spread = (f" {min(r['round_means']):.3f}-{max(r['round_means']):.3f} |" if many else "")
    return f"| {r['method']} | {t:.3f} | {speed} | {vs_floor} | {wire} | {link} |{spread}"


def main(argv=None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        p.error(f"unknown method(s) {bad}; choose from {METHODS}")
    rate = None if args.rate.lower() == "none" else args.rate
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    from benchmarks.netsim import NetnsUnavailable
    from benchmarks.outputs import save

    try:
        runs = _run_rounds(args, methods, rate)
    except NetnsUnavailable as exc:
        print(f"cannot build the simulated network: {exc}", file=sys.stderr)
        return 2
    results = [_merge(runs[m]) for m in methods]
    md = "\n".join(_table(results, args, argv) + _decide_lines(results, args.warmup))
    save(args.out, {"rate": args.rate, "batch": args.batch, "rounds": args.rounds,
                    "results": results}, md)
    _plot(results, args.out + ".png", args.rate)
    return 0


def _decide_lines(results: list, warmup: int) -> list[str]:
    """For each deciding method: its step against the fastest other method of its adapter in
    the run, the plan it kept, what deciding cost, and its last round of trials."""
    from cgx.policy.trials import format_round
    ok = {r["method"]: r for r in results if "times_s" in r}
    out = []
    for name, r in ok.items():
        if not r.get("trials"):
            continue
        keras = name.startswith("keras")
        others = {m: _step(o) for m, o in ok.items() if m != name and "decide" not in m
                  and not m.endswith("compute") and m.startswith("keras") == keras}
        t = _step(r)
        rnd = r["trials"][-1]
        # every step before the decision beyond the kept plan's step (the statistics
        # window, the setup, the trials), the first --warmup steps left out as from every
        # method's timing: over a 1000-step run
        before = r["deciding_s"][warmup:]
        cost = sum(before) - len(before) * t
        out += ["", f"**{name}**: {t:.3f} s/step, kept '{rnd['chosen']}'"]
        if others:
            best = min(others, key=others.get)
            out[-1] += f"; {t / others[best]:.3f}x the fastest other method ({best})"
            ratios = _paired(r, ok[best]) if len(r.get("round_means", ())) > 1 else None
            if ratios:
                out[-1] += (f"; round by round {statistics.median(ratios):.3f}x its step "
                            f"(median; {min(ratios):.3f}-{max(ratios):.3f}: "
                            + ", ".join(f"{x:.3f}" for x in ratios) + ")")
        if len(r.get("kept_by_round", ())) > 1:
            out[-1] += "; kept by round: " + ", ".join(f"'{k}'" for k in r["kept_by_round"])
        out += [f"Deciding took {len(r['deciding_s'])} steps ({rnd.get('setup_s', 0.0):.2f} s "
                f"of setup: the planner's measurements, the proposals); after the first "
                f"{warmup}, {cost:.1f} s beyond the kept plan's step: "
                f"{100 * cost / (1000 * t):.2f}% of a 1000-step run.", "",
                format_round(rnd)]
    return out


def _step(r: dict) -> float:
    """A method's seconds per step: the median over rounds of each round's mean."""
    return statistics.median(r["round_means"]) if "round_means" in r else statistics.mean(
        r["times_s"])


def _merge(runs: list) -> dict:
    """One method's rounds as one result: every timed step, each round's mean, the last
    round's other fields (bytes, plan); a method that failed in every round, its error."""
    ok = [r for r in runs if "times_s" in r]
    if not ok:
        return runs[-1]
    out = dict(ok[-1])
    out["times_s"] = [t for r in ok for t in r["times_s"]]
    out["round_means"] = [statistics.mean(r["times_s"]) for r in ok]
    if len(ok) == len(runs):  # a round that failed would shift the pairing by round
        out["round_means_paired"] = True
    if ok[-1].get("trials"):  # a deciding method decides again in every round
        out["kept_by_round"] = [r["trials"][-1]["chosen"] for r in ok]
    return out


def _paired(r: dict, o: dict) -> Optional[list[float]]:
    """``r``'s round means over ``o``'s, round by round (the same round shares the machine's
    drift); None unless both ran every round."""
    if not (r.get("round_means_paired") and o.get("round_means_paired")):
        return None
    return [a / b for a, b in zip(r["round_means"], o["round_means"])]


def _plot(results, path, rate) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if "times_s" in r]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    names = [r["method"] for r in ok]
    means = [_step(r) for r in ok]
    colors = ["#888888" if n.endswith("compute") else "#1f77b4" if n.startswith("cgx") else "#ff7f0e"
              for n in names]
    ax.barh(names, means, color=colors)
    for i, m in enumerate(means):
        ax.text(m, i, f" {m:.2f} s", va="center")
    ax.invert_yaxis()
    ax.set(xlabel="seconds per training step (lower is better)",
           title=f"VGG-11, 2 ranks, link {rate}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
