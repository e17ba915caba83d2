"""Train an MLP on scikit-learn's digits, written exactly like a Horovod script.

Only the import differs from Horovod (`import cgx.torch as hvd`). Launch with
any launcher:

    cgxrun -np 2 python examples/pytorch_horovod_style.py
    torchrun --nproc-per-node 2 examples/pytorch_horovod_style.py
    mpirun -np 2 python examples/pytorch_horovod_style.py
    horovodrun -np 2 python examples/pytorch_horovod_style.py

By default cgx decides how gradients travel (the deciding exchange: trials keep the
fastest measured plan within 4-bit's error budget); change that with the CGX_*
variables (e.g. CGX_COMPRESSION=quantize for fixed 4-bit, with
CGX_COMPRESSION_QUANTIZATION_BITS=8 for 8-bit) or --compression.
"""

import argparse
import dataclasses

import torch
from sklearn.datasets import load_digits
from cgx.console import progress

import cgx.torch as hvd


@dataclasses.dataclass
class TrainConfig:
    epochs: int = 10
    batch_size: int = 32  # per rank: the global batch is batch_size * hvd.size()
    lr: float = 0.02  # per rank; scaled by hvd.size() below, as Horovod recommends
    hidden: int = 256
    compression: str = "env"  # env (CGX_* variables), fp16, exact, topk, powersgd
    checkpoint: str = ""  # path to save model + optimizer (incl. cgx state) at the end
    seed: int = 42


def parse() -> TrainConfig:
    cfg = TrainConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in dataclasses.fields(cfg):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    return TrainConfig(**vars(p.parse_args()))


def main():
    cfg = parse()
    hvd.init()
    torch.manual_seed(cfg.seed)

    # Data: every rank loads the set (tiny) and keeps its shard.
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    test_x, test_y = x[:300], y[:300]
    x, y = x[300:][hvd.rank()::hvd.size()], y[300:][hvd.rank()::hvd.size()]

    model = torch.nn.Sequential(torch.nn.Linear(64, cfg.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(cfg.hidden, 10))
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr * hvd.size(), momentum=0.9)
    compression = {"env": hvd.Compression.none, "fp16": hvd.Compression.fp16,
                   "exact": hvd.Compression.exact, "topk": hvd.Compression.topk(0.05),
                   "powersgd": hvd.Compression.powersgd(rank=4)}[cfg.compression]
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=compression)
    # Start every rank from rank 0's weights and optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

    g = torch.Generator().manual_seed(cfg.seed + hvd.rank())
    bar = progress(range(cfg.epochs), desc="epochs")
    for epoch in bar:
        order = torch.randperm(len(x), generator=g)
        for i in range(0, len(order) - cfg.batch_size + 1, cfg.batch_size):
            idx = order[i:i + cfg.batch_size]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()  # gradient exchange starts here, bucket by bucket
            opt.step()  # waits for it: a sync point
        # Average the metric over ranks (exact: functional allreduce does not compress).
        avg_loss = hvd.allreduce(loss.detach(), name="loss").item()
        bar.set_postfix(loss=f"{avg_loss:.3f}")

    with torch.no_grad():
        acc = (model(test_x).argmax(1) == test_y).float().mean().item()
    if hvd.rank() == 0:
        stats = hvd.stats()
        print(f"test accuracy {100 * acc:.1f}%  |  sent {stats.wire_bytes / 1e6:.2f} MB "
              f"in {stats.calls} reductions")
        if cfg.checkpoint:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                       cfg.checkpoint)
    hvd.shutdown()


if __name__ == "__main__":
    main()
