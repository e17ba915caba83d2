"""The two training workloads: data that ships with packages, and their models.

* ``cnn``: a VGG-style network on scikit-learn's digits (1,797 8x8 images),
  upsampled to 32x32, with random shifts of up to 2 pixels. Its two wide fully
  connected layers hold most of the weights, so it is communication-heavy.
* ``lm``: a small causal transformer language model on the Python standard
  library's own source, split into word-level tokens (identifiers, numbers,
  single punctuation characters, newlines) with a vocabulary of the most
  frequent ones: a large embedding and output layer, as real LMs have.

Both are deterministic given the seed: model initialisation, the order of the
training samples (each rank takes its own share) and the augmentation.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import os
import re
import statistics
from typing import Callable

WORKLOADS = ("cnn", "lm")


@dataclasses.dataclass(frozen=True)
class Size:
    """How big a workload is: full (the benchmark) or tiny (the test suite)."""

    width: int  # cnn: units of the two hidden FC layers; lm: model dimension
    batch: int  # samples per rank per step
    seq: int = 64  # lm: tokens per sample
    vocab: int = 8192  # lm: vocabulary size
    layers: int = 2  # lm: transformer layers
    text_chars: int = 4_000_000  # lm: characters of standard-library source read


FULL = {"cnn": Size(width=4096, batch=32), "lm": Size(width=128, batch=16, vocab=4096)}
TINY = {"cnn": Size(width=64, batch=8),
        "lm": Size(width=32, batch=4, seq=16, vocab=512, layers=1, text_chars=200_000)}


@dataclasses.dataclass
class Workload:
    name: str
    model: "object"  # torch.nn.Module
    loss_fn: Callable  # (model, batch) -> scalar loss
    train_batch: Callable[[int], tuple]  # step -> this rank's batch
    # model -> {"loss": float, "loss_se": its standard error, "item_losses": the validation
    # items' (images', sequences') losses, "accuracy": float or None}
    evaluate: Callable
    samples_per_batch: int
    optimizer: Callable  # params -> torch optimizer


def make(name: str, rank: int, world: int, seed: int, tiny: bool = False) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")
    size = (TINY if tiny else FULL)[name]
    return _cnn(size, rank, world, seed) if name == "cnn" else _lm(size, rank, world, seed)


def standard_error(losses) -> float:
    """The standard error of a mean validation loss, from its independent parts' losses
    (the CNN's images, the LM's sequences: a sequence's tokens are not independent), or of
    a mean difference from its parts' differences (``report.paired_difference``)."""
    values = [float(v) for v in losses]
    return statistics.stdev(values) / math.sqrt(len(values))


def _on_model(m, *tensors) -> tuple:
    """``tensors`` on the device of ``m``'s parameters (the data is made on the CPU; the
    model is on a GPU with ``benchmarks/train.py --device cuda``)."""
    device = next(m.parameters()).device
    return tuple(t.to(device) for t in tensors)


# ------------------------------------------------------------------ digits CNN
def vgg_style(width: int, num_classes: int = 10):
    import torch.nn as nn
    layers, channels = [], 1
    for v in (32, "M", 64, "M", 128, "M", 128, "M"):
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(channels, v, 3, padding=1), nn.BatchNorm2d(v), nn.ReLU(True)]
            channels = v
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(128 * 2 * 2, width), nn.ReLU(True),
                         nn.Linear(width, width), nn.ReLU(True), nn.Linear(width, num_classes))


@functools.lru_cache(maxsize=1)
def _digits():
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    x = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False)
    x = (x - 0.5) / 0.5
    g = torch.Generator().manual_seed(1234)  # one fixed train/validation split
    order = torch.randperm(len(y), generator=g)
    y = torch.tensor(y)[order]
    x = x[order]
    n_val = 297
    return x[n_val:], y[n_val:], x[:n_val], y[:n_val]


def _shift(x, g, pad: int = 2):
    """Random translation by up to ``pad`` pixels (zero-filled), one per sample."""
    import torch
    import torch.nn.functional as F
    n, _, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad), value=float(x.min()))
    dx = torch.randint(0, 2 * pad + 1, (n,), generator=g)
    dy = torch.randint(0, 2 * pad + 1, (n,), generator=g)
    return torch.stack([padded[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w] for i in range(n)])


def _cnn(size: Size, rank: int, world: int, seed: int) -> Workload:
    import torch
    import torch.nn.functional as F
    train_x, train_y, val_x, val_y = _digits()
    torch.manual_seed(seed)
    model = vgg_style(size.width)
    per_epoch = len(train_y) // (size.batch * world)

    def train_batch(step: int):
        epoch, i = divmod(step, per_epoch)
        order = torch.randperm(len(train_y), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        lo = (i * world + rank) * size.batch
        idx = order[lo:lo + size.batch]
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * world + rank)
        return _shift(train_x[idx], g), train_y[idx]

    def loss_fn(m, batch):
        x, y = _on_model(m, *batch)
        return F.cross_entropy(m(x), y)

    @torch.no_grad()
    def evaluate(m):
        was = m.training
        m.eval()
        x, y = _on_model(m, val_x, val_y)
        logits = m(x)
        m.train(was)
        per_image = F.cross_entropy(logits, y, reduction="none")
        items = per_image.tolist()
        return {"loss": float(per_image.mean()), "loss_se": standard_error(items),
                "item_losses": items,
                "accuracy": float((logits.argmax(1) == y).float().mean())}

    return Workload("cnn", model, loss_fn, train_batch, evaluate, size.batch,
                    lambda params: torch.optim.SGD(params, lr=0.02, momentum=0.9, weight_decay=5e-4))


# ------------------------------------------------------------------ stdlib LM
_TOKEN = re.compile(r"[A-Za-z_]+|\d+|\n|[^\sA-Za-z_\d]")


@functools.lru_cache(maxsize=2)
def _corpus(chars: int, vocab: int):
    """Token ids of the first ``chars`` characters of the stdlib's .py files (sorted)."""
    import torch
    root = os.path.dirname(os.__file__)
    parts, n = [], 0
    for name in sorted(os.listdir(root)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
            text = f.read()
        parts.append(text)
        n += len(text)
        if n >= chars:
            break
    if n < chars // 4:
        raise RuntimeError(f"found only {n} characters of Python source under {root}")
    tokens = _TOKEN.findall("".join(parts)[:chars])
    counts = collections.Counter(tokens)
    common = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:vocab - 1]
    ids = {tok: i + 1 for i, (tok, _) in enumerate(common)}  # 0: any other token
    data = torch.tensor([ids.get(t, 0) for t in tokens], dtype=torch.long)
    cut = int(len(data) * 0.95)
    return data[:cut], data[cut:]


def transformer_lm(size: Size):
    import torch
    import torch.nn as nn

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            d = size.width
            self.embed = nn.Embedding(size.vocab, d)
            self.pos = nn.Parameter(torch.zeros(size.seq, d))
            layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=4 * d, dropout=0.0,
                                               batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, size.layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, size.vocab)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(size.seq),
                                 persistent=False)

        def forward(self, idx):
            t = idx.shape[1]
            h = self.embed(idx) + self.pos[:t]
            h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
            return self.head(self.norm(h))

    return LM()


def _lm(size: Size, rank: int, world: int, seed: int) -> Workload:
    import torch
    import torch.nn.functional as F
    train, val = _corpus(size.text_chars, size.vocab)
    torch.manual_seed(seed)
    model = transformer_lm(size)
    n_val = min(64, (len(val) - 1) // size.seq)
    val_x = torch.stack([val[i * size.seq:(i + 1) * size.seq] for i in range(n_val)])
    val_y = torch.stack([val[i * size.seq + 1:(i + 1) * size.seq + 1] for i in range(n_val)])

    def train_batch(step: int):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * world + rank)
        starts = torch.randint(0, len(train) - size.seq - 1, (size.batch,), generator=g)
        x = torch.stack([train[s:s + size.seq] for s in starts.tolist()])
        y = torch.stack([train[s + 1:s + size.seq + 1] for s in starts.tolist()])
        return x, y

    def loss_fn(m, batch):
        x, y = _on_model(m, *batch)
        logits = m(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def sequence_losses(m, x, y):
        x, y = _on_model(m, x, y)
        logits = m(x)
        return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(dim=1)

    @torch.no_grad()
    def evaluate(m):
        per_sequence = torch.cat([sequence_losses(m, val_x[i:i + 16], val_y[i:i + 16])
                                  for i in range(0, n_val, 16)])
        items = per_sequence.tolist()
        return {"loss": float(per_sequence.mean()), "loss_se": standard_error(items),
                "item_losses": items, "accuracy": None}

    return Workload("lm", model, loss_fn, train_batch, evaluate, size.batch,
                    lambda params: torch.optim.AdamW(params, lr=2e-3, weight_decay=0.01))
