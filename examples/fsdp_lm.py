"""Sharded training (FSDP2) with compressed gradients: a small language model.

    cgxrun -np 2 python examples/fsdp_lm.py
    torchrun --nproc-per-node 2 examples/fsdp_lm.py --bits 4 --params-bits 8

PyTorch's FSDP2 (``fully_shard``) shards the parameters, gradients and optimizer state
over the ranks; one cgx call makes its gradient reduce-scatter travel quantized (8 bits
with error feedback here) instead of in fp32. The rest is a plain FSDP2 script.

The text comes from a fixed random Markov chain over a small vocabulary, so the best
loss any model can reach is known (the entropy of its transitions) and printed next to ours.
"""

import argparse
import dataclasses

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import cgx.torch as hvd
import cgx.torch.fsdp


@dataclasses.dataclass
class TrainConfig:
    vocab: int = 32  # tokens of the generated text
    width: int = 128  # model width
    blocks: int = 2  # residual MLP blocks, each its own FSDP parameter group
    batch_size: int = 256  # tokens per rank and step
    steps: int = 150
    lr: float = 3e-3
    seed: int = 0


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


def make_model(cfg: TrainConfig) -> torch.nn.Sequential:
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank, as FSDP expects
    return torch.nn.Sequential(torch.nn.Embedding(cfg.vocab, cfg.width),
                               *[Block(cfg.width) for _ in range(cfg.blocks)],
                               torch.nn.LayerNorm(cfg.width), torch.nn.Linear(cfg.width, cfg.vocab))


def markov_chain(cfg: TrainConfig):
    """Transition matrix (peaked rows) and the best loss on :func:`batch`'s transitions:
    the mean entropy of a row, in nats per token."""
    g = torch.Generator().manual_seed(1234)
    p = torch.softmax(3.0 * torch.randn(cfg.vocab, cfg.vocab, generator=g), dim=1)
    return p, float(-(p * p.log()).sum(1).mean())


def batch(p, cfg: TrainConfig, g: torch.Generator):
    """Transitions: uniformly drawn tokens and their successors."""
    x = torch.randint(0, cfg.vocab, (cfg.batch_size,), generator=g)
    y = torch.multinomial(p[x], 1, generator=g).squeeze(1)
    return x, y


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--bits", type=int, default=8, help="0: FSDP2's own fp32 reduce-scatter")
    parser.add_argument("--params-bits", type=int, default=None,
                        help="quantize the parameters' all-gather too (default: exact)")
    parser.add_argument("--checkpoint", default=None, help="save a checkpoint here at the end")
    args = parser.parse_args(argv)
    cfg = TrainConfig(steps=args.steps)

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo")  # the launcher's RANK/WORLD_SIZE/MASTER_* variables
    hvd.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(cfg)
    mesh = init_device_mesh("cpu", (world,))
    for block in model[1:1 + cfg.blocks]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the embedding, the final norm and the head
    # The cgx line: the reduce-scatter of every parameter group goes through cgx.
    compression = (hvd.Compression.quantize(bits=args.bits, error_feedback=True) if args.bits
                   else hvd.Compression.exact)
    state = cgx.torch.fsdp.compress(model, compression=compression, params_bits=args.params_bits)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)

    p, entropy = markov_chain(cfg)
    g = torch.Generator().manual_seed(cfg.seed + 1 + rank)  # each rank its own data
    losses = []
    for step in range(cfg.steps):
        x, y = batch(p, cfg, g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()  # FSDP2 reduce-scatters each group's gradients as backward goes
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())  # a host sync; fine at this size

    if args.checkpoint:  # cgx's state (residuals, step counters) travels with the model's
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd, "cgx": state},
                 checkpoint_id=args.checkpoint)
    final = sum(losses[-20:]) / len(losses[-20:])
    sent = hvd.stats().wire_bytes / cfg.steps
    if rank == 0:
        what = f"cgx {args.bits}-bit" if args.bits else "FSDP2 fp32"
        print(f"final loss {final:.3f} (best possible: {entropy:.3f}; first step "
              f"{losses[0]:.3f}) with {what} gradients, {sent / 1e3:.1f} kB/step through cgx, "
              f"parameter all-gather error {state.param_gather_error():.2e}")
    hvd.shutdown()
    if owned:
        dist.destroy_process_group()
    return final, losses[0], entropy


if __name__ == "__main__":
    main()
