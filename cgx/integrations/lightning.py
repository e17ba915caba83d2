"""cgx in PyTorch Lightning 2.x: one callback compresses the gradient exchange.

Example::

    import lightning as L
    from cgx.integrations.lightning import CGXCallback
    import cgx.torch

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", callbacks=[
        CGXCallback(cgx.torch.Compression.quantize(bits=4, error_feedback=True))])

With the standalone ``pytorch_lightning`` package, pass :class:`PLCGXCallback` instead
(Lightning checks ``isinstance(cb, Callback)`` against its own package's class).

What it does at ``setup`` (before Lightning wraps the model): under ``DDPStrategy``,
DDP is built with ``gradient_as_bucket_view=True`` unless the strategy was given that
argument: the gradients are then views of DDP's buckets, which cgx's hook reduces in
place, so DDP copies no bucket back into the gradients (one copy of every gradient per
step saved; ``DDPStrategy(gradient_as_bucket_view=False)`` keeps the copy).

What it does at ``on_fit_start`` (before the first step, every rank):

* ``strategy="ddp"`` (the model is a ``DistributedDataParallel``, on CPU or GPU):
  registers :func:`cgx.torch.cgx_hook` with a :class:`cgx.torch.CGXState`.
* ``ModelParallelStrategy`` whose ``configure_model`` applied ``fully_shard`` (FSDP2):
  ``cgx.torch.init()`` (on Lightning's process group) and :func:`cgx.torch.fsdp.compress`.
* One process: nothing (a warning says so). Anything else (DeepSpeed, FSDP1, ...):
  ``RuntimeError``.

Checkpoints carry every rank's cgx state (residuals, step, plan); ``fit(ckpt_path=...)``
continues exactly. Every ``log_every_n_steps`` it logs ``cgx/bytes_per_step`` and
``cgx/ratio`` (rank 0's), and the plan's ``cgx/plan_bytes`` / ``cgx/plan_bits`` when it
changes and at the end. See docs/lightning.md.

Lightning is imported only when a callback class is first asked for.
"""

from __future__ import annotations

import importlib
import io
import math
import warnings
from typing import Any, Optional

# The Lightning packages this module supports: import name -> the module with ``Callback``.
_PACKAGES = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning"}
_PIP = {"lightning": "lightning==2.6.6", "pytorch_lightning": "pytorch-lightning==2.6.6"}
STATE_FORMAT = 1
# The classes made so far, one per package (made on first use: Lightning loads slowly).
_classes: dict = {}


class CGXCallbackImpl:
    """The callback's logic, independent of which Lightning package runs it.

    Use :class:`CGXCallback` (``lightning``) or :class:`PLCGXCallback`
    (``pytorch_lightning``): the same class with that package's ``Callback`` as a base.

    Args:
        compression: how gradients travel: a ``cgx.torch.Compression`` (e.g.
            ``Compression.quantize(bits=4, error_feedback=True)``, ``Compression.exact``),
            ``"auto"``, or None for the ``CGX_*`` environment's default.
        config: a ``cgx.Config`` (default: ``Config.from_env()``); DDP only.
        rules: per-layer rules (dict, list or YAML path, see ``cgx.rules``); DDP only.
        error_feedback: keep residuals (see :class:`cgx.torch.CGXState`); DDP only.
        log_every_n_steps: log cgx's figures every this many optimizer steps (default:
            the trainer's ``log_every_n_steps``).

    Attributes:
        state: the ``CGXState`` (DDP) or ``FSDPCompression`` (FSDP2) once the fit has
            started; None before, and with one process.
    """

    def __init__(self, compression=None, *, config=None, rules=None,
                 error_feedback: Optional[bool] = None,
                 log_every_n_steps: Optional[int] = None):
        if log_every_n_steps is not None and (
                isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int)
                or log_every_n_steps < 1):
            raise ValueError(f"log_every_n_steps={log_every_n_steps!r}: pass a positive int, "
                             "or None for the trainer's log_every_n_steps")
        self.compression, self.config, self.rules = compression, config, rules
        self.error_feedback, self.log_every_n_steps = error_feedback, log_every_n_steps
        self.state = None
        self.route: Optional[str] = None  # "ddp", "fsdp2" or "none" (one process)
        # A checkpoint's state restored before the state exists (Lightning restores
        # callbacks before on_fit_start under DDP): applied when it is built.
        self._pending: Optional[dict] = None
        self._start_step = 0  # the trainer's global step when the fit started
        self._start = (0, 0.0)  # cgx's (sent, fp32 ring) byte counts when the fit started
        self._last_log = (0, 0)  # (global step, bytes sent since the start) at the last log
        self._last_plan: Optional[tuple] = None

    @property
    def state_key(self) -> str:
        # One key for both packages' classes: a checkpoint written under ``lightning``
        # resumes under ``pytorch_lightning`` and back.
        return "CGXCallback"

    # -- Lightning hooks --------------------------------------------------------------

    def setup(self, trainer, pl_module, stage: str) -> None:
        """Before the strategy wraps the model (fit only): DDP keeps the gradients as views
        of its buckets, unless ``DDPStrategy(gradient_as_bucket_view=...)`` says otherwise."""
        kwargs = getattr(trainer.strategy, "_ddp_kwargs", None)  # DDPStrategy's DDP arguments
        if stage == "fit" and isinstance(kwargs, dict):
            kwargs.setdefault("gradient_as_bucket_view", True)

    def on_fit_start(self, trainer, pl_module) -> None:
        """Attach cgx to the wrapped model, before the first backward.

        Raises:
            RuntimeError: an unsupported strategy, or a DDP comm hook passed to
                ``DDPStrategy`` as well.
        """
        if self.state is not None:  # a second fit with the same callback: the same state
            return
        if trainer.world_size == 1:
            self.route = "none"
            warnings.warn("CGXCallback: one process, no gradient exchange to compress: "
                          "cgx does nothing in this fit", stacklevel=2)
            return
        model = trainer.strategy.model
        if _is_ddp(model):
            self.state = self._attach_ddp(trainer, model)
            self.route = "ddp"
        elif _is_fsdp2(model):
            self.state = self._attach_fsdp2(model)
            self.route = "fsdp2"
        else:
            raise RuntimeError(_unsupported(trainer.strategy, model))
        if self._pending is not None:
            self._apply(self._pending)
            self._pending = None
        self._start = self._counts()

    def on_train_start(self, trainer, pl_module) -> None:
        """The step counts start here: on resume the loops' state (the global step) is
        restored after ``on_fit_start``."""
        self._start_step = trainer.global_step
        self._last_log = (trainer.global_step, self.wire_bytes())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """Every ``log_every_n_steps`` optimizer steps: log bytes per step and the ratio."""
        if self.state is None:
            return
        every = self.log_every_n_steps or trainer.log_every_n_steps or 1
        step, last = trainer.global_step, self._last_log[0]
        if step == last or step % every:
            return
        sent = self.wire_bytes()
        metrics = {"cgx/bytes_per_step": (sent - self._last_log[1]) / (step - last),
                   "cgx/ratio": self.ratio()}
        self._last_log = (step, sent)
        metrics.update(self._plan_metrics(changed_only=True))
        _log_metrics(trainer, metrics)

    def on_fit_end(self, trainer, pl_module) -> None:
        """The plan kept at the end (``cgx/plan_bytes``, ``cgx/plan_bits``)."""
        if self.state is not None:
            _log_metrics(trainer, self._plan_metrics(changed_only=False))

    # -- checkpoints -------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Every rank's cgx state, for Lightning's checkpoint (written by rank 0).

        Lightning calls this on every rank in ``Trainer.save_checkpoint``, so the ranks
        gather their states here (a collective).

        Returns:
            ``{"format", "route", "world", "ranks": [bytes per rank]}``, or ``{}`` before
            the fit started and with one process (Lightning then stores nothing).
        """
        if self.state is None:
            return {}
        import torch.distributed as dist
        mine = _to_bytes(self.state.state_dict())
        ranks = [None] * dist.get_world_size()
        # Pickles over the default group; on NCCL the objects go through this rank's GPU.
        dist.all_gather_object(ranks, mine)
        return {"format": STATE_FORMAT, "route": self.route, "world": len(ranks),
                "ranks": ranks}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore this rank's entry of a :meth:`state_dict` (now, or when the state is
        built at ``on_fit_start``).

        Raises:
            ValueError: not a CGXCallback state, or saved by another number of ranks.
        """
        if not isinstance(state_dict, dict) or state_dict.get("format") != STATE_FORMAT:
            raise ValueError(f"not a CGXCallback checkpoint state (format "
                             f"{state_dict.get('format') if isinstance(state_dict, dict) else None!r}"
                             f", expected {STATE_FORMAT})")
        if self.state is None:
            self._pending = state_dict
        else:
            self._apply(state_dict)

    # -- internals ---------------------------------------------------------------------

    def _attach_ddp(self, trainer, model):
        import cgx.torch
        strategy = trainer.strategy
        if getattr(strategy, "_ddp_comm_hook", None) is not None or \
                getattr(strategy, "_ddp_comm_state", None) is not None or \
                getattr(model, "_comm_hooks", None):
            raise RuntimeError(
                "CGXCallback registers cgx's DDP comm hook, but the model has one already "
                "(DDPStrategy(ddp_comm_hook=... / ddp_comm_state=...), or a second "
                "CGXCallback); DDP takes one hook: drop the ddp_comm_* arguments (cgx's hook "
                "replaces them), or drop CGXCallback")
        optimizers = list(trainer.optimizers)
        state = cgx.torch.CGXState(
            model, process_group=getattr(model, "process_group", None), config=self.config,
            rules=self.rules, error_feedback=self.error_feedback, compression=self.compression,
            # auto's error-feedback rule reads the optimizer (SGD keeps residuals)
            optimizer=optimizers[0] if len(optimizers) == 1 else None)
        model.register_comm_hook(state, cgx.torch.cgx_hook)
        # The engine now, not at the first bucket: every rank is here (its group is made
        # collectively), and the byte counts this fit reports start from its totals.
        state.reducer()
        return state

    def _attach_fsdp2(self, model):
        import cgx.torch
        import cgx.torch.fsdp
        for name in ("config", "rules", "error_feedback"):
            if getattr(self, name) is not None:
                raise ValueError(f"CGXCallback({name}=...) applies to the DDP hook; under "
                                 "ModelParallelStrategy (FSDP2) pass the settings in "
                                 "compression= (e.g. Compression.quantize(bits=8, "
                                 "error_feedback=True)) or the CGX_* variables")
        # cgx's runtime on the process group Lightning made (the world it adopts)
        cgx.torch.init(transport="torch")
        comp = cgx.torch.Compression.none if self.compression is None else self.compression
        return cgx.torch.fsdp.compress(model, compression=comp)

    def _apply(self, state_dict: dict) -> None:
        import torch.distributed as dist
        world, rank = dist.get_world_size(), dist.get_rank()
        if state_dict.get("world") != world or len(state_dict.get("ranks", ())) != world:
            raise ValueError(f"this checkpoint's cgx state was saved by {state_dict.get('world')} "
                             f"ranks; this fit has {world}: residuals are per rank, so resume "
                             "on as many ranks (or remove checkpoint['callbacks'] entry "
                             "'CGXCallback' to start cgx afresh)")
        if state_dict.get("route") != self.route:
            raise ValueError(f"this checkpoint's cgx state comes from the {state_dict.get('route')}"
                             f" route, this fit uses {self.route}: resume with the same strategy")
        self.state.load_state_dict(_from_bytes(state_dict["ranks"][rank]))

    def _counts(self) -> tuple:
        """(bytes this rank sent, an fp32 ring exchange's bytes for the same values), over
        cgx's whole engine so far (other states on the same engine included: the callback
        reports differences)."""
        if self.route == "ddp":
            stats = self.state.stats()
        else:
            from cgx import session
            stats = session.stats()
        if "_fp32_wire" in stats.seconds:  # the hook's own count of a ring's fp32 bytes
            return int(stats.wire_bytes), float(stats.seconds["_fp32_wire"])
        # FSDP2's reduce-scatter: a ring sends (W-1)/W of each fp32 input
        import torch.distributed as dist
        world = dist.get_world_size()
        return int(stats.wire_bytes), stats.numel * 4.0 * (world - 1) / world

    def ratio(self) -> float:
        """fp32 ring bytes over the bytes this rank sent, since this fit started (1.0
        before anything was sent).

        Example::

            print(f"{callback.ratio():.1f}x fewer bytes than fp32")
        """
        if self.state is None:
            return 1.0
        wire, fp32 = self._counts()
        sent = wire - self._start[0]
        return (fp32 - self._start[1]) / sent if sent else 1.0

    def wire_bytes(self) -> int:
        """Bytes this rank sent for gradients since this fit started (0 before)."""
        return self._counts()[0] - self._start[0] if self.state is not None else 0

    def summary(self, trainer) -> dict:
        """This rank's figures since the fit started.

        Returns:
            ``{"route", "steps", "wire_bytes", "bytes_per_step", "ratio"}``.
        """
        steps = trainer.global_step - self._start_step
        sent = self.wire_bytes()
        return {"route": self.route, "steps": steps, "wire_bytes": sent,
                "bytes_per_step": sent / steps if steps else 0.0, "ratio": self.ratio()}

    def _plan_metrics(self, changed_only: bool) -> dict:
        """``cgx/plan_bytes`` (bytes per step the plan sends per rank, as planned) and
        ``cgx/plan_bits`` (their bits per value); with ``changed_only``, {} when they are
        those logged last."""
        rows = self.state.compression_plan()
        if not rows:  # FSDP2 with a fixed level: no per-group plan to report
            return {}
        numel = sum(math.prod(r["shape"]) for r in rows if "shape" in r)
        total = float(sum(r["bytes"] for r in rows))
        summary = (total, numel)
        if changed_only and summary == self._last_plan:
            return {}
        self._last_plan = summary
        out = {"cgx/plan_bytes": total}
        if numel:
            out["cgx/plan_bits"] = 8.0 * total / numel
        return out

    def __getstate__(self) -> dict:
        # ddp_spawn pickles the trainer's callbacks into the workers: the state is per fit
        state = dict(self.__dict__)
        state["state"] = None
        return state


# -- helpers ---------------------------------------------------------------------------

def _is_ddp(model) -> bool:
    from torch.nn.parallel import DistributedDataParallel
    return isinstance(model, DistributedDataParallel)


def _is_fsdp2(model) -> bool:
    """A module ``fully_shard`` was applied to (itself or a submodule): FSDP2."""
    import torch
    if not isinstance(model, torch.nn.Module):
        return False
    from torch.distributed.fsdp import FSDPModule
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _unsupported(strategy, model) -> str:
    return (f"CGXCallback supports strategy='ddp' (DDPStrategy, the model wrapped in "
            f"DistributedDataParallel) and ModelParallelStrategy with fully_shard (FSDP2) in "
            f"configure_model; this fit uses {type(strategy).__name__} with a "
            f"{type(model).__name__} model. Switch to one of those, or remove CGXCallback "
            f"(FSDPStrategy, i.e. FSDP1, and DeepSpeed have their own gradient exchange)")


def _log_metrics(trainer, metrics: dict) -> None:
    """To every logger of the trainer, on rank 0 only (as Lightning's own logging does)."""
    if not metrics or not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)


def _to_bytes(state: dict) -> bytes:
    """One rank's state as ``torch.save`` bytes: the checkpoint holds plain bytes per rank,
    whatever containers the state uses (Lightning loads with ``weights_only``)."""
    import torch
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _from_bytes(blob: bytes) -> dict:
    import torch
    return torch.load(io.BytesIO(blob), weights_only=True)


def _callback_class(package: str) -> type:
    """``CGXCallbackImpl`` with ``package``'s ``Callback`` as a base (made once)."""
    if package not in _classes:
        try:
            base = importlib.import_module(_PACKAGES[package]).Callback
        except ImportError as exc:
            raise ImportError(f"cgx.integrations.lightning needs the {package!r} package: "
                              f"pip install {_PIP[package]} (or cgx[integrations])") from exc
        name = "CGXCallback" if package == "lightning" else "PLCGXCallback"
        doc = (f"cgx's gradient compression for ``{package}`` 2.x Trainers; see "
               f":class:`CGXCallbackImpl`.")
        cls = type(name, (CGXCallbackImpl, base), {"__doc__": doc, "__module__": __name__})
        cls.__qualname__ = name
        _classes[package] = cls
    return _classes[package]


def __getattr__(name: str) -> Any:
    # CGXCallback (for ``lightning``) and PLCGXCallback (for ``pytorch_lightning``) are made
    # on first access, so that importing this module does not import Lightning.
    if name == "CGXCallback":
        return _callback_class("lightning")
    if name == "PLCGXCallback":
        return _callback_class("pytorch_lightning")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CGXCallback", "PLCGXCallback", "CGXCallbackImpl"]
