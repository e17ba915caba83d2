"""cgx inside the trainers people use: PyTorch Lightning and Hugging Face.

Thin shells over :mod:`cgx.torch`'s DDP hook and FSDP2 path; each module imports its
trainer only when used:

* :mod:`cgx.integrations.lightning`: ``CGXCallback`` for ``lightning`` /
  ``pytorch_lightning`` 2.x.
* :mod:`cgx.integrations.huggingface`: ``CGXTrainerCallback`` for ``transformers.Trainer``,
  and ``prepare`` for ``accelerate``.
"""
