"""cgx compression inside PyTorch DDP: register a communication hook, keep the rest.

    torchrun --nproc-per-node 2 examples/pytorch_ddp_hook.py
    cgxrun -np 2 python examples/pytorch_ddp_hook.py

Settings come from the CGX_* variables (by default the deciding exchange, within the
error budget of 4 bits, bucket 1024; CGX_COMPRESSION=quantize: fixed 4-bit).
"""

import dataclasses
import os

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP
from cgx.console import progress

import cgx.torch


@dataclasses.dataclass
class TrainConfig:
    epochs: int = 10
    batch_size: int = 32  # per rank
    lr: float = 0.05
    hidden: int = 256
    seed: int = 0


def main():
    cfg = TrainConfig()
    # A plain DDP set-up: the launcher's RANK/WORLD_SIZE/MASTER_* variables.
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg.seed)

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    test_x, test_y = x[:300], y[:300]
    x, y = x[300:][rank::world], y[300:][rank::world]

    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, cfg.hidden), torch.nn.ReLU(),
                                    torch.nn.Linear(cfg.hidden, 10)))
    # The only cgx lines: one state object (picklable, checkpointable) and the hook.
    state = cgx.torch.CGXState(model)
    model.register_comm_hook(state, cgx.torch.cgx_hook)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)

    g = torch.Generator().manual_seed(cfg.seed + rank)
    for epoch in progress(range(cfg.epochs), desc="epochs"):
        order = torch.randperm(len(x), generator=g)
        for i in range(0, len(order) - cfg.batch_size + 1, cfg.batch_size):
            idx = order[i:i + cfg.batch_size]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()

    with torch.no_grad():
        acc = (model(test_x).argmax(1) == test_y).float().mean().item()
    if rank == 0:
        print(f"test accuracy {100 * acc:.1f}% after {state.iteration} steps "
              f"(cgx hook, {os.environ.get('CGX_COMPRESSION_QUANTIZATION_BITS', '4')} bits)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
