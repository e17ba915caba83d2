"""Step time of cgx reached through Lightning and Hugging Face's Trainer, against cgx's
``DistributedOptimizer`` sending the same exchange.

VGG-11 on 32x32 inputs (benchmarks/training.py's model), batch 8 per rank, SGD with
momentum 0.9, one thread per rank, 2 ranks, each in its own network namespace behind a
``tc tbf``-shaped link (``benchmarks/netsim``). Every route sends cgx fixed 4-bit
(``Compression.quantize(bits=4)``):

    .venv/bin/python benchmarks/integration_steps.py --rounds 5 --out docs/results/integration-steps

Routes: ``compute`` (no communication: the floor), ``cgx-optimizer``
(``cgx.torch.DistributedOptimizer``), ``cgx-ddp-hook`` (DDP with ``cgx_hook``, by hand),
``cgx-ddp-hook-view`` (the same, DDP built with ``gradient_as_bucket_view=True``),
``lightning`` (``lightning.Trainer(strategy="ddp")`` with
``cgx.integrations.lightning.CGXCallback``) and ``hf-trainer`` (``transformers.Trainer``
with ``cgx.integrations.huggingface.compress``; the Trainer's own DDP settings, its
``find_unused_parameters=True`` included). Both integrations build their DDP with
``gradient_as_bucket_view=True``, as they do for their users. A step is timed from the end of one optimizer
step to the end of the next, with no barrier in between (the trainers' own loops run as
they do for their users: data loading, callbacks and logging included); each rank's mean
over the timed steps, the slowest rank's reported. ``--rounds N`` runs every route N
times in turn and reports the median of the N means and, per route, the median over the
rounds of its step over the same round's ``cgx-optimizer`` step. The CPU floor is the
ranks' CPU seconds per step (process time, every thread) over the machine's cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.outputs import save  # noqa: E402

ROUTES = ["compute", "cgx-optimizer", "cgx-ddp-hook", "cgx-ddp-hook-view", "lightning",
          "hf-trainer"]
BASE = "cgx-optimizer"
# the routes whose trainer makes the process group itself (the worker makes none for them)
OWN_GROUP = {"lightning", "hf-trainer"}


class Clock:
    """Wall and CPU time at the end of every step; the timed steps' means."""

    def __init__(self, warmup: int):
        self.warmup, self.wall, self.cpu = warmup, [], []

    def tick(self) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def result(self, route: str) -> dict[str, Any]:
        w, c = self.wall[self.warmup:], self.cpu[self.warmup:]
        if len(w) < 2:
            raise RuntimeError(f"{route}: {len(self.wall)} steps ended, too few to time")
        steps = len(w) - 1
        return {"route": route, "step_s": (w[-1] - w[0]) / steps,
                "cpu_s": (c[-1] - c[0]) / steps, "steps": steps,
                "times_s": [b - a for a, b in zip(w, w[1:])]}


def _data(batch: int, steps: int):
    """The same random images on every rank (the trainers' samplers give each rank its half)."""
    import torch

    g = torch.Generator().manual_seed(0)
    n = 2 * batch * (steps + 2)
    return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def _compression():
    from cgx.compression import Compression
    return Compression.quantize(bits=4)


def _by_hand(route: str, steps: int, warmup: int, batch: int) -> dict[str, Any]:
    """compute, cgx-optimizer, cgx-ddp-hook(-view): benchmarks/training.py's methods, in a
    plain loop."""
    import torch.distributed as dist

    from benchmarks.training import torch_method

    x, y = _data(batch, 0)
    rank = dist.get_rank()
    x, y = x[rank * batch:(rank + 1) * batch], y[rank * batch:(rank + 1) * batch]
    m = torch_method(route, x, y)
    clock = Clock(warmup)
    for _ in range(warmup + steps + 1):
        m.step()
        clock.tick()
    return clock.result(route)


def _lightning(steps: int, warmup: int, batch: int) -> dict[str, Any]:
    import lightning as L
    import torch

    from benchmarks.training import vgg11
    from cgx.integrations.lightning import CGXCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = vgg11()

        def training_step(self, b, _):
            return torch.nn.functional.cross_entropy(self.net(b[0]), b[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    clock = Clock(warmup)

    class Timing(L.Callback):
        def on_train_batch_end(self, *_):
            clock.tick()

    n = warmup + steps + 1
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_data(batch, n)),
                                       batch_size=batch)
    trainer = L.Trainer(accelerator="cpu", devices=1, num_nodes=int(os.environ["WORLD_SIZE"]),
                        strategy="ddp", max_steps=n, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[CGXCallback(_compression()), Timing()])
    trainer.fit(Module(), data)
    return clock.result("lightning")


def _hf_trainer(steps: int, warmup: int, batch: int, tmp: str) -> dict[str, Any]:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import cgx.integrations.huggingface as cgx_hf
    from benchmarks.training import vgg11

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = vgg11()

        def forward(self, x, labels):
            logits = self.net(x)
            return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}

    class Images(torch.utils.data.Dataset):
        def __init__(self, x, y):
            self.x, self.y = x, y

        def __len__(self):
            return len(self.y)

        def __getitem__(self, i):
            return {"x": self.x[i], "labels": self.y[i]}

    clock = Clock(warmup)

    class Timing(TrainerCallback):
        def on_step_end(self, *_, **__):
            clock.tick()

    n = warmup + steps + 1
    model = Model()
    args = TrainingArguments(output_dir=tmp, max_steps=n, per_device_train_batch_size=batch,
                             learning_rate=0.01, lr_scheduler_type="constant", save_strategy="no",
                             logging_steps=10 ** 6, report_to="none", use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True,
                             remove_unused_columns=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    trainer = Trainer(model=model, args=args, train_dataset=Images(*_data(batch, n)),
                      optimizers=(opt, None), callbacks=[Timing()])
    cgx_hf.compress(trainer, compression=_compression())
    trainer.train()
    return clock.result("hf-trainer")


def rank_main(route: str, steps: int, warmup: int, batch: int) -> dict[str, Any]:
    """One rank of one route: its step and CPU seconds per timed step."""
    import torch

    torch.set_num_threads(1)
    if route == "lightning":
        os.environ.setdefault("TORCHELASTIC_RUN_ID", "integration-steps")  # torchrun's mark
        return _lightning(steps, warmup, batch)
    if route == "hf-trainer":
        with tempfile.TemporaryDirectory() as tmp:
            return _hf_trainer(steps, warmup, batch, tmp)
    return _by_hand(route, steps, warmup, batch)


def _run_rounds(args) -> list[list[dict]]:
    """Every round: every route once, in turn; each route's ranks' results (or its error)."""
    from benchmarks.netsim import RankFailedError, SlowNetwork
    from cgx.console import progress

    rounds = []
    cases = [(i, r) for i in range(args.rounds) for r in args.routes]
    for i, route in progress(cases, desc="routes", unit="run"):
        if route == args.routes[0]:
            rounds.append({})
        kwargs = {"route": route, "steps": args.steps, "warmup": args.warmup,
                  "batch": args.batch}
        try:
            with SlowNetwork(n_ranks=2, rate=args.rate) as net:
                ranks = net.run_function("benchmarks.integration_steps:rank_main", kwargs,
                                         backend=None if route in OWN_GROUP else "gloo",
                                         timeout=1800)
        except RankFailedError as exc:  # report a route that crashes, keep the others
            ranks = [{"route": route, "error": str(exc).splitlines()[-1][:300]}]
        rounds[-1][route] = ranks
    return rounds


def summarize(rounds: list[dict], routes: list[str], cores: int) -> list[dict]:
    """Per route: the median over rounds of the slowest rank's step, of its ratio to the
    same round's cgx-optimizer step, and of the CPU floor."""
    out = []
    for route in routes:
        ok = [r[route] for r in rounds if route in r and "error" not in r[route][0]]
        if not ok:
            errors = [r[route][0]["error"] for r in rounds if route in r]
            out.append({"route": route, "error": errors[0] if errors else "not run"})
            continue
        step = [max(k["step_s"] for k in ranks) for ranks in ok]
        floor = [sum(k["cpu_s"] for k in ranks) / cores for ranks in ok]
        ratio = [max(k["step_s"] for k in r[route]) / max(k["step_s"] for k in r[BASE])
                 for r in rounds if _both_ok(r, route)]
        out.append({"route": route, "step_s": statistics.median(step), "steps_s": step,
                    "cpu_floor_s": statistics.median(floor),
                    "vs_optimizer": statistics.median(ratio) if ratio else None,
                    "ratios": ratio})
    return out


def _both_ok(r: dict, route: str) -> bool:
    return all(k in r and "error" not in r[k][0] for k in (route, BASE))


def table(rows: list[dict], args, compute: Optional[float]) -> str:
    cmd = " ".join([".venv/bin/python benchmarks/integration_steps.py", *args.argv])
    lines = [f"`{cmd}` (2 ranks on one machine of {os.cpu_count()} cores, link "
             f"{args.rate or 'unshaped'}, batch {args.batch}, {args.steps} timed steps after "
             f"{args.warmup}, median of {args.rounds} interleaved rounds; load average "
             f"{os.getloadavg()[0]:.1f} at the end)", "",
             "| route | s/step | vs cgx-optimizer (same round, median) | vs compute step | "
             "CPU floor s/step |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['route']} | failed: {r['error']} | | | |")
            continue
        ratio = "" if r["vs_optimizer"] is None else f"{r['vs_optimizer']:.3f}x"
        vs_compute = f"{r['step_s'] / compute:.2f}x" if compute else ""
        lines.append(f"| {r['route']} | {r['step_s']:.3f} | {ratio} | {vs_compute} | "
                     f"{r['cpu_floor_s']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    csv = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--routes", type=csv, default=ROUTES, help=f"from {ROUTES}")
    p.add_argument("--rate", default="1gbit", help="the link's rate; none: unshaped")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/integration-steps")
    args = p.parse_args(argv)
    bad = [r for r in args.routes if r not in ROUTES]
    if bad or BASE not in args.routes:
        p.error(f"routes {bad or args.routes}: choose from {ROUTES}, {BASE} included")
    args.rate = None if args.rate.lower() == "none" else args.rate
    args.argv = argv

    from benchmarks.netsim import NetnsUnavailable
    try:
        rounds = _run_rounds(args)
    except NetnsUnavailable as exc:
        print(f"cannot build the simulated network: {exc}", file=sys.stderr)
        return 2
    rows = summarize(rounds, args.routes, os.cpu_count() or 1)
    compute = next((r["step_s"] for r in rows if r["route"] == "compute" and "step_s" in r), None)
    save(args.out, {"rate": args.rate, "batch": args.batch, "steps": args.steps,
                    "warmup": args.warmup, "rows": rows, "rounds": rounds},
         table(rows, args, compute))
    return 0


if __name__ == "__main__":
    sys.exit(main())
