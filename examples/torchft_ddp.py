"""Fault-tolerant DDP with torchft and cgx's compressed exchange: an MLP on scikit-learn's
digits, one process per replica group, that keeps training when a group dies and heals
a group that comes back from a live peer, with no checkpoint.

    torchft_lighthouse --min_replicas 1 --bind [::]:29510 &
    python examples/torchft_ddp.py --replica-id 0 --lighthouse http://localhost:29510 &
    python examples/torchft_ddp.py --replica-id 1 --lighthouse http://localhost:29510 &

Kill one (``kill -9``) and start it again with the same ``--replica-id``: the other goes
on alone, and the restarted one takes the model, the optimizer and cgx's state from it
and joins the next quorum. ``--log DIR`` writes every step (the manager's step, the
participants, the loss, a digest of the parameters) to ``DIR/<replica>-<pid>.jsonl``.
"""

import argparse
import hashlib
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torchft.manager import Manager
from torchft.optim import OptimizerWrapper
from torchft.process_group import ProcessGroupGloo

import cgx.torch as hvd
from cgx.integrations.torchft import DistributedDataParallel


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replica-id", type=int, required=True)
    p.add_argument("--lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE", ""))
    p.add_argument("--steps", type=int, default=200, help="the manager's steps to train")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--compression", default="4bit",
                   help="4bit, 4bit-ef (with error feedback), powersgd, exact")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket size")
    p.add_argument("--step-sleep", type=float, default=0.0, help="pause after each step")
    p.add_argument("--log", default="", help="write each step to DIR/<replica>-<pid>.jsonl")
    return p.parse_args()


def digest(model) -> str:
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    return hashlib.sha1(flat.numpy().tobytes()).hexdigest()[:16]


def main():
    args = parse()
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    def load_state_dict(state):
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1,
                      load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"digits_{args.replica_id}", store_addr="localhost",
                      store_port=store.port, rank=0, world_size=1,
                      lighthouse_addr=args.lighthouse, timeout=timedelta(seconds=10))
    compression = {"4bit": hvd.Compression.quantize(bits=4),
                   "4bit-ef": hvd.Compression.quantize(bits=4, error_feedback=True),
                   "powersgd": hvd.Compression.powersgd(rank=2),
                   "exact": hvd.Compression.exact}[args.compression]
    ddp = DistributedDataParallel(manager, model, compression=compression,
                                  bucket_cap_mb=args.bucket_cap_mb)
    opt = OptimizerWrapper(manager, inner)
    log = open(os.path.join(args.log, f"{args.replica_id}-{os.getpid()}.jsonl"), "a") \
        if args.log else None
    while manager.current_step() < args.steps:
        step = manager.current_step()
        rows = torch.randint(len(x), (args.batch_size,),
                             generator=torch.Generator().manual_seed(step * 7 + args.replica_id))
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x[rows]), y[rows])
        loss.backward()
        opt.step()
        if log:
            log.write(json.dumps({
                "pid": os.getpid(), "replica": args.replica_id, "step": manager.current_step(),
                "participants": manager.num_participants(), "loss": loss.item(),
                "digest": digest(model), "discarded": ddp.cgx_state.discarded,
                "undone": ddp.cgx_state.undone,
                "sent": ddp.cgx_state.stats().wire_bytes, "t": time.time()}) + "\n")
            log.flush()
        time.sleep(args.step_sleep)
    print(f"replica {args.replica_id}: {manager.current_step()} steps, last loss "
          f"{loss.item():.3f}", flush=True)
    ddp.cgx_state.close()
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
