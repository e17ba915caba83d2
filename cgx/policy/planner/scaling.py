"""Scaling predictions: step time and speed-up over DDP fp32 from 2 to 64 nodes.

From a model's layer profile (plain lists of layer shapes with their forward FLOPs per
sample; no downloads), a device speed (FLOP/s, measured or assumed) and the link, build
the tensors' gradient-ready times (backward runs the layers in reverse, each taking twice
its forward FLOPs), plan the exchange with the planner, and compare with what DDP fp32
does (every tensor exact, 25 MB buckets).

Ranks on one node share its network link: with ``ranks_per_node`` R, a flat collective
gives each rank 1/R of the node's rate (the traffic leaves by the same NIC).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Optional, Sequence

from cgx.policy.planner.costs import CostModel, TensorProfile
from cgx.policy.planner.strategy import plan


@dataclasses.dataclass(frozen=True)
class Layer:
    name: str
    shape: tuple[int, ...]  # the weight (bias and norm parameters are separate layers)
    fwd_flops: float  # forward multiply-adds x 2 per sample
    rows: int = 0  # batch rows per sample a linear layer sees (tokens); 0: not linear

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _conv(name, cin, cout, k, hw, layers, bias=False):
    layers.append(Layer(f"{name}.weight", (cout, cin, k, k), 2.0 * cin * cout * k * k * hw * hw))
    if bias:
        layers.append(Layer(f"{name}.bias", (cout,), cout * hw * hw))
    layers.append(Layer(f"{name}.bn", (2 * cout,), 4.0 * cout * hw * hw))


def resnet50(image: int = 224) -> list[Layer]:
    layers: list[Layer] = []
    hw = image // 2
    _conv("conv1", 3, 64, 7, hw, layers)
    hw //= 2
    cin = 64
    for stage, (blocks, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512))):
        for b in range(blocks):
            if b == 0 and stage > 0:
                hw //= 2
            p = f"layer{stage + 1}.{b}"
            _conv(f"{p}.conv1", cin, width, 1, hw, layers)
            _conv(f"{p}.conv2", width, width, 3, hw, layers)
            _conv(f"{p}.conv3", width, 4 * width, 1, hw, layers)
            if b == 0:
                _conv(f"{p}.downsample", cin, 4 * width, 1, hw, layers)
            cin = 4 * width
    layers.append(Layer("fc.weight", (1000, 2048), 2.0 * 2048 * 1000, rows=1))
    layers.append(Layer("fc.bias", (1000,), 1000.0))
    return layers


def bert_base(seq: int = 128, vocab: int = 30522, d: int = 768, blocks: int = 12) -> list[Layer]:
    layers = [Layer("embeddings.word", (vocab, d), 0.0), Layer("embeddings.position", (512, d), 0.0),
              Layer("embeddings.token_type", (2, d), 0.0),
              Layer("embeddings.norm", (2 * d,), 4.0 * d * seq)]
    for i in range(blocks):
        p = f"encoder.{i}"
        for proj in ("query", "key", "value", "output"):
            layers.append(Layer(f"{p}.attention.{proj}.weight", (d, d), 2.0 * d * d * seq, rows=seq))
            layers.append(Layer(f"{p}.attention.{proj}.bias", (d,), d * seq))
        layers.append(Layer(f"{p}.attention.scores", (0,), 4.0 * seq * seq * d))  # no weights
        layers.append(Layer(f"{p}.intermediate.weight", (4 * d, d), 8.0 * d * d * seq, rows=seq))
        layers.append(Layer(f"{p}.intermediate.bias", (4 * d,), 4.0 * d * seq))
        layers.append(Layer(f"{p}.output.weight", (d, 4 * d), 8.0 * d * d * seq, rows=seq))
        layers.append(Layer(f"{p}.output.bias", (d,), d * seq))
        layers.append(Layer(f"{p}.norms", (4 * d,), 8.0 * d * seq))
    layers.append(Layer("pooler.weight", (d, d), 2.0 * d * d, rows=1))
    layers.append(Layer("pooler.bias", (d,), d))
    return layers


def vgg11(image: int = 32, classes: int = 10) -> list[Layer]:
    """VGG-11 as in benchmarks/training.py (32x32 inputs, 4096-wide classifier)."""
    layers: list[Layer] = []
    cin, hw = 3, image
    for v in (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"):
        if v == "M":
            hw //= 2
            continue
        _conv(f"features.{len(layers)}", cin, v, 3, hw, layers, bias=True)
        cin = v
    for i, (a, b) in enumerate(((512, 4096), (4096, 4096), (4096, classes))):
        layers.append(Layer(f"classifier.{i}.weight", (b, a), 2.0 * a * b, rows=1))
        layers.append(Layer(f"classifier.{i}.bias", (b,), b))
    return layers


MODELS = {"vgg11": vgg11, "resnet50": resnet50, "bert-base": bert_base}


def profile(layers: Sequence[Layer], batch: int, flops: float) -> tuple[list[TensorProfile], float, float]:
    """Tensors with ready times, backward seconds, forward seconds (``flops`` per second)."""
    forward = sum(layer.fwd_flops for layer in layers) * batch / flops
    t, tensors = 0.0, []
    for layer in reversed(layers):  # backward: last layer first, 2x the forward work
        t += 2 * layer.fwd_flops * batch / flops
        if layer.numel:
            linear = len(layer.shape) == 2 and layer.rows > 0
            tensors.append(TensorProfile(layer.name, layer.numel, t,
                                         layer.shape if linear else None,
                                         layer.rows * batch if linear else None))
    return tensors, t, forward


@dataclasses.dataclass(frozen=True)
class Prediction:
    model: str
    nodes: int
    ranks_per_node: int
    gbit: float
    ddp_step_s: float
    cgx_step_s: float
    compute_s: float

    @property
    def speedup(self) -> float:
        return self.ddp_step_s / self.cgx_step_s


def predict(model: str, nodes: int, gbit: float, *, batch: int, flops: float,
            ranks_per_node: int = 1, latency_s: float = 50e-6,
            throughput: Optional[dict] = None, layers: Optional[Sequence[Layer]] = None,
            bits: Sequence[int] = (4,)) -> Prediction:
    """Predicted step of DDP fp32 and of cgx's planned exchange for one configuration."""
    tensors, backward, forward = profile(layers or MODELS[model](), batch, flops)
    world = nodes * ranks_per_node
    cost = CostModel.uniform(world, gbit / ranks_per_node, latency_s=latency_s, **(throughput or {}))
    ddp = plan(tensors, cost, backward, fusion_mb=(25.0,), families=("exact",))
    # DDP's bucket size among the thresholds: the plan is never slower than DDP's.
    cgx = plan(tensors, cost, backward, bits=bits, fusion_mb=(4.0, 16.0, 25.0, 64.0))
    return Prediction(model, nodes, ranks_per_node, gbit, forward + ddp.step_s,
                      forward + cgx.step_s, forward + backward)


def table(preds: Iterable[Prediction]) -> str:
    lines = ["| model | nodes x ranks | link | compute s | DDP fp32 s/step | cgx planned s/step "
             "| speed-up |", "|---|---|---:|---:|---:|---:|---:|"]
    for p in preds:
        lines.append(f"| {p.model} | {p.nodes} x {p.ranks_per_node} | {p.gbit:g} Gbit/s | "
                     f"{p.compute_s:.3f} | {p.ddp_step_s:.3f} | {p.cgx_step_s:.3f} | "
                     f"{p.speedup:.2f}x |")
    return "\n".join(lines)


def plot(preds: Sequence[Prediction], path: str) -> None:
    """Speed-up over DDP fp32 against the node count: one panel per model, a line per rate."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(p.model for p in preds))
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        for key in sorted({(p.gbit, p.ranks_per_node) for p in preds if p.model == model}):
            pts = sorted((p.nodes, p.speedup) for p in preds
                         if p.model == model and (p.gbit, p.ranks_per_node) == key)
            label = f"{key[0]:g} Gbit/s" + (f", {key[1]} ranks/node" if key[1] > 1 else "")
            ax.plot([n for n, _ in pts], [s for _, s in pts], "o-", label=label)
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, color="k", lw=0.6)
        ax.set(title=model, xlabel="nodes", ylabel="predicted speed-up over DDP fp32")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    import argparse
    import os
    p = argparse.ArgumentParser(prog="python -m cgx.policy.planner.scaling",
                                description="Predicted step time and speed-up over DDP fp32, "
                                            "2 to 64 nodes (table and PNG plot).")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--nodes", default="2,4,8,16,32,64")
    p.add_argument("--gbit", default="1,10,25")
    p.add_argument("--ranks-per-node", default="1,4")
    p.add_argument("--batch", type=int, default=32, help="samples per rank")
    p.add_argument("--flops", type=float, default=None,
                   help="device FLOP/s (default: measured here with a float32 matmul)")
    p.add_argument("--out", default=None, help="write <out>.md and <out>.png")
    args = p.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    bad = [m for m in args.models.split(",") if m not in MODELS]
    if bad:
        p.error(f"unknown model(s) {bad}; choose from {sorted(MODELS)}")
    flops = args.flops or measure_flops()
    from cgx.policy.planner.calibration import compressor_throughput
    tp = compressor_throughput()
    preds = [predict(m, n, float(g), batch=args.batch, flops=flops, ranks_per_node=r, throughput=tp)
             for m in args.models.split(",") for g in args.gbit.split(",")
             for r in ints(args.ranks_per_node) for n in ints(args.nodes)]
    head = (f"Device {flops / 1e9:.0f} GFLOP/s, quantizer {tp['compress_bps'] / 1e9:.1f} GB/s "
            f"(compress), batch {args.batch} per rank; ranks of a node share its link.")
    text = head + "\n\n" + table(preds)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".md", "w") as f:
            f.write(text + "\n")
        plot(preds, args.out + ".png")
    return 0


def measure_flops(n: int = 512, reps: int = 5) -> float:
    """Float32 multiply-add throughput of this device (one matmul, FLOP/s)."""
    import time

    import torch
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2.0 * n ** 3 * reps / (time.perf_counter() - t0)


if __name__ == "__main__":
    import sys
    sys.exit(main())
