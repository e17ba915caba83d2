"""cgx in PyTorch Lightning: one callback in ``Trainer(callbacks=[...])``.

    python examples/lightning_ddp.py                             # 2 CPU processes, 4 bits
    python examples/lightning_ddp.py --compression exact --max-steps 50
    python examples/lightning_ddp.py --package pytorch_lightning
    python examples/lightning_ddp.py --strategy fsdp2            # ModelParallelStrategy

Lightning's ``strategy="ddp"`` starts the other processes itself (it re-runs this script),
so no launcher is needed. An MLP on scikit-learn's digits (nothing is downloaded); the
tests (tests/test_integration_lightning.py) run it with small settings.

``--compression``: ``plain`` (no cgx: Lightning's own DDP), ``exact``, ``4bit``,
``4bit-ef`` (4 bits with error feedback), ``auto``, or ``env`` (the ``CGX_*`` default).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from pathlib import Path
from typing import Optional

import torch
from sklearn.datasets import load_digits

import cgx.torch


@dataclasses.dataclass
class TrainConfig:
    package: str = "lightning"     # or "pytorch_lightning": the same script on either
    compression: str = "4bit-ef"   # see the module docstring; a,b,c: one fit each, in turn
    strategy: str = "ddp"          # ddp | ddp-hook | fsdp2 | model-parallel (no sharding)
    devices: int = 2
    max_steps: int = 16
    samples: int = 1024            # 1024 over 2 ranks x 64: 8 steps per epoch
    batch_size: int = 64           # per rank
    hidden: int = 256
    lr: float = 0.1
    seed: int = 0
    log_every_n_steps: int = 4
    log_dir: str = "lightning_logs"
    ckpt_dir: Optional[str] = None  # checkpoints <ckpt_dir>/<run>/step=<n>.ckpt
    ckpt_every: int = 8             # steps between checkpoints (8: at each epoch's end)
    ckpt_path: Optional[str] = None  # resume from this checkpoint ({run}: the run's name)
    out: Optional[str] = None       # rank 0 writes <out>/<run>.pt: parameters, losses, figures


def compression_of(name: str):
    """The ``compression=`` of CGXCallback for a ``--compression`` name (None: no cgx)."""
    table = {"plain": None, "env": "env", "exact": cgx.torch.Compression.exact,
             "4bit": cgx.torch.Compression.quantize(bits=4),
             "4bit-ef": cgx.torch.Compression.quantize(bits=4, error_feedback=True),
             "auto": "auto"}
    if name not in table:
        raise ValueError(f"--compression {name!r}: choose one of {', '.join(table)}")
    return table[name]


def make_module(L, cfg: TrainConfig):
    """A LightningModule class for the package ``L`` (``lightning.pytorch`` or
    ``pytorch_lightning``)."""

    class DigitsMLP(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(64, cfg.hidden), torch.nn.ReLU(),
                torch.nn.Linear(cfg.hidden, cfg.hidden), torch.nn.ReLU(),
                torch.nn.Linear(cfg.hidden, 10))
            self.losses: list[float] = []
            self.bucket_view = None  # DDP's gradient_as_bucket_view, as the fit ran

        def on_train_start(self):
            self.bucket_view = getattr(self.trainer.strategy.model, "gradient_as_bucket_view",
                                       None)

        def configure_model(self):
            # ModelParallelStrategy's hook: FSDP2 over the data-parallel mesh
            if cfg.strategy == "fsdp2":
                from torch.distributed.fsdp import fully_shard
                mesh = self.device_mesh["data_parallel"]
                for layer in self.net:
                    if isinstance(layer, torch.nn.Linear):
                        fully_shard(layer, mesh=mesh)
                fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            self.losses.append(float(loss.detach()))
            self.log("train_loss", loss)
            return loss

        def train_dataloader(self):  # called once the processes are connected
            return make_data(cfg)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=cfg.lr, momentum=0.9)

    return DigitsMLP


def make_data(cfg: TrainConfig) -> torch.utils.data.DataLoader:
    digits = load_digits()
    # shuffled once, here: the batches of every epoch are then fixed, and a fit resumed
    # from a checkpoint sees the ones an uninterrupted fit sees (Lightning's resume of a
    # shuffling sampler does not replay the same order)
    order = torch.randperm(len(digits.target), generator=torch.Generator().manual_seed(cfg.seed))
    order = order[:cfg.samples]
    x = torch.tensor(digits.data, dtype=torch.float32)[order] / 16.0
    y = torch.tensor(digits.target)[order]
    # Each rank its own half, the same batches every epoch (Trainer(use_distributed_sampler
    # =False): Lightning's would shuffle every epoch)
    data = torch.utils.data.TensorDataset(x, y)
    sampler = torch.utils.data.distributed.DistributedSampler(data, shuffle=False)
    return torch.utils.data.DataLoader(data, batch_size=cfg.batch_size, sampler=sampler)


def make_strategy(L, cfg: TrainConfig):
    if cfg.strategy == "ddp":
        return "ddp"
    if cfg.strategy == "ddp-hook":  # cgx's hook given to Lightning too: an error
        return L.strategies.DDPStrategy(ddp_comm_hook=cgx.torch.cgx_hook)
    if cfg.strategy in ("fsdp2", "model-parallel"):
        return L.strategies.ModelParallelStrategy(data_parallel_size=cfg.devices,
                                                  tensor_parallel_size=1)
    raise ValueError(f"--strategy {cfg.strategy!r}: choose ddp, ddp-hook, fsdp2 or "
                     "model-parallel")


def main(cfg: TrainConfig) -> None:
    """One fit per ``--compression`` name, in turn, in the same processes."""
    rows = [fit(dataclasses.replace(cfg, compression=name))
            for name in cfg.compression.split(",")]
    if rows[0]["rank"] == 0:
        print(f"{'run':>10} | {'ratio':>6} | {'bytes/step':>10} | final loss")
        for row in rows:
            print(f"{row['run']:>10} | {row['ratio']:>5.2f}x | {row['bytes_per_step']:>10.0f} | "
                  f"{row['loss']:.4f}", flush=True)


def fit(cfg: TrainConfig) -> dict:
    """Train once with ``cfg``; returns rank and figures for the table."""
    L = importlib.import_module({"lightning": "lightning.pytorch",
                                 "pytorch_lightning": "pytorch_lightning"}[cfg.package])
    from cgx.integrations import lightning as cgx_lightning

    L.seed_everything(cfg.seed, verbose=False)
    model = make_module(L, cfg)()
    callbacks = []
    comp = compression_of(cfg.compression)
    if cfg.compression != "plain":
        cls = cgx_lightning.CGXCallback if cfg.package == "lightning" \
            else cgx_lightning.PLCGXCallback
        # The one cgx line: the callback.
        callbacks.append(cls(None if comp == "env" else comp,
                             log_every_n_steps=cfg.log_every_n_steps))
    if cfg.ckpt_dir:
        callbacks.append(L.callbacks.ModelCheckpoint(
            dirpath=Path(cfg.ckpt_dir) / cfg.compression, filename="{step}",
            every_n_train_steps=cfg.ckpt_every, save_top_k=-1))
    trainer = L.Trainer(accelerator="cpu", devices=cfg.devices,
                        strategy=make_strategy(L, cfg), max_steps=cfg.max_steps,
                        enable_progress_bar=False, enable_model_summary=False,
                        log_every_n_steps=cfg.log_every_n_steps, callbacks=callbacks,
                        use_distributed_sampler=False,
                        logger=L.loggers.CSVLogger(cfg.log_dir, name=cfg.compression))
    trainer.fit(model, ckpt_path=cfg.ckpt_path and cfg.ckpt_path.format(run=cfg.compression))
    return report(trainer, model, callbacks, cfg)


def report(trainer, model, callbacks, cfg: TrainConfig) -> dict:
    """cgx's figures (rank 0's); rank 0 writes them and the parameters to ``--out``."""
    cb = next((c for c in callbacks if isinstance(c, cgx_callback_types())), None)
    figures = {"ratio": 1.0, "bytes_per_step": 0.0}
    if cb is not None and cb.state is not None:
        figures = cb.summary(trainer)
    # FSDP2's parameters are shards (DTensor): gathered whole on every rank
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for n, p in model.named_parameters()}
    row = {"run": cfg.compression, "rank": trainer.global_rank,
           "loss": model.losses[-1] if model.losses else float("nan"), **figures}
    if trainer.is_global_zero and cfg.out:
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        torch.save({"params": params, "losses": model.losses, "figures": figures,
                    "log_dir": trainer.logger.log_dir, "global_step": trainer.global_step,
                    "bucket_view": model.bucket_view},
                   Path(cfg.out) / f"{cfg.compression}.pt")
    return row


def cgx_callback_types() -> tuple:
    from cgx.integrations.lightning import CGXCallbackImpl
    return (CGXCallbackImpl,)


def parse(argv=None) -> TrainConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(TrainConfig):
        kind = {"int": int, "float": float}.get(field.type, str)
        parser.add_argument("--" + field.name.replace("_", "-"), type=kind,
                            default=field.default)
    return TrainConfig(**vars(parser.parse_args(argv)))


if __name__ == "__main__":
    main(parse())
