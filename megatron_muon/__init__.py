"""megatron-muon: exact, distributed Muon (and MuonClip) for Megatron-core.

    from megatron_muon import MuonConfig, get_muon_optimizer
    optimizer = get_muon_optimizer(MuonConfig(lr=..., bf16=True), ddp_model_chunks)

Importing the package has no side effects and imports nothing heavy: each name below is
imported from its module on first use (so ``megatron_muon.megatron_lm.cpu`` can quiet
Megatron-core's import-time notices before Megatron-core is imported).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "OwnerAlignedParamLayout": "buffer_layout",
    "owner_aligned_param_layout": "buffer_layout",
    "MuonChainedOptimizer": "optimizer",
    "MuonConfig": "config",
    "update_scale": "config",
    "get_muon_optimizer": "factory",
    "Block": "matrices",
    "LogicalMatrix": "matrices",
    "register_layout": "matrices",
    "MuonDistributedOptimizer": "optimizer",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"

if TYPE_CHECKING:
    from .buffer_layout import OwnerAlignedParamLayout, owner_aligned_param_layout  # noqa: F401
    from .config import MuonConfig, update_scale  # noqa: F401
    from .factory import get_muon_optimizer  # noqa: F401
    from .matrices import Block, LogicalMatrix, register_layout  # noqa: F401
    from .optimizer import MuonChainedOptimizer, MuonDistributedOptimizer  # noqa: F401


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megatron_muon' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
