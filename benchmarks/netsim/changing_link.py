"""A link whose rate changes mid-run, and the deciding exchange following it.

Rank functions for :meth:`SlowNetwork.run_function`. Each rank reshapes its own side of the
simulated link (its namespace's veth: tbf on its egress), so the change lands at the same
training step on every rank without a controller outside the job.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from typing import Any, Optional

from .shaping import Shaping


def reshape_own_link(rate: Optional[str]) -> None:
    """Shape this rank's link (``GLOO_SOCKET_IFNAME``) at ``rate`` ("100mbit"; None: unshaped).
    Runs inside the rank's namespace: only its egress changes; every rank calls it."""
    tc, dev = shutil.which("tc"), os.environ["GLOO_SOCKET_IFNAME"]
    if tc is None:
        raise RuntimeError("the `tc` command (iproute2) is not on PATH; install iproute2")
    if rate is None:
        subprocess.run([tc, "qdisc", "del", "dev", dev, "root"], capture_output=True)
        return
    subprocess.run([tc, "qdisc", "replace", "dev", dev, "root", *Shaping(rate=rate).tc_args()],
                   check=True, capture_output=True, text=True)


def deciding_under_changing_link(steps: int, changes: dict, width: int = 1024, depth: int = 1,
                                 batch: int = 8, window: int = 3,
                                 trial_steps: int = 2, recheck_every: int = 5,
                                 drift_tolerance: float = 0.5,
                                 trial_runoffs: int = 1, factors: bool = False) -> dict[str, Any]:
    """Train an MLP (``depth`` hidden layers of ``width``) with
    ``Compression.auto(objective="time")`` for ``steps`` steps; at each step named in
    ``changes`` (JSON: string keys) the link is reshaped to its rate (None: unshaped).
    ``factors``: the linear layers found in the first step are weighed as sufficient
    factors too (two plans more in each round; off, the default, as without a model).
    Returns the rounds of trials, the checks of the kept plans and each step's seconds."""
    import torch
    import cgx.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))
    comp = hvd.Compression.auto(objective="time", window=window, trial_steps=trial_steps,
                                recheck_every=recheck_every, drift_tolerance=drift_tolerance,
                                families=("quantize",), trial_runoffs=trial_runoffs)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), compression=comp,
                                   sufficient_factors=None if factors else False)
    changes = {int(k): v for k, v in changes.items()}
    g = torch.Generator().manual_seed(hvd.rank())
    seconds = []
    for step in range(steps):
        if step in changes:
            reshape_own_link(changes[step])
        t0 = time.perf_counter()
        x = torch.randn(batch, width, generator=g)
        y = torch.randint(0, 10, (batch,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        seconds.append(time.perf_counter() - t0)
    return {"rounds": opt.exchange_trials(), "checks": opt.exchange_checks(),
            "seconds": seconds}
