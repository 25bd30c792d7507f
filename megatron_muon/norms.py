"""A plain-torch LayerNorm / RMSNorm for Megatron layer specs that works with sequence parallelism.

Megatron-core's ``WrappedTorchNorm`` (the norm of its local, transformer-engine-free spec)
refuses ``sequence_parallel=True``; the fused norms that accept it need Apex or
transformer-engine. Sequence parallelism only asks one thing of a norm: each TP rank
sees a different slice of the sequence, so the norm's weight gradients are partial and
must be summed over the TP group. Megatron does that for every parameter marked
``sequence_parallel=True`` (in ``finalize_model_grads``). This norm is the torch one
with that mark, so MoE + TP (which requires sequence parallelism) runs without a GPU.
"""

from __future__ import annotations

import torch


class SequenceParallelNorm:
    """Drop-in for ``WrappedTorchNorm`` in a layer spec, with sequence-parallel support."""

    def __new__(
        cls,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        kind = getattr(config, "normalization", normalization)
        if kind == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif kind == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"SequenceParallelNorm supports LayerNorm and RMSNorm, not {kind!r}")
        if getattr(config, "params_dtype", None) is not None:
            norm.to(config.params_dtype)
        for param in norm.parameters():
            param.sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        return norm


def use_sequence_parallel_norms(spec) -> None:
    """Replace every ``WrappedTorchNorm`` in a (nested) ModuleSpec by ``SequenceParallelNorm``."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    seen = set()

    def visit(obj) -> None:
        if id(obj) in seen or obj is None:
            return
        seen.add(id(obj))
        if isinstance(obj, ModuleSpec):
            visit(obj.submodules)
            return
        fields = vars(obj) if hasattr(obj, "__dict__") else {}
        for name, value in fields.items():
            if value is WrappedTorchNorm:
                setattr(obj, name, SequenceParallelNorm)
            elif isinstance(value, ModuleSpec):
                if value.module is WrappedTorchNorm:
                    value.module = SequenceParallelNorm
                visit(value)
            elif hasattr(value, "__dict__") and not isinstance(value, type):
                visit(value)

    visit(spec)
