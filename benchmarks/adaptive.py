"""compression="auto" in numbers: solver speed, and bytes vs accuracy against uniform 4-bit.

1. The solver: 300 layers x 20 candidates (costs falling, errors rising with the
   level, as real layers do), median of repeated solves, with the C dynamic program
   (when the extension is built) and with its numpy fallback.
2. Digits: 2 ranks (Gloo on this machine) train an MLP on scikit-learn's
   digits with fp32, uniform 4-bit (bucket 1024), ``auto`` restricted to each
   family (L-GreCo's single-family modes) and ``auto`` (alpha 1.0, mixed);
   bytes sent per step, test accuracy and loss per method.
3. LM: 2 ranks train the transformer LM of benchmarks/timetoacc (the Python
   standard library's source) for ``--lm-steps`` steps under AdamW, and under SGD
   with momentum, with fixed 4- and 2-bit levels with and without error feedback
   and with ``auto``; validation loss and bytes per step.
4. The window's measurement (``--measure-only``): one measured step of a large layer,
   every candidate of every family, on a sample (the default) and in full, and how
   far the sampled errors are from the full ones.
5. Compensation (``--compensation``): the LM under AdamW with 2-bit quantization,
   without error feedback, with classic error feedback (``CGX_COMPENSATION=classic``)
   and with ``error_feedback=True`` as it is under an adaptive optimizer (the moving
   average of ``cgx.exchange.compensation``), against fp32, over ``--lm-seeds`` seeds;
   with ``--methods "fp32,auto EF off,auto,auto EF on"``, auto's compensation measured per
   layer (``cgx.policy.levels.probe``) against none (``--optimizer SGD`` for SGD).
6. The probe alone (``--probe-bits N``): one process trains the LM (``--optimizer``) and,
   over 10 steps from step 20, runs ``cgx.policy.levels.probe`` on every matrix at uniform
   N-bit quantization: per layer each compensation's shortfall and noise, and the choice.

Usage::

    .venv/bin/python benchmarks/adaptive.py [--epochs 8] [--lm-steps 400] [--out docs/results/adaptive]
    .venv/bin/python benchmarks/adaptive.py --solver-only --out docs/results/adaptive-solver
    .venv/bin/python benchmarks/adaptive.py --measure-only --out docs/results/adaptive-measure
    .venv/bin/python benchmarks/adaptive.py --compensation --lm-seeds 2 --out docs/results/adaptive-compensation
    .venv/bin/python benchmarks/adaptive.py --compensation --methods "2-bit nearest,2-bit nearest + EF classic,2-bit nearest + EF" --out docs/results/adaptive-compensation-nearest
    .venv/bin/python benchmarks/adaptive.py --probe-bits 2 --out docs/results/adaptive-probe-2bit

Writes ``<out>.json`` and ``<out>.md`` and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import sys
import tempfile
import time

import numpy as np

METHODS = ("fp32", "uniform 4-bit", "auto: quantize only", "auto: top-k only",
           "auto: PowerSGD only", "auto (alpha 1.0)")
AUTO = "auto (alpha 1.0)"  # the mixed mode, auto's default


def bench_solver(layers: int = 300, candidates: int = 20, reps: int = 7) -> dict:
    from cgx.policy.levels import solve
    from cgx.quant import cpu  # the C extension, the knapsack included
    rng = np.random.default_rng(0)
    errors = np.sort(rng.uniform(0, 1, (layers, candidates)), axis=1)
    costs = np.sort(rng.uniform(1, 100, (layers, candidates)), axis=1)[:, ::-1]
    ref = [candidates // 4] * layers
    budget = float(sum(errors[i][j] for i, j in enumerate(ref)))
    times = {True: [], False: []}  # native (C when built), numpy
    for _ in range(reps):
        for native in times:
            t0 = time.perf_counter()
            plan = solve(costs, errors, budget, reference=ref, native=native)
            times[native].append(time.perf_counter() - t0)
    ref_cost = float(sum(costs[i][j] for i, j in enumerate(ref)))
    return {"layers": layers, "candidates": candidates, "c_built": cpu.available(),
            "median_ms": 1e3 * statistics.median(times[True]),
            "numpy_median_ms": 1e3 * statistics.median(times[False]),
            "cost_vs_reference": plan.cost / ref_cost, "error_vs_budget": plan.error / budget}


def _heavy_layer(rows: int, cols: int):
    """A gradient-like layer: rows 100x apart in scale, heavy-tailed values."""
    import torch
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-1, 1, rows).unsqueeze(1)
    return x * torch.rand(rows, cols, generator=g).pow(3)


def embedding_gradient(rows: int, cols: int, used: int = 3000, seed: int = 0):
    """An embedding's gradient: the rows of a batch's ``used`` distinct tokens, scaled as
    token frequencies are (Zipf), every other row zero (also tests/levels')."""
    import torch
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(rows, cols)
    idx = torch.randperm(rows, generator=g)[:used]
    freq = 1.0 / torch.arange(1, used + 1, dtype=torch.float32)
    x[idx] = torch.randn(used, cols, generator=g) * freq.unsqueeze(1)
    return x


LAYERS = {"heavy-tailed": _heavy_layer, "embedding": embedding_gradient}
KEYS = (3, 4, 5, 6, 7)  # the sample draws whose errors are compared with the full ones


def _measure_once(g, shape, cands, full: bool, key: int = KEYS[0]) -> tuple[float, list]:
    """One measured window step of a layer: seconds, and every candidate's error (full:
    no sample, PowerSGD's errors from the (n, m) products as before the closed form)."""
    import torch
    from cgx.policy.levels import Family
    from cgx.policy.levels import stats
    ranks = [c.rank for c in cands if c.family is Family.POWERSGD]
    scorer = stats.PowerSGDScorer()
    t0 = time.perf_counter()
    if full:
        M = g.reshape(shape[0], -1)
        scorer.compressor.ranks["w"] = max(ranks)
        payload, ctx = scorer.compressor.compress(M, "w")
        P = payload[:ctx.n * ctx.rank].view(ctx.n, ctx.rank)
        Q = payload[ctx.n * ctx.rank:].view(ctx.m, ctx.rank)
        low = [float(torch.linalg.matrix_norm(M - P[:, :r] @ Q[:, :r].T)) for r in ranks]
    else:
        low = scorer.step("w", g, shape, ranks, True)
    errs = stats.candidate_errors(g, cands, key=key, lowrank=low,
                                  sample_values=g.numel() if full else stats.SAMPLE_VALUES)
    return time.perf_counter() - t0, errs


MEASURED = (("heavy-tailed", (4096, 512)), ("heavy-tailed", (4096, 4096)),
            ("heavy-tailed", (8192, 4096)), ("embedding", (32768, 768)))


def bench_measure(layers=MEASURED, reps: int = 3) -> list:
    import torch
    from cgx.policy.levels import Family, candidates_for
    torch.set_num_threads(1)
    fams = [Family.QUANTIZE, Family.TOPK, Family.POWERSGD, Family.FP16, Family.BF16]
    out = []
    for kind, shape in layers:
        g, cands = LAYERS[kind](*shape).reshape(-1), candidates_for(shape, fams)
        row = {"layer": kind, "shape": list(shape), "candidates": len(cands)}
        for full in (False, True):
            runs = [_measure_once(g, shape, cands, full) for _ in range(reps)]
            row["full_s" if full else "sampled_s"] = statistics.median(t for t, _ in runs)
            row["full_errors" if full else "sampled_errors"] = runs[0][1]
        # the sample's draws against the full measurement, quantization and the rest apart
        quant = [c.family is Family.QUANTIZE for c in cands]
        row["sampled_errors_by_key"] = [row["sampled_errors"]] + [
            _measure_once(g, shape, cands, False, key)[1] for key in KEYS[1:]]
        for name, pick in (("quantization_deviation", True), ("other_deviation", False)):
            row[name] = max([abs(a / b - 1) for errs in row["sampled_errors_by_key"]
                             for a, b, q in zip(errs, row["full_errors"], quant)
                             if b > 0 and q is pick], default=0.0)
        row["max_deviation"] = max(row["quantization_deviation"], row["other_deviation"])
        out.append(row)
    return out


def measure_table(rows: list) -> list:
    lines = ["| layer | candidates | one measured step, sampled | in full | speed-up | "
             "largest deviation: quantization / the others |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.get('layer', 'heavy-tailed')} {r['shape'][0]} x {r['shape'][1]} | "
                     f"{r['candidates']} | {1e3 * r['sampled_s']:.0f} ms | "
                     f"{1e3 * r['full_s']:.0f} ms | {r['full_s'] / r['sampled_s']:.1f}x | "
                     f"{100 * r['quantization_deviation']:.1f}% / "
                     f"{100 * r['other_deviation']:.1f}% |")
    return lines


def _rank(rank, world, port, method, epochs, out):
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import cgx.torch as hvd
    from sklearn.datasets import load_digits
    hvd.init()
    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    train_x, train_y, test_x, test_y = X[:1400], y[:1400], X[1400:], y[1400:]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    comp = {"fp32": hvd.Compression.exact,
            "uniform 4-bit": hvd.Compression.quantize(bits=4, bucket_size=1024),
            "auto: quantize only": hvd.Compression.auto(alpha=1.0, window=10, adjust_every=40,
                                                        families=("quantize",)),
            "auto: top-k only": hvd.Compression.auto(alpha=1.0, window=10, adjust_every=40,
                                                     families=("topk",)),
            "auto: PowerSGD only": hvd.Compression.auto(alpha=1.0, window=10, adjust_every=40,
                                                        families=("powersgd",)),
            AUTO: hvd.Compression.auto(alpha=1.0, window=10, adjust_every=40),
            }[method]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=comp)
    g = torch.Generator().manual_seed(rank)
    steps = 0
    before = hvd.stats().wire_bytes
    for _ in range(epochs):
        order = torch.randperm(len(train_x), generator=g)[rank::world]
        for i in range(0, len(order) - 31, 32):
            idx = order[i:i + 32]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(train_x[idx]), train_y[idx]).backward()
            opt.step()
            steps += 1
    wire = (hvd.stats().wire_bytes - before) / steps
    with torch.no_grad():
        logits = model(test_x)
        acc = float((logits.argmax(1) == test_y).float().mean())
        test_loss = float(torch.nn.functional.cross_entropy(logits, test_y))
    if rank == 0:
        from cgx.policy.levels import format_levels
        with open(out, "w") as f:
            json.dump({"bytes_per_step": wire, "accuracy": acc, "test_loss": test_loss,
                       "steps": steps,
                       "plan": format_levels(opt.compression_plan())}, f)
    dist.destroy_process_group()


def _spawn(fn, *args) -> dict:
    """Run ``fn(rank, 2, port, *args, out)`` on 2 ranks; rank 0's JSON result."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = os.path.join(tmp, "r.json")
        mp.start_processes(fn, args=(2, port, *args, out), nprocs=2, start_method="spawn")
        with open(out) as f:
            return json.load(f)


def bench_training(epochs: int) -> dict:
    return {method: _spawn(_rank, method, epochs) for method in METHODS}


# -- the LM: what error feedback does under AdamW and SGD, and what auto does --------

LM_METHODS = ("fp32", "4-bit", "4-bit + EF", "2-bit", "2-bit + EF", "2-bit nearest",
              "2-bit nearest + EF", "auto (alpha 1.0)", "auto, EF forced on")
LM_SGD_METHODS = ("fp32", "2-bit", "2-bit + EF", "auto (alpha 1.0)", "auto, EF forced off")


def _lm_compression(hvd, method: str):
    if method == "fp32":
        return hvd.Compression.exact
    if method.startswith("auto"):  # error feedback: by the optimizer, unless forced
        ef = True if method.endswith(" on") else False if method.endswith(" off") else None
        return hvd.Compression.auto(alpha=1.0, window=10, adjust_every=100, error_feedback=ef)
    bits = int(method[0])
    return hvd.Compression.quantize(bits=bits, bucket_size=1024,
                                    rounding="nearest" if "nearest" in method else "stochastic",
                                    error_feedback="+ EF" in method)


def _lm_rank(rank, world, port, method, optimizer, steps, seed, out):
    import math
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if method.endswith("EF classic"):  # error feedback as under SGD, whatever the optimizer
        os.environ["CGX_COMPENSATION"] = "classic"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import cgx.torch as hvd
    from benchmarks.timetoacc.workloads import make
    hvd.init()
    w = make("lm", rank, world, seed)
    model = w.model
    base = w.optimizer(model.parameters()) if optimizer == "AdamW" else \
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                   compression=_lm_compression(hvd, method))
    lr0 = [g["lr"] for g in opt.param_groups]
    before = hvd.stats().wire_bytes
    for step in range(1, steps + 1):
        for g, lr in zip(opt.param_groups, lr0):  # cosine decay, as benchmarks/train.py
            g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * (step - 1) / steps))
        opt.zero_grad()
        w.loss_fn(model, w.train_batch(step)).backward()
        opt.step()
    wire = (hvd.stats().wire_bytes - before) / steps
    val = w.evaluate(model)["loss"]
    if rank == 0:
        from cgx.policy.levels import format_levels
        with open(out, "w") as f:
            json.dump({"bytes_per_step": wire, "val_loss": val, "steps": steps,
                       "error_feedback": bool(opt._plan.error_feedback),
                       "compensation": opt._plan.residuals.compensation.value,
                       "measured": _measured(opt.compression_plan()),
                       "plan": format_levels(opt.compression_plan())}, f)
    dist.destroy_process_group()


PROBE_START, PROBE_STEPS = 20, 10  # --probe-bits: the steps the probe follows


def bench_probe(bits: int, optimizer: str) -> list:
    """--probe-bits: per LM matrix, the probe's measures at uniform ``bits`` (bucket 1024,
    stochastic rounding) and its choice among the three compensations."""
    import torch
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.timetoacc.workloads import make
    from cgx.policy.levels import probe, stats
    from cgx.policy.update_rule import UpdateRule
    from cgx.quant.codec import QuantSpec
    torch.manual_seed(0)
    w = make("lm", 0, 1, 0)
    model = w.model
    adaptive = optimizer == "AdamW"
    opt = w.optimizer(model.parameters()) if adaptive else \
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rule = UpdateRule.ADAPTIVE if adaptive else UpdateRule.LINEAR
    probes: dict = {}
    for step in range(1, PROBE_START + PROBE_STEPS + 1):
        opt.zero_grad()
        w.loss_fn(model, w.train_batch(step)).backward()
        for n, p in model.named_parameters():
            if step > PROBE_START and p.grad is not None and p.dim() >= 2:
                pr = probes.setdefault(n, probe.LayerProbe(p.numel(), QuantSpec(bits, 1024),
                                                           rule, 0.95))
                pr.step(p.grad, stats.step_key(step, n))
        opt.step()
    rows = []
    for n, pr in probes.items():
        m = probe.measures(pr.sums_now())
        rows.append({"layer": n, "measures": m, "choice": probe.choose(
            m, probe.options_for(None, None)).value if m is not None else None})
    return rows


def probe_table(rows: list) -> list:
    lines = ["| layer | none: shortfall / noise | classic | moving average | chosen |",
             "|---|---:|---:|---:|---|"]
    for r in rows:
        cells = " | ".join(f"{a:.3f} / {b:.3f}" for a, b in r["measures"] or ())
        lines.append(f"| {r['layer']} | {cells} | {r['choice']} |")
    return lines


def _measured(rows: list) -> dict:
    """How many quantized layers of the last plan took each measured compensation."""
    out: dict = {}
    for r in rows:
        if r.get("compensation"):
            out[r["compensation"]] = out.get(r["compensation"], 0) + 1
    return out


def bench_lm(steps: int) -> dict:
    out = {}
    for optimizer, methods in (("AdamW", LM_METHODS), ("SGD", LM_SGD_METHODS)):
        for method in methods:
            t0 = time.perf_counter()
            out[f"{optimizer}: {method}"] = r = _spawn(_lm_rank, method, optimizer, steps, 0)
            print(f"  LM {optimizer:5s} {method:20s} val {r['val_loss']:.4f}  "
                  f"{r['bytes_per_step'] / 1e3:7.1f} kB/step  ({time.perf_counter() - t0:.0f} s)",
                  file=sys.stderr, flush=True)
    return out


COMPENSATION_METHODS = ("fp32", "2-bit", "2-bit + EF classic", "2-bit + EF")


def bench_compensation(steps: int, seeds: int, methods=COMPENSATION_METHODS,
                       optimizer: str = "AdamW") -> dict:
    """``optimizer`` on the LM: each of ``methods`` with seeds 0..seeds-1."""
    out = {}
    for seed in range(seeds):
        for method in methods:
            t0 = time.perf_counter()
            out[f"{method} (seed {seed})"] = r = _spawn(_lm_rank, method, optimizer, steps, seed)
            r.pop("plan")
            print(f"  LM {optimizer} {method:20s} seed {seed} val {r['val_loss']:.4f}  "
                  f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return out


def compensation_table(runs: dict, seeds: int, methods=COMPENSATION_METHODS,
                       optimizer: str = "AdamW") -> list:
    """One row per method: validation loss per seed, mean, and the mean's gap to the
    first method's (fp32 by default); the compensation: the exchange's, or with auto the
    measured one per layer (layers of the last plan, seed 0)."""
    loss = {m: [runs[f"{m} (seed {s})"]["val_loss"] for s in range(seeds)] for m in methods}
    fp32 = statistics.mean(loss[methods[0]])
    lines = [f"| exchange ({optimizer}) | compensation | " + " | ".join(
        f"val loss seed {s}" for s in range(seeds)) + f" | mean | vs {methods[0]} |",
        "|---|---|" + "---:|" * (seeds + 2)]
    for m in methods:
        mean = statistics.mean(loss[m])
        first = runs[f"{m} (seed 0)"]
        comp = ", ".join(f"{k} x{v}" for k, v in sorted(first.get("measured", {}).items())) \
            or first["compensation"]
        lines.append(f"| {m} | {comp} | " + " | ".join(f"{v:.4f}" for v in loss[m]) +
                     f" | {mean:.4f} | {100 * (mean / fp32 - 1):+.1f}% |")
    return lines


def lm_table(lm: dict) -> list:
    lines = ["| optimizer | exchange | bytes sent/step/rank | vs 4-bit | validation loss | "
             "vs fp32 | EF on quantized layers |", "|---|---|---:|---:|---:|---:|---|"]
    for key, r in lm.items():
        optimizer, method = key.split(": ", 1)
        fp32 = lm[f"{optimizer}: fp32"]["val_loss"]
        four = lm.get(f"{optimizer}: 4-bit", lm["AdamW: 4-bit"])["bytes_per_step"]
        lines.append(f"| {optimizer} | {method} | {r['bytes_per_step'] / 1e3:.1f} kB | "
                     f"{four / r['bytes_per_step']:.2f}x | {r['val_loss']:.4f} | "
                     f"{100 * (r['val_loss'] / fp32 - 1):+.1f}% | "
                     f"{'yes' if r['error_feedback'] else 'no'} |")
    return lines


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--lm-steps", type=int, default=400,
                   help="LM steps per method (0: skip the LM part)")
    p.add_argument("--out", default="docs/results/adaptive")
    p.add_argument("--solver-only", action="store_true", help="time the solver, nothing else")
    p.add_argument("--measure-only", action="store_true",
                   help="time the window's measurement of large layers, nothing else")
    p.add_argument("--compensation", action="store_true",
                   help="the LM's error compensation under AdamW, nothing else")
    p.add_argument("--lm-seeds", type=int, default=1, help="seeds per method (--compensation)")
    p.add_argument("--methods", default=",".join(COMPENSATION_METHODS),
                   help="--compensation: comma-separated methods, the first the reference "
                   "('auto', 'auto EF on', 'auto EF off': Compression.auto and its "
                   "error_feedback None, True, False)")
    p.add_argument("--optimizer", default="AdamW", choices=("AdamW", "SGD"),
                   help="--compensation, --probe-bits: the LM's optimizer")
    p.add_argument("--probe-bits", type=int, default=0,
                   help="the compensation probe alone, at this uniform level (0: not run)")
    return p


def _run_probe(args) -> int:
    rows = bench_probe(args.probe_bits, args.optimizer)
    lines = [f"cgx.policy.levels.probe on the LM under {args.optimizer}, one process, steps "
             f"{PROBE_START + 1}-{PROBE_START + PROBE_STEPS}, uniform {args.probe_bits}-bit "
             "(bucket 1024, stochastic rounding): per layer and compensation, the share "
             "of the true path the sent one misses (shortfall) and what it adds across it "
             "(noise)", ""]
    return _write(args, lines + probe_table(rows), {"probe": rows},
                  "one process, 2 cores, no GPU")


def _run_compensation(args) -> int:
    methods = tuple(m.strip() for m in args.methods.split(","))
    runs = bench_compensation(args.lm_steps, args.lm_seeds, methods, args.optimizer)
    lines = [f"Transformer LM (benchmarks/timetoacc), 2 ranks, {args.lm_steps} "
             f"{args.optimizer} steps, "
             "cosine learning rate, quantized with bucket 1024 (stochastic rounding unless "
             "named nearest):", ""]
    return _write(args, lines + compensation_table(runs, args.lm_seeds, methods,
                                                   args.optimizer),
                  {"compensation": runs}, "2 cores, no GPU, 2 ranks on one machine")


def _run_measure(args) -> int:
    rows = bench_measure()
    lines = ["auto's window: one measured step of a layer (quantization 2-8 bits x buckets, "
             "top-k, PowerSGD ranks, fp16, bf16), one thread; heavy-tailed: rows 100x apart "
             "in scale; embedding: 3,000 used rows scaled as Zipf token frequencies, the "
             "others zero; median of 3; the deviation: the largest |sampled / full - 1| over "
             f"the candidates and {len(KEYS)} sample draws", ""]
    return _write(args, lines + measure_table(rows), {"measure": rows},
                  "one process, one thread, 2 cores, no GPU")


def _solver_line(solver: dict) -> str:
    return ("Solver: %d layers x %d candidates: %.1f ms (median, %s), %.1f ms with the numpy "
            "fallback; cost %.2f x the uniform reference at %.3f of the error budget" % (
                solver["layers"], solver["candidates"], solver["median_ms"],
                "C dynamic program" if solver["c_built"] else "C extension not built: numpy",
                solver["numpy_median_ms"], solver["cost_vs_reference"],
                solver["error_vs_budget"]))


def _training_lines(args, train: dict, lm: dict) -> list:
    lines = ["", "| exchange (2 ranks, digits MLP, %d epochs) | bytes sent/step/rank | vs 4-bit | "
             "test accuracy | test loss |" % args.epochs, "|---|---:|---:|---:|---:|"]
    base = train["uniform 4-bit"]["bytes_per_step"]
    for m in METHODS:
        r = train[m]
        lines.append(f"| {m} | {r['bytes_per_step'] / 1e3:.1f} kB | "
                     f"{base / r['bytes_per_step']:.2f}x | {100 * r['accuracy']:.1f}% | "
                     f"{r['test_loss']:.4f} |")
    lines += ["", "Last auto plan (rank 0):", "", train[AUTO]["plan"]]
    if lm:
        lines += ["", f"Transformer LM (benchmarks/timetoacc), 2 ranks, {args.lm_steps} steps, "
                  "cosine learning rate; SGD: lr 0.1, momentum 0.9:", ""] + lm_table(lm)
        lines += ["", "Last auto plan of the LM under AdamW (rank 0):", "",
                  lm["AdamW: auto (alpha 1.0)"]["plan"]]
    return lines


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.probe_bits:
        return _run_probe(args)
    if args.compensation:
        return _run_compensation(args)
    if args.measure_only:
        return _run_measure(args)
    solver = bench_solver()
    lines = [_solver_line(solver)]
    if args.solver_only:
        return _write(args, lines, {"solver": solver}, "one process, 2 cores, no GPU")
    train = bench_training(args.epochs)
    lm = bench_lm(args.lm_steps) if args.lm_steps else {}
    return _write(args, lines + _training_lines(args, train, lm),
                  {"solver": solver, "training": train, "lm": lm},
                  "2 cores, no GPU, 2 ranks on one machine")


def _write(args, lines: list, data: dict, where: str) -> int:
    """Print the tables and write ``<out>.json`` and ``<out>.md`` (which starts with the
    command, paths relative to the repository)."""
    text = "\n".join(lines)
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(data, f, indent=1)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = [os.path.relpath(a, root) if os.path.isabs(a) else a for a in sys.argv[1:]]
    command = " ".join([".venv/bin/python benchmarks/adaptive.py", *map(shlex.quote, argv)])
    load = os.getloadavg()[0]  # other work on the machine slows every timing
    with open(args.out + ".md", "w") as f:
        f.write(f"`{command}` ({where}; load average {load:.1f} at the end)\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
