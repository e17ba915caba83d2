"""Elastic training with Horovod's API: an MLP on scikit-learn's digits that keeps
training when a rank is lost and takes in ranks that join.

    cgxrun -np 3 --min-np 2 --max-np 4 python examples/torch_elastic.py
    cgxrun -np 3 --min-np 2 --host-discovery-script ./hosts.sh python examples/torch_elastic.py

Kill one of the ranks (``kill -9 <pid>``): the others roll back to the last commit, form a
world of the ranks left and go on. A host the discovery script adds gets a rank, which
joins at the next commit and receives the model, the optimizer and the sampler's
progress by broadcast. ``--log DIR`` writes every step of every rank (its world, the
loss and a digest of the parameters) to ``DIR/<pid>.jsonl``.
"""

import argparse
import hashlib
import json
import os
import time

import torch
from sklearn.datasets import load_digits

import cgx.torch as hvd


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps")
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--lr", type=float, default=0.05, help="per rank: scaled by the world size")
    p.add_argument("--commit-every", type=int, default=5, help="batches between commits")
    p.add_argument("--compression", default="default",
                   help="default (cgx's: the deciding exchange), 4bit, 4bit-ef (with error "
                        "feedback), exact, auto")
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="seconds to pause after each step (to watch a run, or in tests)")
    p.add_argument("--log", default="", help="write each step to DIR/<pid>.jsonl")
    return p.parse_args()


def compression_of(name: str):
    return {"default": hvd.Compression.none,  # cgx's default: the deciding exchange
            "4bit": hvd.Compression.quantize(bits=4),
            "4bit-ef": hvd.Compression.quantize(bits=4, error_feedback=True),
            "exact": hvd.Compression.exact, "auto": "auto"}.get(name, name)


def digest(model) -> str:
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    return hashlib.sha1(flat.numpy().tobytes()).hexdigest()[:16]


def main():
    args = parse()
    hvd.init()
    torch.manual_seed(0)
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    dataset = torch.utils.data.TensorDataset(x, y)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=compression_of(args.compression))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=1)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0, batch=0, step=0)
    log = open(os.path.join(args.log, f"{os.getpid()}.jsonl"), "a") if args.log else None

    def rescale():  # the world changed: the same per-rank lr, scaled by the new size
        for group in opt.param_groups:
            group["lr"] = args.lr * hvd.size()

    state.register_reset_callbacks([rescale])

    @hvd.elastic.run
    def train(state):
        loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size,
                                             sampler=state.sampler)
        for state.epoch in range(state.epoch, args.epochs):
            for i, (xb, yb) in enumerate(loader):
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(xb), yb)
                loss.backward()
                opt.step()
                state.step += 1
                state.sampler.record_batch(i, args.batch_size)
                if log:
                    log.write(json.dumps({"pid": os.getpid(), "rank": hvd.rank(),
                                          "size": hvd.size(), "step": state.step,
                                          "loss": loss.item(), "digest": digest(model),
                                          "host": os.environ.get("HOROVOD_HOSTNAME"),
                                          "start_rank": int(os.environ.get("HOROVOD_RANK",
                                                                           "-1")),
                                          "commits": state.commits,
                                          "dropped": state.dropped_owed,
                                          "t": time.time()}) + "\n")
                    log.flush()
                if state.step % args.commit_every == 0:
                    state.commit()
                if state.step == args.max_steps:
                    return loss.item()
                time.sleep(args.step_sleep)
            state.sampler.set_epoch(state.epoch + 1)
            state.commit()
        return loss.item()

    final = train(state)
    if hvd.rank() == 0:
        print(f"done: {state.step} steps, world of {hvd.size()}, last loss {final:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
