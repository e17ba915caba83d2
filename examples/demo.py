"""cgx demo: the same 2-rank training run with exact, fp16 and cgx-compressed gradients.

Run it with ``make demo`` (or ``cgxrun -np 2 python examples/demo.py``). Every
rank trains an MLP on its half of scikit-learn's handwritten digits (shipped
with scikit-learn, nothing is downloaded); gradients are averaged with
``cgx.torch.DistributedOptimizer`` in five ways, and rank 0 prints what each
cost and what it reached, and which plan the default (the deciding exchange) kept
after timing its candidates.
"""

import dataclasses
import time

import torch
from sklearn.datasets import load_digits
from cgx.console import progress
from cgx.policy.trials import format_round

import cgx.torch as hvd


@dataclasses.dataclass
class Config:
    hidden: int = 512  # MLP width: ~0.3 M parameters, ~1.2 MB of fp32 gradients per step
    epochs: int = 12
    batch_size: int = 32  # per rank
    lr: float = 0.05
    seed: int = 0


RUNS = [  # (label, compression)
    ("fp32 (uncompressed)", hvd.Compression.exact),
    ("fp16 cast (Horovod)", hvd.Compression.fp16),
    ("cgx deciding (default)", hvd.Compression.none),
    ("cgx 4-bit", hvd.Compression.quantize(bits=4)),
    ("cgx 2-bit + error feedback", hvd.Compression.quantize(bits=2, error_feedback=True)),
]


def data(cfg: Config):
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(cfg.seed))
    x, y = x[perm], y[perm]
    n_test = len(x) // 5
    train_x, train_y = x[n_test:], y[n_test:]
    # Each rank trains on its own shard, as with a DistributedSampler.
    return train_x[hvd.rank()::hvd.size()], train_y[hvd.rank()::hvd.size()], x[:n_test], y[:n_test]


def train(cfg: Config, compression, label: str):
    torch.manual_seed(cfg.seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, cfg.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(cfg.hidden, cfg.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(cfg.hidden, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y, test_x, test_y = data(cfg)
    before = dataclasses.replace(hvd.stats())  # totals so far (copy)
    steps, step_time = 0, 0.0
    # The default decides by trials (its first steps measure and try plans): its row shows
    # the plan it kept, and what measuring and trying cost is printed below the table.
    decided = None  # (steps, seconds) when it kept a plan
    # A progress bar on rank 0, only when a person watches a terminal.
    epochs = progress(range(cfg.epochs), desc=f"{label:28s}", leave=False)
    g = torch.Generator().manual_seed(cfg.seed + hvd.rank())
    for _ in epochs:
        order = torch.randperm(len(x), generator=g)
        for i in range(0, len(x) - cfg.batch_size + 1, cfg.batch_size):
            idx = order[i:i + cfg.batch_size]
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()  # waits for the (compressed) gradient exchange
            step_time += time.perf_counter() - t0
            steps += 1
            if decided is None and opt.exchange_trials():
                decided = (steps, step_time)
    after = hvd.stats()
    with torch.no_grad():
        acc = (model(test_x).argmax(1) == test_y).float().mean().item()
    # Bytes this rank handed to cgx's transport, counted there: the gradients as they
    # travel (compressed codes, padding) and the optimizer's small per-step status exchange.
    wire = (after.wire_bytes - before.wire_bytes) / steps
    extra_mb = 0.0
    if decided is not None:  # the kept plan's bytes; the rest was measuring and trying
        kept = next(p for p in opt.exchange_trials()[-1]["plans"]
                    if p["label"] == opt.exchange_trials()[-1]["chosen"])
        extra_mb = (wire - kept["bytes"]) * steps / 1e6
        wire = kept["bytes"]
        steps, step_time = steps - decided[0], step_time - decided[1]
    # Every rank ends with identical weights: check it, it is cheap here.
    flat = torch.cat([p.detach().view(-1) for p in model.parameters()])
    same = bool(hvd.allreduce(flat, op=hvd.Max).equal(hvd.allreduce(flat, op=hvd.Min)))
    return {"label": label, "bytes": wire, "step_ms": 1e3 * step_time / steps, "acc": acc,
            "loss": loss.item(), "identical": same, "trials": opt.exchange_trials(),
            "decided_at": decided and decided[0], "extra_mb": extra_mb}


def main():
    cfg = Config()
    hvd.init()
    results = [train(cfg, comp, label) for label, comp in RUNS]
    if hvd.rank() == 0:
        base = results[0]["bytes"]
        print(f"\ncgx demo: {hvd.size()} ranks, MLP on scikit-learn digits, {cfg.epochs} epochs\n")
        print(f"| {'gradient exchange':28s} | bytes sent/step/rank | ratio | step time | "
              "test accuracy | ranks identical |")
        print(f"|{'-' * 30}|---------------------:|------:|----------:|--------------:|"
              "-----------------|")
        for r in results:
            print(f"| {r['label']:28s} | {r['bytes'] / 1e3:16.1f} kB | {base / r['bytes']:4.1f}x | "
                  f"{r['step_ms']:6.1f} ms | {100 * r['acc']:12.1f}% | "
                  f"{'yes' if r['identical'] else 'NO':15s} |")
        for r in results:
            if r["trials"]:  # the default: the plans its trials timed, the one it kept
                print(f"\n{r['label']}: bytes of the plan it kept, step time after its "
                      f"decision at step {r['decided_at']};\nmeasuring the layers' errors, "
                      f"the link and the plans (and re-checking) sent {r['extra_mb']:.1f} MB "
                      "more over the run. The plans it timed:\n" + format_round(r["trials"][-1]))
        print("\nbytes: what this rank handed to the transport per step, counted there (TCP/IP "
              "headers not included);\nthe ratio is against fp32.")
        print("Here the ranks share one machine, so the link is not the bottleneck and step "
              "time\ndoes not improve; on a slow link it does: see benchmarks/allreduce.py "
              "and README.md.")
    hvd.shutdown()


if __name__ == "__main__":
    main()
