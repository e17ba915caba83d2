"""cgx in torchft's fault-tolerant training: its DDP wrapper with cgx's compressed
exchange over each step's quorum (:mod:`cgx.integrations.torchft.ddp`), and the
transport over torchft's reconfigurable process groups
(:mod:`cgx.integrations.torchft.transport`). torchft is imported only when used."""

from cgx.integrations.torchft.ddp import DistributedDataParallel, TorchftState
from cgx.integrations.torchft.transport import TorchftTransport

__all__ = ["DistributedDataParallel", "TorchftState", "TorchftTransport"]
