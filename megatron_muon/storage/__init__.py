"""One storage backend per data-parallel engine (``backend.py`` says what one does):
Megatron's DDP buffers with the distributed optimizer, and Megatron-FSDP.

:func:`storage_for` chooses the backend of a model's chunks, once, when
``get_muon_optimizer`` builds the optimizer; nothing else asks which engine runs.
"""

from __future__ import annotations

from typing import Sequence, Type

import torch

from .backend import StorageBackend
from .distributed_optimizer import DistributedOptimizerStorage
from .megatron_fsdp import MegatronFSDPStorage

ENGINES: Sequence[Type[StorageBackend]] = (MegatronFSDPStorage, DistributedOptimizerStorage)
"""Asked in this order which wrapped a chunk; the last is the default (its ``check`` names
the wrapping it needs)."""


def storage_for(model_chunks: Sequence[torch.nn.Module]) -> Type[StorageBackend]:
    """The backend of ``model_chunks``' engine (every chunk wrapped by the same one)."""
    engines = {next((e for e in ENGINES if e.wraps(chunk)), ENGINES[-1]) for chunk in model_chunks}
    if len(engines) > 1:
        names = " and ".join(sorted(e.__name__ for e in engines))
        raise ValueError(
            f"get_muon_optimizer: the model chunks are wrapped by different data-parallel engines ({names}); "
            "wrap every chunk the same way (all in Megatron-FSDP or all in DistributedDataParallel)."
        )
    return engines.pop()
