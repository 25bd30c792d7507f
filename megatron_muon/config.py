"""``MuonConfig``: Megatron's ``OptimizerConfig`` plus the settings of exact distributed Muon.

Field names follow Megatron-core where it has one (``muon_momentum``, ``muon_tp_mode``, ...);
the defaults are ours where we differ on purpose (exact TP mode, Moonlight update scale,
Nesterov on). QK-Clip settings are read from the model's ``TransformerConfig``
(``qk_clip``, ``qk_clip_threshold``, ``qk_clip_alpha``), as in Megatron.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Tuple

import torch
from megatron.core.optimizer import OptimizerConfig

TP_MODES = ("exact", "blockwise", "duplicated")
NS_METHODS = ("standard", "gram", "auto")
SCALE_MODES = ("moonlight", "spectral", "shape_scaling", "unit_rms_norm", "none")
QKV_SPLITS = ("part", "group", "head")
MLA_SPLITS = ("none", "part", "head")
SCALAR_OPTIMIZERS = ("adam",)
ROUTER_OPTIMIZERS = ("adam", "muon")


@dataclass
class MuonConfig(OptimizerConfig):
    """Configuration of :func:`megatron_muon.get_muon_optimizer`.

    Inherits every field of Megatron's ``OptimizerConfig`` (``lr``, ``weight_decay``,
    ``clip_grad``, ``bf16``/``fp16``, loss scaling, ``adam_*`` for the scalar parameters...).
    """

    optimizer: str = "muon"

    # --- the Muon update -------------------------------------------------------------
    muon_momentum: float = 0.95
    """Momentum coefficient mu of ``buf = mu * buf + grad``."""

    muon_nesterov: bool = True
    """Orthogonalize ``grad + mu * buf`` (Nesterov) instead of ``buf``."""

    muon_num_ns_steps: int = 5
    """Newton–Schulz iterations."""

    muon_coefficient_type: str = "quintic"
    """Newton–Schulz coefficients: 'quintic' (Keller Jordan's 3.4445, -4.7750, 2.0315 at
    every step; Megatron calls this set 'simple'), 'polar_express' (Amsel et al. 2025,
    one polynomial per step), 'megatron_quintic' (the per-step schedule Megatron-core
    calls 'quintic'), 'deepseek_v4' (DeepSeek-V4's hybrid: 8 quintic steps, then 2 of
    (2, -1.5, 0.5); use 10 steps), 'cans' (Grishina et al. 2025, Chebyshev-type) or
    'aol' (Turbo-Muon's set; 4 steps). Past the end of a schedule its last triple
    repeats. See ``megatron_muon.newton_schulz.COEFFICIENT_SETS``."""

    muon_scale_mode: str = "moonlight"
    """Update scale from the logical matrix's full shape (m, n): 'moonlight' =
    0.2*sqrt(max(m, n)) (matches AdamW's update RMS, so AdamW learning rates carry over),
    'spectral' = sqrt(max(m, n)), 'shape_scaling' = sqrt(max(1, m/n)) (Keller Jordan),
    'unit_rms_norm' = sqrt(m/n), 'none' = 1."""

    muon_extra_scale_factor: float = 1.0
    """Multiplies the update scale."""

    muon_ns_dtype: torch.dtype = torch.bfloat16
    """Compute dtype of Newton–Schulz (bf16 by default; fp32 for exactness checks)."""

    muon_ns_method: str = "standard"
    """Newton–Schulz iteration: 'standard' (on the matrix X), 'gram' (on the small Gram
    matrix X X^T, restarted midway; fewer FLOPs for wide matrices; with a 16-bit
    ``muon_ns_dtype`` it computes in fp16, whose range its bounded values fit and whose
    precision keeps it as close to fp32 as bf16 standard NS) or 'auto' (Gram for
    matrices with aspect ratio >= ``newton_schulz.GRAM_MIN_ASPECT``, standard
    otherwise). See ``megatron_muon.newton_schulz``."""

    muon_use_torch_compile: bool = False
    """Run the Newton–Schulz kernel through ``torch.compile`` (compiled on first use per
    shape; pays off on GPUs, see docs/benchmarks.md)."""

    # --- distribution -------------------------------------------------------------------
    muon_tp_mode: str = "exact"
    """'exact': each logical matrix is gathered whole (across its data- and tensor-parallel
    pieces), orthogonalized once on one rank, and scattered back. 'blockwise': each
    tensor-parallel shard is orthogonalized on its own (Megatron's default, an
    approximation). 'duplicated': every tensor-parallel rank orthogonalizes the whole
    matrix for itself (exact, TP-times the work)."""

    muon_split_ns_max_ranks: int = 8
    """Split Newton–Schulz: a matrix whose NS cost alone exceeds a rank's mean load is
    orthogonalized by an aligned block of up to this many ranks (a power of two; keep it
    within a node), its columns split and its Gram matrix all-reduced each step
    (``megatron_muon.split_newton_schulz``). 1 turns splitting off."""

    muon_comm_dtype: torch.dtype = torch.bfloat16
    """Dtype of the momentum and update pieces on the wire."""

    muon_chunk_numel: int = 64 * 1024 * 1024
    """Approximate number of matrix elements per pipeline chunk (summed over ranks)."""

    muon_max_inflight_chunks: int = 2
    """How many chunks' gathers may be in flight while one chunk computes."""

    muon_overlap_expert_ns: bool = True
    """Run the expert-parallel parameters' step (stacked per-expert Newton–Schulz) while the
    dense pipeline's first gather is in flight."""

    # --- which parameters are Muon matrices -------------------------------------------------
    muon_split_qkv: bool = True
    """Orthogonalize a fused ``linear_qkv`` as separate Q, K and V matrices."""

    muon_qkv_split: str = "part"
    """Granularity of the QKV split: 'part' (one Q, one K, one V matrix across all heads,
    as Megatron-core and Moonlight do), 'group' (Q, K, V of each query group), 'head'
    (each query head and each K/V head on its own)."""

    muon_split_mla: str = "part"
    """Split of multi-latent-attention up-projections: 'none' (each weight whole), 'part'
    (q nope / q rope of all heads; k nope / v of all heads), 'head' (each of those per
    head)."""

    muon_split_glu: bool = False
    """Orthogonalize the gate and up halves of a gated ``linear_fc1`` separately."""

    muon_router_optimizer: str = "adam"
    """Optimizer of the MoE router weight: 'adam' (default) or 'muon'."""

    muon_scalar_optimizer: str = "adam"
    """Optimizer of the non-matrix parameters (embeddings, output layer, norms, biases)."""

    muon_exclude_patterns: Tuple[str, ...] = ()
    """``fnmatch`` patterns of parameter names that go to the scalar optimizer although
    they are matrices (e.g. ``('*.linear_proj.weight',)``)."""

    muon_param_filter: Optional[Callable[[str, torch.nn.Parameter], bool]] = field(
        default=None, compare=False
    )
    """Optional predicate ``(name, param) -> bool`` that overrides the default choice of
    Muon matrices entirely."""

    def __post_init__(self) -> None:
        super().__post_init__()
        checks = [
            ("muon_tp_mode", self.muon_tp_mode, TP_MODES),
            ("muon_ns_method", self.muon_ns_method, NS_METHODS),
            ("muon_scale_mode", self.muon_scale_mode, SCALE_MODES),
            ("muon_qkv_split", self.muon_qkv_split, QKV_SPLITS),
            ("muon_split_mla", self.muon_split_mla, MLA_SPLITS),
            ("muon_scalar_optimizer", self.muon_scalar_optimizer, SCALAR_OPTIMIZERS),
            ("muon_router_optimizer", self.muon_router_optimizer, ROUTER_OPTIMIZERS),
        ]
        for name, value, allowed in checks:
            if value not in allowed:
                raise ValueError(f"MuonConfig.{name}={value!r} is not supported; use one of {allowed}.")
        from .newton_schulz import COEFFICIENT_SETS

        if self.muon_coefficient_type not in COEFFICIENT_SETS:
            raise ValueError(
                f"MuonConfig.muon_coefficient_type={self.muon_coefficient_type!r} is unknown; "
                f"use one of {tuple(COEFFICIENT_SETS)}."
            )
        if self.muon_num_ns_steps < 1:
            raise ValueError(f"MuonConfig.muon_num_ns_steps must be >= 1, got {self.muon_num_ns_steps}.")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ValueError(f"MuonConfig.muon_momentum must be in [0, 1), got {self.muon_momentum}.")
        if self.muon_split_ns_max_ranks < 1 or self.muon_split_ns_max_ranks & (self.muon_split_ns_max_ranks - 1):
            raise ValueError(
                f"MuonConfig.muon_split_ns_max_ranks must be a power of two >= 1 (1 = no split), "
                f"got {self.muon_split_ns_max_ranks}."
            )
        if self.muon_max_inflight_chunks < 1:
            raise ValueError("MuonConfig.muon_max_inflight_chunks must be >= 1.")
        if self.muon_ns_dtype not in (torch.bfloat16, torch.float32, torch.float16):
            raise ValueError(
                f"MuonConfig.muon_ns_dtype={self.muon_ns_dtype} is not supported; "
                "use torch.bfloat16 or torch.float32."
            )
        if self.muon_comm_dtype not in (torch.bfloat16, torch.float32, torch.float16):
            raise ValueError(
                f"MuonConfig.muon_comm_dtype={self.muon_comm_dtype} is not supported; "
                "use torch.bfloat16 or torch.float32."
            )


def update_scale(config: MuonConfig, rows: int, cols: int) -> float:
    """The factor that multiplies the orthogonalized update of an ``rows x cols`` matrix.

    ``rows, cols`` are the logical matrix's output and input sizes (full, across tensor
    parallelism; per expert; per Q/K/V part).
    """
    mode = config.muon_scale_mode
    if mode == "moonlight":
        scale = 0.2 * max(rows, cols) ** 0.5
    elif mode == "spectral":
        scale = max(rows, cols) ** 0.5
    elif mode == "shape_scaling":
        scale = max(1.0, rows / cols) ** 0.5
    elif mode == "unit_rms_norm":
        scale = (rows / cols) ** 0.5
    else:
        scale = 1.0
    return scale * config.muon_extra_scale_factor
