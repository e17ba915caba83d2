"""Lightning and Hugging Face's Trainer with cgx's fixed 4-bit against their plain DDP.

For each seed, the examples train twice on 2 CPU processes (Gloo, loopback): their own
DDP, and the same fit with cgx's callback. Printed per trainer: the bytes each rank sends
per step (plain DDP: an fp32 ring allreduce of every parameter; cgx: what its transport
counted) and the final training loss (the mean of the last 10 steps' losses), with the
plain runs' range over the seeds, within which cgx's mean final loss should lie, and
cgx's final loss minus plain DDP's seed by seed.

    .venv/bin/python benchmarks/integrations.py --seeds 0,1,2 --out docs/results/integrations

No link is shaped and no step is timed: this measures bytes and accuracy, not speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
LAST = 10  # final loss: the mean of the last steps' training losses


def ring_bytes(numel: int, world: int = 2) -> float:
    """Bytes one rank sends in a ring allreduce of ``numel`` float32 values."""
    return 2 * (world - 1) / world * 4 * numel


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}


def _run(cmd: list, cwd: str) -> None:
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        sys.exit(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def lightning(seed: int, steps: int, tmp: str) -> dict:
    """{"plain": (bytes/step, final loss), "cgx": ...} of one seed's two Lightning fits."""
    out = Path(tmp) / f"lightning-{seed}"
    _run([sys.executable, ROOT / "examples/lightning_ddp.py", "--compression", "plain,4bit",
          "--max-steps", str(steps), "--seed", str(seed), "--out", out,
          "--log-dir", Path(tmp) / "logs"], tmp)
    runs = {}
    for name, key in (("plain", "plain"), ("4bit", "cgx")):
        rec = torch.load(out / f"{name}.pt", weights_only=False)
        numel = sum(p.numel() for p in rec["params"].values())
        sent = ring_bytes(numel) if name == "plain" else rec["figures"]["bytes_per_step"]
        runs[key] = (sent, statistics.fmean(rec["losses"][-LAST:]))
    return runs


def huggingface(seed: int, steps: int, tmp: str) -> dict:
    """The same for two runs of the Trainer on a tiny GPT-2 under torchrun."""
    runs = {}
    for name, key in (("off", "plain"), ("q4", "cgx")):
        out = Path(tmp) / f"hf-{name}-{seed}.pt"
        _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
              "--master-port", str(29600 + seed), ROOT / "examples/huggingface_trainer.py",
              "--compression", name, "--max-steps", str(steps), "--seed", str(seed),
              "--output-dir", Path(tmp) / f"hf-{name}-{seed}", "--out", out], tmp)
        rec = torch.load(out, weights_only=False)
        losses = [h["loss"] for h in rec["log_history"] if "loss" in h]
        numel = sum(p.numel() for p in rec["params"].values())
        sent = ring_bytes(numel) if name == "off" else rec["wire_bytes"] / steps
        runs[key] = (sent, statistics.fmean(losses[-LAST:]))
    return runs


def summarize(trainer: str, per_seed: list) -> dict:
    """One trainer's figures over the seeds, and the target's verdicts."""
    plain = [r["plain"] for r in per_seed]
    cgx = [r["cgx"] for r in per_seed]
    lo, hi = min(p[1] for p in plain), max(p[1] for p in plain)
    ratio = statistics.fmean(p[0] for p in plain) / statistics.fmean(c[0] for c in cgx)
    return {"trainer": trainer, "plain_bytes": statistics.fmean(p[0] for p in plain),
            "cgx_bytes": statistics.fmean(c[0] for c in cgx), "fewer_bytes": ratio,
            "plain_loss": [p[1] for p in plain], "cgx_loss": [c[1] for c in cgx],
            "plain_spread": [lo, hi],
            "paired_difference": [c[1] - q[1] for c, q in zip(cgx, plain)],
            "within_spread": lo <= statistics.fmean(c[1] for c in cgx) <= hi,
            "at_least_7x": ratio >= 7.0}


def table(rows: list) -> str:
    lines = ["| trainer | bytes/step plain DDP | bytes/step cgx 4-bit | fewer | final loss "
             "plain (per seed) | final loss cgx (per seed) |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['trainer']} | {r['plain_bytes']:,.0f} | {r['cgx_bytes']:,.0f} | "
                     f"{r['fewer_bytes']:.2f}x | "
                     f"{', '.join(f'{x:.4f}' for x in r['plain_loss'])} | "
                     f"{', '.join(f'{x:.4f}' for x in r['cgx_loss'])} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--lightning-steps", type=int, default=200)
    p.add_argument("--hf-steps", type=int, default=100)
    p.add_argument("--out", default=None, help="write <out>.json and <out>.md")
    a = p.parse_args(argv)
    seeds = [int(s) for s in a.seeds.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        rows = [summarize("Lightning 2.6.6, digits MLP",
                          [lightning(s, a.lightning_steps, tmp) for s in seeds]),
                summarize("transformers 5.24.0 Trainer, tiny GPT-2",
                          [huggingface(s, a.hf_steps, tmp) for s in seeds])]
    text = table(rows)
    print(text)
    for r in rows:
        print(f"{r['trainer']}: {r['fewer_bytes']:.2f}x fewer bytes (target 7x: "
              f"{'met' if r['at_least_7x'] else 'missed'}); cgx's mean final loss "
              f"{'within' if r['within_spread'] else 'outside'} plain DDP's seed range "
              f"{r['plain_spread'][0]:.4f}-{r['plain_spread'][1]:.4f}; cgx - plain per seed: "
              f"{', '.join(f'{d:+.4f}' for d in r['paired_difference'])}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{a.out}.json").write_text(json.dumps(rows, indent=1))
        Path(f"{a.out}.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
