"""megatron-muon: exact, distributed Muon (and MuonClip) for Megatron-core.

    from megatron_muon import MuonConfig, get_muon_optimizer
    optimizer = get_muon_optimizer(MuonConfig(lr=..., bf16=True), ddp_model_chunks)

Importing the package has no side effects (the CPU/gloo patches of
``megatron_muon.cpu`` are applied only when asked for).
"""

from .buffer_layout import MuonParamLayout, muon_param_layout
from .chained_optimizer import MuonChainedOptimizer
from .config import MuonConfig, update_scale
from .factory import get_muon_optimizer
from .matrices import Block, LogicalMatrix, register_layout
from .optimizer import MuonDistributedOptimizer

__all__ = [
    "Block",
    "LogicalMatrix",
    "MuonChainedOptimizer",
    "MuonConfig",
    "MuonDistributedOptimizer",
    "MuonParamLayout",
    "get_muon_optimizer",
    "muon_param_layout",
    "register_layout",
    "update_scale",
]
__version__ = "0.1.0"
