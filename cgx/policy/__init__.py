"""How a ``compression=`` setting becomes what travels, decided in one place.

:func:`resolve` takes whatever a user passed (a compressor, a Horovod-style class, a
string, ``Compression.auto(...)``, ``Compression.planned(...)``, the default) with the
configuration and the optimizer's update rule, and returns one frozen
:class:`ExchangePolicy`: the mode, the compressor, error feedback, warm-up, rotation.
Every adapter (the torch and Keras optimizers, the tape, the DDP hook, FSDP2, DiLoCo)
resolves once and hands the policy on; nothing downstream asks what type a compressor is.
"""

from cgx.policy.resolve import ExchangePolicy, GradMode, resolve

__all__ = ["ExchangePolicy", "GradMode", "resolve"]
