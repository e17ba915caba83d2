"""cgx in Hugging Face's ``transformers.Trainer`` and ``accelerate``: one line each.

Trainer (after constructing it, before ``train()``)::

    trainer = Trainer(model=model, args=args, train_dataset=data)
    cgx.integrations.huggingface.compress(trainer, compression=Compression.quantize(bits=4))
    trainer.train()                      # or trainer.train(resume_from_checkpoint=True)

or as a callback, ``Trainer(..., callbacks=[CGXTrainerCallback(compression=...)])``.

Accelerate (after ``accelerator.prepare``)::

    model, opt, data = accelerator.prepare(model, opt, data)
    state = cgx.integrations.huggingface.prepare(accelerator, model, compression=...)

Both register :func:`cgx.torch.cgx_hook` on the ``DistributedDataParallel`` module that
the Trainer or Accelerate built (with their DDP settings, ``find_unused_parameters=True``
included), before the first backward. Each rank's :class:`cgx.torch.CGXState` (error
feedback residuals, the step, the plan) travels with the checkpoints, so a resumed run
continues exactly. ``transformers`` and ``accelerate`` are imported only when used.

Not supported (a clear error before the first step): DeepSpeed, FSDP (1 and 2) through
the Trainer or Accelerate, a model that is not wrapped in DDP on more than one process.
On one process there is nothing to exchange: a single message, and training runs as
without cgx.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from cgx.torch.ddp import CGXState, cgx_hook

__all__ = ["CGXTrainerCallback", "compress", "prepare", "RankStates", "checkpoint_file",
           "keep_bucket_views", "log_figures"]

logger = logging.getLogger(__name__)

CHECKPOINT_FILE = "cgx-rank{rank}.pt"  # beside the Trainer's rng_state_{rank}.pth
CHECKPOINT_FORMAT = 1


# -- imports of the optional packages -----------------------------------------------------

def _require(module: str, what: str):
    """``import module``, or an ImportError that says which package to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - the integrations extra installs it
        raise ImportError(f"cgx.integrations.huggingface's {what} needs {module}: pip install "
                          f"'cgx[integrations]' (or pip install {module})") from exc


def _transformers():
    return _require("transformers", "Trainer support")


def _accelerate():
    return _require("accelerate", "prepare")


# -- what both integrations share ----------------------------------------------------------

def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _check_wrapped(model: torch.nn.Module, who: str, unwrapped: Optional[str] = None) -> None:
    """Raises for wrappers the DDP hook cannot serve: FSDP (1 or 2), DeepSpeed, none
    (``unwrapped``: the message for a model in no wrapper at all)."""
    name = type(model).__name__
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    if isinstance(model, FSDP1):
        raise RuntimeError(f"{who}: the model is wrapped in FSDP1 (FullyShardedDataParallel), "
                           "which cgx does not support; train with DDP (no fsdp settings), or "
                           "shard with FSDP2's fully_shard and call "
                           "cgx.torch.fsdp.compress(model) without the Trainer/Accelerate")
    if isinstance(model, FSDPModule) or any(isinstance(m, FSDPModule) for m in model.modules()):
        raise RuntimeError(f"{who}: the model is sharded with FSDP2 (fully_shard); cgx's FSDP2 "
                           "path is not supported through the Trainer or Accelerate yet: train "
                           "with DDP (no fsdp settings), or call cgx.torch.fsdp.compress(model) "
                           "in a loop of your own")
    if "DeepSpeed" in name:
        raise RuntimeError(f"{who}: the model is a DeepSpeed engine ({name}); cgx does not "
                           "support DeepSpeed: train with DDP (no deepspeed settings)")
    if not isinstance(model, DDP) and unwrapped is not None:
        raise RuntimeError(f"{who}: {unwrapped}, got {name}")
    if not isinstance(model, DDP):
        raise RuntimeError(f"{who}: on {_world_size()} processes the model should be wrapped in "
                           f"torch's DistributedDataParallel, got {name}; cgx compresses DDP's "
                           "gradient exchange, so let the Trainer/Accelerate use DDP (a "
                           "multi-process launch without deepspeed/fsdp settings)")


def _register(ddp: DDP, compression, config, rules, error_feedback, optimizer) -> CGXState:
    state = CGXState(ddp, process_group=ddp.process_group, config=config, rules=rules,
                     error_feedback=error_feedback, compression=compression,
                     optimizer=optimizer)
    ddp.register_comm_hook(state, cgx_hook)
    return state


def _tensors_to(tree, device):
    """``tree`` (dicts, lists, tuples of tensors) with its tensors on ``device``."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to(device)
    if isinstance(tree, dict):
        return {k: _tensors_to(v, device) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_tensors_to(v, device) for v in tree)
    return tree


def _device_of(module: torch.nn.Module) -> torch.device:
    return next((p.device for p in module.parameters()), torch.device("cpu"))


def _figures(state: CGXState, since_bytes: int, steps: int) -> dict:
    stats = state.stats()
    return {"cgx/bytes_per_step": (stats.wire_bytes - since_bytes) / max(steps, 1),
            "cgx/ratio": float(stats.ratio)}


# -- Trainer -------------------------------------------------------------------------------

def checkpoint_file(checkpoint_dir: str, rank: int) -> str:
    """The file a rank's cgx state is saved to inside a Trainer checkpoint folder.

    Args:
        checkpoint_dir: a Trainer checkpoint folder (``.../checkpoint-{step}``).
        rank: the global rank (the Trainer's ``args.process_index``).

    Returns:
        ``{checkpoint_dir}/cgx-rank{rank}.pt``.
    """
    return os.path.join(checkpoint_dir, CHECKPOINT_FILE.format(rank=rank))


class _TrainerLogic:
    """The callback's behaviour; :data:`CGXTrainerCallback` mixes it into
    ``transformers.TrainerCallback`` (so that this module imports without transformers).

    Args:
        compression: how gradients travel, as ``cgx.torch.CGXState``'s ``compression``
            (``Compression.quantize(bits=4)``, ``Compression.exact``, ``"auto"``; None:
            the ``CGX_*`` variables).
        config: a ``cgx.torch.Config`` (None: ``Config.from_env()``).
        rules: per-layer rules (dict, list or YAML path; see ``cgx.rules``).
        error_feedback: override the residuals' setting (see ``CGXState``).
        gradient_as_bucket_view: build the Trainer's DDP with
            ``gradient_as_bucket_view=True`` (the default; see :func:`keep_bucket_views`).
            A callback given in ``Trainer(callbacks=...)`` does it when the Trainer's
            construction ends; False keeps DDP's own default.
        trainer: the Trainer to serve (set by :func:`compress`); None: the Trainer that
            calls the callback, found when training begins.

    Attributes:
        state: the rank's ``CGXState`` once training has begun (None before, and on one
            process).
    """

    def __init__(self, compression=None, *, config=None, rules=None, error_feedback=None,
                 gradient_as_bucket_view: bool = True, trainer=None):
        self.compression = compression
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.config = config
        self.rules = rules
        self.error_feedback = error_feedback
        self.trainer = trainer
        # -- runtime --
        self.state: Optional[CGXState] = None
        self._ddp: Optional[DDP] = None  # the module the hook is on (a 2nd train() reuses it)
        self._logged = (0, 0)  # (global step, wire bytes) at the last log
        self._said_single = False

    # The Trainer calls on_init_end at the end of its construction: its Accelerator exists,
    # the model is not wrapped yet.
    def on_init_end(self, args, state, control, **kwargs):
        if self.gradient_as_bucket_view:
            trainer = self.trainer or _find_trainer(self)
            if trainer is not None:
                keep_bucket_views(trainer)

    # The Trainer calls on_train_begin after accelerator.prepare and model.zero_grad(),
    # before the first forward: the moment the DDP module exists and has not reduced yet.
    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self.trainer or _calling_trainer(self)
        _check_trainer(trainer)
        if _world_size() <= 1:
            if not self._said_single:
                logger.warning("cgx: training on one process, nothing to exchange; cgx is "
                               "off for this run")
                self._said_single = True
            return
        model = trainer.model_wrapped
        _check_wrapped(model, "CGXTrainerCallback")
        if model is not self._ddp:
            self.state = _register(model, self.compression, self.config, self.rules,
                                   self.error_feedback, None)
            self._ddp = model
        if state.global_step > 0:
            self._load(trainer, args, state)
        self._logged = (state.global_step, self.state.stats().wire_bytes)

    def on_save(self, args, state, control, **kwargs):
        if self.state is None:
            return
        folder = os.path.join(_run_dir(self.trainer, args), f"checkpoint-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        torch.save({"format": CHECKPOINT_FORMAT, "rank": args.process_index,
                    "world_size": args.world_size, "cgx": self.state.state_dict()},
                   checkpoint_file(folder, args.process_index))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.state is None or logs is None:
            return
        step0, bytes0 = self._logged
        if state.global_step <= step0:  # an evaluation's or the summary's log: no new steps
            return
        figures = _figures(self.state, bytes0, state.global_step - step0)
        self._logged = (state.global_step, self.state.stats().wire_bytes)
        logs.update(figures)
        # Trainer.log appended a copy of `logs` to the history before calling on_log
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(figures)

    def _load(self, trainer, args, state) -> None:
        """Restore this rank's state from the checkpoint the Trainer resumed from."""
        folder = _resumed_from(self) or os.path.join(_run_dir(trainer, args),
                                                     f"checkpoint-{state.global_step}")
        path = checkpoint_file(folder, args.process_index)
        if not os.path.isfile(path):
            warnings.warn(f"cgx: resuming at step {state.global_step} without {path}: the "
                          "checkpoint was saved without cgx (or by other ranks); "
                          "error-feedback residuals start from zero, so the run does not "
                          "continue exactly", RuntimeWarning, stacklevel=2)
            return
        saved = torch.load(path, map_location=_device_of(trainer.model_wrapped),
                           weights_only=False)
        if saved.get("world_size") != args.world_size:
            raise ValueError(f"{path} was saved by a run on {saved.get('world_size')} "
                             f"processes, this one has {args.world_size}: cgx's residuals are "
                             "per rank; resume on the same number of processes")
        self.state.load_state_dict(saved["cgx"])


def keep_bucket_views(trainer) -> None:
    """Have the DDP module ``trainer`` is about to build keep its gradients as views of its
    buckets (``gradient_as_bucket_view=True`` in the Accelerator's DDP arguments): cgx's
    hook reduces each bucket in place, so DDP then copies no bucket back into the gradients
    (a copy of every gradient per step saved). Call it before ``train()``; a Trainer whose
    Accelerator has no DDP arguments is left as it is."""
    handler = getattr(getattr(trainer, "accelerator", None), "ddp_handler", None)
    if handler is not None and hasattr(handler, "gradient_as_bucket_view"):
        handler.gradient_as_bucket_view = True


def _check_trainer(trainer) -> None:
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise RuntimeError("CGXTrainerCallback: the Trainer runs DeepSpeed, which cgx does not "
                           "support; drop the `deepspeed` training argument to train with DDP")
    if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_fsdp_xla_enabled",
                                                                False):
        raise RuntimeError("CGXTrainerCallback: the Trainer runs FSDP, which cgx does not "
                           "support through the Trainer (FSDP1 not at all, FSDP2 not yet); "
                           "drop the `fsdp` training arguments to train with DDP")


def _run_dir(trainer, args) -> str:
    # Trainer._save_checkpoint writes under _get_output_dir(trial) (a hyper-parameter
    # search's run folder), which is args.output_dir otherwise.
    if trainer is not None and getattr(trainer, "hp_search_backend", None) is None:
        return args.output_dir
    try:
        return trainer._get_output_dir(trial=None)
    except Exception:  # noqa: BLE001 - a private method; output_dir is the documented place
        return args.output_dir


def _trainer_frames(callback):
    """The frames on the stack whose ``self`` is a Trainer that holds ``callback``."""
    transformers = _transformers()
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, transformers.Trainer) and \
                callback in owner.callback_handler.callbacks:
            yield frame, owner
        frame = frame.f_back


def _find_trainer(callback):
    """The Trainer calling ``callback``, or None."""
    return next((trainer for _, trainer in _trainer_frames(callback)), None)


def _calling_trainer(callback):
    """The Trainer calling ``callback`` (a callback is handed the unwrapped model only)."""
    trainer = _find_trainer(callback)
    if trainer is not None:
        callback.trainer = trainer  # for on_save's folder and later calls
        return trainer
    raise RuntimeError("CGXTrainerCallback could not find the Trainer that calls it; attach "
                       "it with cgx.integrations.huggingface.compress(trainer, ...) instead")


def _resumed_from(callback) -> Optional[str]:
    """The checkpoint folder ``Trainer.train`` resumes from (the ``resume_from_checkpoint``
    of its ``_inner_training_loop``, which may lie outside ``output_dir``)."""
    for frame, _ in _trainer_frames(callback):
        path = frame.f_locals.get("resume_from_checkpoint")
        if isinstance(path, (str, os.PathLike)):
            return os.fspath(path)
    return None


@functools.cache
def _callback_class():
    transformers = _transformers()

    class CGXTrainerCallback(_TrainerLogic, transformers.TrainerCallback):
        __doc__ = _TrainerLogic.__doc__.replace(
            ":data:`CGXTrainerCallback` mixes it into\n    ``transformers.TrainerCallback`` "
            "(so that this module imports without transformers)",
            "a ``transformers.TrainerCallback``") + """
    Example::

        trainer = Trainer(model=model, args=args, train_dataset=data,
                          callbacks=[CGXTrainerCallback(Compression.quantize(bits=4))])
    """

    CGXTrainerCallback.__module__ = __name__
    CGXTrainerCallback.__qualname__ = "CGXTrainerCallback"
    return CGXTrainerCallback


def __getattr__(name: str):
    # CGXTrainerCallback subclasses transformers.TrainerCallback: made on first use, so that
    # importing this module (for prepare) needs no transformers.
    if name == "CGXTrainerCallback":
        return _callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def compress(trainer, compression=None, *, config=None, rules=None, error_feedback=None,
             gradient_as_bucket_view: bool = True):
    """Put cgx on the DDP model a ``transformers.Trainer`` builds: call before ``train()``.

    Adds a ``CGXTrainerCallback`` bound to ``trainer`` as its first callback (so that the
    loggers of ``report_to`` see cgx's figures), and (unless ``gradient_as_bucket_view``
    is False) has the Trainer's DDP keep gradients as views of its buckets
    (:func:`keep_bucket_views`). Every rank calls it.

    Args:
        trainer: the ``transformers.Trainer``.
        compression: as ``cgx.torch.CGXState``'s (``Compression.quantize(bits=4)``,
            ``Compression.exact``, ``"auto"``; None: the ``CGX_*`` variables).
        config: a ``cgx.torch.Config`` (None: ``Config.from_env()``).
        rules: per-layer rules (see ``cgx.rules``).
        error_feedback: override the residuals' setting (see ``CGXState``).
        gradient_as_bucket_view: False keeps DDP's own default (gradients copied from
            DDP's buckets after every exchange).

    Returns:
        The callback; its ``state`` is the rank's ``CGXState`` once training has begun.

    Raises:
        TypeError: ``trainer`` is not a ``transformers.Trainer``.
        RuntimeError: (when training begins) DeepSpeed, FSDP, or no DDP on several processes.

    Example::

        trainer = Trainer(model=model, args=args, train_dataset=data)
        compress(trainer, compression=Compression.quantize(bits=4))
        trainer.train()
    """
    transformers = _transformers()
    if not isinstance(trainer, transformers.Trainer):
        raise TypeError(f"compress(trainer) takes a transformers.Trainer, got "
                        f"{type(trainer).__name__}; for Accelerate use prepare(accelerator, "
                        "model)")
    _check_trainer(trainer)  # DeepSpeed and FSDP are known at construction: fail now
    callback = _callback_class()(compression, config=config, rules=rules,
                                 error_feedback=error_feedback,
                                 gradient_as_bucket_view=gradient_as_bucket_view, trainer=trainer)
    trainer.callback_handler.callbacks.insert(0, callback)
    if gradient_as_bucket_view:
        keep_bucket_views(trainer)
    return callback


# -- Accelerate ----------------------------------------------------------------------------

class RankStates:
    """Every rank's cgx state as one checkpoint object, for ``accelerator.save_state``.

    Accelerate saves a registered object's ``state_dict()`` from the main process only
    (one ``custom_checkpoint_{i}.pkl``), and every process loads that file. So
    ``state_dict()`` gathers all ranks' states (a collective: every process calls
    ``save_state``, as Accelerate asks), and ``load_state_dict`` restores this rank's.

    Args:
        state: this rank's ``CGXState``.
        device: where restored tensors go (the model's device).
    """

    def __init__(self, state: CGXState, device: torch.device):
        self.state = state
        self.device = device

    def state_dict(self) -> dict:
        mine = _tensors_to(self.state.state_dict(), "cpu")  # pickles to any rank
        ranks: list = [None] * _world_size()
        dist.all_gather_object(ranks, mine)
        return {"format": CHECKPOINT_FORMAT, "world_size": len(ranks), "ranks": ranks}

    def load_state_dict(self, saved: dict) -> None:
        if saved.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"not a cgx RankStates checkpoint (format {saved.get('format')}, "
                             f"expected {CHECKPOINT_FORMAT})")
        if saved["world_size"] != _world_size():
            raise ValueError(f"the cgx state was saved on {saved['world_size']} processes, this "
                             f"run has {_world_size()}: cgx's residuals are per rank; load it on "
                             "the same number of processes")
        self.state.load_state_dict(_tensors_to(saved["ranks"][_rank()], self.device))

    # CGXState's figures, so the returned object serves for logging too
    def stats(self):
        return self.state.stats()


def prepare(accelerator, model: torch.nn.Module, compression=None, *, config=None, rules=None,
            error_feedback=None, optimizer=None) -> Optional[RankStates]:
    """Register cgx's DDP hook on a model ``accelerator.prepare`` returned, and its state
    for ``accelerator.save_state`` / ``load_state``.

    Call on every process, after ``accelerator.prepare`` and before the first backward.

    Args:
        accelerator: the ``accelerate.Accelerator``.
        model: the prepared model (``accelerator.prepare(model)``'s DDP module).
        compression: as ``cgx.torch.CGXState``'s (``Compression.quantize(bits=4)``,
            ``Compression.exact``, ``"auto"``; None: the ``CGX_*`` variables).
        config: a ``cgx.torch.Config`` (None: ``Config.from_env()``).
        rules: per-layer rules (see ``cgx.rules``).
        error_feedback: override the residuals' setting (see ``CGXState``).
        optimizer: the optimizer (``"auto"`` only: decides error feedback, see CGXState).

    Returns:
        A :class:`RankStates` (``.state`` is the rank's ``CGXState``, ``.stats()`` its
        figures), registered with ``accelerator.register_for_checkpointing``; None on one
        process (nothing to exchange: cgx stays off, with one message).

    Raises:
        TypeError: ``accelerator`` is not an ``accelerate.Accelerator``.
        RuntimeError: DeepSpeed, FSDP, or a model not wrapped in DDP.

    Example::

        model, opt, data = accelerator.prepare(model, opt, data)
        cgx_state = prepare(accelerator, model, compression=Compression.quantize(bits=4))
    """
    accelerate = _accelerate()
    if not isinstance(accelerator, accelerate.Accelerator):
        raise TypeError(f"prepare(accelerator, model) takes an accelerate.Accelerator, got "
                        f"{type(accelerator).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"prepare(accelerator, model) takes the prepared model, got "
                        f"{type(model).__name__}")
    kind = accelerate.DistributedType
    if accelerator.distributed_type == kind.DEEPSPEED:
        raise RuntimeError("cgx.integrations.huggingface.prepare: the Accelerator runs "
                           "DeepSpeed, which cgx does not support; launch without the "
                           "DeepSpeed plugin to train with DDP")
    if accelerator.distributed_type == kind.FSDP:
        raise RuntimeError("cgx.integrations.huggingface.prepare: the Accelerator runs FSDP, "
                           "which cgx does not support through Accelerate (FSDP1 not at all, "
                           "FSDP2 not yet); launch without the FSDP plugin to train with DDP")
    if accelerator.num_processes <= 1:
        logger.warning("cgx: training on one process, nothing to exchange; cgx is off for "
                       "this run")
        return None
    _check_wrapped(model, "cgx.integrations.huggingface.prepare",
                   unwrapped="it takes the model that accelerator.prepare returned (a DDP "
                   "module): call model = accelerator.prepare(model) first and pass its "
                   "result")
    state = _register(model, compression, config, rules, error_feedback, optimizer)
    states = RankStates(state, _device_of(model))
    accelerator.register_for_checkpointing(states)
    return states


def log_figures(states: Any, since_bytes: int = 0, steps: int = 1) -> dict:
    """cgx's figures for a logger (``accelerator.log``): ``cgx/bytes_per_step`` this rank
    sent per step over the last ``steps`` steps, ``cgx/ratio``.

    Args:
        states: :func:`prepare`'s result (or a ``CGXState``).
        since_bytes: ``stats().wire_bytes`` at the start of those steps.
        steps: how many optimizer steps since then.

    Returns:
        ``{"cgx/bytes_per_step": float, "cgx/ratio": float}``.
    """
    return _figures(states, since_bytes, steps)
