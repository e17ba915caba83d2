"""Train an MLP on scikit-learn's digits with DiLoCo: local AdamW steps, a compressed
outer step every H steps. For links where even compressed per-step exchange is too slow
(100 Mbit/s - 1 Gbit/s between sites).

    cgxrun -np 2 python examples/diloco_digits.py
    cgxrun -np 2 python examples/diloco_digits.py --sync-every 20 --fragments 4  # streaming
    cgxrun -np 2 python examples/diloco_digits.py --sync-every auto

Each rank trains on its own shard. Every H steps the change of the weights since the
last sync (the outer gradient) is averaged over the ranks, 4-bit with error feedback,
and applied by Nesterov SGD (lr 0.7, momentum 0.9): one exchange per H steps instead of
one per step.
"""

import argparse
import dataclasses

import torch
from sklearn.datasets import load_digits

import cgx.torch as hvd


@dataclasses.dataclass
class TrainConfig:
    epochs: int = 10
    batch_size: int = 32  # per rank
    lr: float = 3e-3  # the inner AdamW's
    hidden: int = 256
    sync_every: str = "10"  # H: inner steps per outer step, or "auto" (from link and step)
    fragments: int = 1  # > 1: Streaming DiLoCo, fragments synced in turn, overlapped
    warmup_steps: int = 0  # synchronous data-parallel steps first
    checkpoint: str = ""  # save model + DiLoCo state (this rank's) at the end
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

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    test_x, test_y = x[:300], y[:300]
    x, y = x[300:][hvd.rank()::hvd.size()], y[300:][hvd.rank()::hvd.size()]

    model = torch.nn.Sequential(torch.nn.Linear(64, cfg.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(cfg.hidden, 10))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    sync_every = cfg.sync_every if cfg.sync_every == "auto" else int(cfg.sync_every)
    opt = hvd.DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=cfg.lr),
                     sync_every=sync_every, fragments=cfg.fragments,
                     warmup_steps=cfg.warmup_steps)

    g = torch.Generator().manual_seed(cfg.seed + hvd.rank())
    for epoch in range(cfg.epochs):
        order = torch.randperm(len(x), generator=g)
        for i in range(0, len(order) - cfg.batch_size + 1, cfg.batch_size):
            idx = order[i:i + cfg.batch_size]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()  # no communication: gradients stay on this rank
            opt.step()  # an inner step; on sync steps the outer exchange starts here
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1}: loss {loss.item():.3f} (rank 0's last batch), "
                  f"H={opt.sync_every}", flush=True)

    # Between syncs the ranks' weights differ; evaluate rank 0's (the last sync's anchor
    # plus its own local steps since).
    with torch.no_grad():
        acc = (model(test_x).argmax(1) == test_y).float().mean().item() * 100
    if hvd.rank() == 0:
        print(f"test accuracy {acc:.1f}%  ({hvd.stats().wire_bytes / 1e6:.2f} MB sent)")
    if cfg.checkpoint:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()},
                   f"{cfg.checkpoint}.rank{hvd.rank()}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
