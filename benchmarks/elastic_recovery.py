"""What a lost rank costs: cgx's elastic training against torchrun's restart from a checkpoint.

The digits MLP of examples/torch_elastic.py (64-128-10, SGD with momentum, fixed 4-bit),
3 ranks on this machine (2 cores: the 3 ranks share them), batch ``--batch`` per rank, for
``--steps`` steps. Three runs:

``elastic``        ``cgxrun -np 3 --min-np 2``: no failure.
``elastic-kill``   the same; one rank is killed (SIGKILL) every ``--every`` steps. Its
                   slot takes a new rank at once (``--blacklist-cooldown-range 0 0``),
                   which joins at the next commit (every 5 steps).
``restart``        ``torchrun --max-restarts 20 --nproc-per-node 3`` on this file's
                   ``--worker``. It writes a checkpoint every ``--checkpoint-every`` steps to
                   disk (each rank its own, so residuals resume too). No failure.
``restart-kill``   the same; one rank killed every ``--every`` steps makes torchrun
                   restart all three, which resume from the last checkpoint.

Every rank logs every step (time, loss). The figures: wall time to ``--steps``, the time to
the target loss (the ranks' loss averaged over 30 logged steps below ``--target``), and the
cost of one failure: (wall time - the same launcher's run without failures) / failures,
and the same from the times to the target.

    .venv/bin/python benchmarks/elastic_recovery.py --out docs/results/elastic-recovery
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.outputs import save  # noqa: E402

EXAMPLE = os.path.join(ROOT, "examples", "torch_elastic.py")
RUNS = ["elastic", "elastic-kill", "restart", "restart-kill"]


# -- the checkpoint-restart baseline's rank ---------------------------------------------------

def worker(args) -> None:
    """One rank under torchrun: examples/torch_elastic.py's training (model, sampler, lr,
    4-bit), resumed from the last checkpoint and checkpointed every few steps."""
    import torch
    from sklearn.datasets import load_digits

    import cgx.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    data = load_digits()
    dataset = torch.utils.data.TensorDataset(
        torch.tensor(data.data, dtype=torch.float32) / 16.0, torch.tensor(data.target))
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.quantize(bits=4))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=1)
    path = os.path.join(args.checkpoints, f"rank{hvd.rank()}.pt")
    step, epoch = 0, 0
    if os.path.exists(path):
        ck = torch.load(path, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sampler.load_state_dict(ck["sampler"])
        step, epoch = ck["step"], ck["sampler"]["epoch"]
    log = open(os.path.join(args.log, f"{os.getpid()}.jsonl"), "a")
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch, sampler=sampler)
    while step < args.steps:
        for i, (xb, yb) in enumerate(loader):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            step += 1
            sampler.record_batch(i, args.batch)
            log.write(json.dumps({"pid": os.getpid(), "step": step, "loss": loss.item(),
                                  "t": time.time()}) + "\n")
            log.flush()
            if step % args.checkpoint_every == 0:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                            "sampler": sampler.state_dict(), "step": step}, path + ".tmp")
                os.replace(path + ".tmp", path)
            if step == args.steps:
                return
        epoch += 1
        sampler.set_epoch(epoch)


# -- the driver --------------------------------------------------------------------------------

def _rows(log: str) -> list:
    rows = []
    for f in glob.glob(os.path.join(log, "*.jsonl")):
        with open(f) as fh:
            rows += [json.loads(ln) for ln in fh if ln.endswith("}\n")]
    return rows


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _command(name: str, args, log: str, ckpt: str, hosts: str) -> list:
    common = ["--log", log, "--max-steps", str(args.steps), "--epochs", "1000",
              "--batch-size", str(args.batch), "--compression", "4bit"]
    if name.startswith("elastic"):
        return [os.path.join(os.path.dirname(sys.executable), "cgxrun"), "-np", "3",
                "--min-np", "2", "--max-np", "3", "-H", hosts,
                "--blacklist-cooldown-range", "0", "0", "--", sys.executable, EXAMPLE,
                *common]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", "3", "--max-restarts", "20", __file__, "--worker",
            "--rank-log", log, "--checkpoints", ckpt, "--steps", str(args.steps),
            "--batch", str(args.batch), "--checkpoint-every", str(args.checkpoint_every)]


def run_one(name: str, args) -> dict:
    tmp = tempfile.mkdtemp(prefix=f"cgx-{name}-")
    log, ckpt = os.path.join(tmp, "log"), os.path.join(tmp, "ckpt")
    os.makedirs(log)
    os.makedirs(ckpt)
    cmd = _command(name, args, log, ckpt, "127.0.0.1:1,127.0.0.2:1,127.0.0.3:1")
    start = time.time()
    # torch 2.13's torchrun shares its rendezvous store with the workers, and restarted
    # workers then read the dead attempt's Gloo addresses (connectFullMesh fails, every
    # restart, with plain torch.distributed too): the baseline turns the sharing off.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(
        os.path.join(tmp, "stderr.txt"), "w"), start_new_session=True, env=env)
    kills, next_kill = [], args.every
    try:
        while proc.poll() is None:
            time.sleep(0.05)
            if not name.endswith("kill") or next_kill >= args.steps:
                continue
            rows = _rows(log)
            if rows and max(r["step"] for r in rows) >= next_kill:
                live = sorted({r["pid"] for r in rows if _alive(r["pid"])})
                if live:
                    os.kill(live[len(kills) % len(live)], signal.SIGKILL)
                    kills.append(round(time.time() - start, 2))
                    next_kill += args.every
        proc.wait(args.timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    rows = sorted(_rows(log), key=lambda r: r["t"])
    out = {"run": name, "exit": proc.returncode, "wall_s": round(time.time() - start, 2),
           "kills_at_s": kills, "to_target_s": _to_target(rows, start, args.target),
           "steps_logged": len(rows)}
    if os.environ.get("CGX_BENCH_KEEP"):
        print(f"{name}: logs kept in {tmp}", file=sys.stderr)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _to_target(rows: list, start: float, target: float, window: int = 30):
    losses = []
    for r in rows:
        losses.append(r["loss"])
        if len(losses) >= window and sum(losses[-window:]) / window < target:
            return round(r["t"] - start, 2)
    return None


def table(results: list, args) -> str:
    by = {r["run"]: r for r in results}
    lines = [f"Digits MLP, 3 ranks on 2 CPU cores, fixed 4-bit, batch {args.batch} per rank, "
             f"{args.steps} steps, one rank killed every {args.every} steps; target: the "
             f"loss averaged over 30 logged steps below {args.target:g}.", "",
             "| run | exit | wall s | to target s | failures | s per failure (wall) | "
             "s per failure (to target) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        n, clean = len(r["kills_at_s"]), by.get(r["run"].replace("-kill", ""))
        wall = target = "-"
        if n and clean:
            wall = f"{(r['wall_s'] - clean['wall_s']) / n:.1f}"
            if r["to_target_s"] is not None and clean["to_target_s"] is not None:
                target = f"{(r['to_target_s'] - clean['to_target_s']) / n:.1f}"
        lines.append(f"| {r['run']} | {r['exit']} | {r['wall_s']:.1f} | "
                     f"{r['to_target_s'] if r['to_target_s'] is not None else '-'} | {n} | "
                     f"{wall} | {target} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--every", type=int, default=100, help="steps between failures")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--target", type=float, default=0.05)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default="")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank-log", dest="log", help=argparse.SUPPRESS)
    p.add_argument("--checkpoints", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    results = [run_one(name, args) for name in args.runs.split(",")]
    md = table(results, args)
    if args.out:
        save(args.out, {"args": vars(args), "results": results}, md)
    else:
        print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
