"""GPT layer and block specs with the pieces Muon / QK-Clip need, on any backend.

* Without transformer-engine: Megatron's local spec, with ``RecordingDotProductAttention``
  as core attention (records per-head max logits; accepts MLA's k/v channel sizes),
  ``SequenceParallelNorm`` as norm (so TP + sequence parallelism, which MoE requires,
  runs without Apex or TE) and, for multi-latent attention, ``TensorParallelMLASelfAttention``
  (Megatron's ``MLASelfAttention`` computes wrong gradients at TP > 1 in this spec: see
  that class).
* With transformer-engine installed (``use_te=True``): Megatron's TE spec unchanged; TE's
  attention records max logits itself when ``config.qk_clip`` is set.

``gpt_block_spec`` wraps a layer spec into a block spec for the layers of one pipeline
stage, with the same sequence-parallel-capable final norm; ``gpt_mtp_block_spec`` builds
the multi-token-prediction layers (DeepSeek-V3's MTP) from the same layer spec.
"""

from __future__ import annotations

from typing import Optional

from .attention import RecordingDotProductAttention, TensorParallelMLASelfAttention
from .norms import SequenceParallelNorm, use_sequence_parallel_norms


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def gpt_layer_spec(
    num_experts: Optional[int] = None,
    moe_grouped_gemm: bool = False,
    qk_layernorm: bool = False,
    multi_latent_attention: bool = False,
    normalization: str = "RMSNorm",
    use_te: Optional[bool] = None,
):
    """A transformer-layer ``ModuleSpec`` for dense, MoE and MLA GPT models."""
    use_te = transformer_engine_available() if use_te is None else use_te
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts,
            moe_grouped_gemm=moe_grouped_gemm,
            qk_layernorm=qk_layernorm,
            multi_latent_attention=multi_latent_attention,
        )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        num_experts=num_experts,
        moe_grouped_gemm=moe_grouped_gemm,
        qk_layernorm=qk_layernorm,
        multi_latent_attention=multi_latent_attention,
        normalization=normalization,
    )
    spec.submodules.self_attention.submodules.core_attention = RecordingDotProductAttention
    use_tensor_parallel_mla(spec)
    use_sequence_parallel_norms(spec)
    return spec


def use_tensor_parallel_mla(spec) -> None:
    """Swap Megatron's ``MLASelfAttention`` for ``TensorParallelMLASelfAttention`` in a layer
    spec or in every layer of a block spec (local specs; TE's attention is left alone).

    Megatron's MLASelfAttention with ColumnParallelLinear down projections (the only ones it
    accepts without TE) never reduces the shared rope key's gradient over TP ranks, and
    (without sequence parallelism) gets q_layernorm's gradient summed over TP twice. Same
    modules and parameters, the TP gradient reductions corrected; a no-op at TP = 1.
    """
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    layers = getattr(spec, "layer_specs", None)
    for layer in layers if layers is not None else [spec]:
        attention = layer.submodules.self_attention
        if attention.module is MLASelfAttention:
            attention.module = TensorParallelMLASelfAttention


def gpt_block_spec(config, layer_spec, vp_stage: Optional[int] = None):
    """Block spec for this pipeline stage's layers (final norm supports sequence parallelism)."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    experts, ep = getattr(config, "num_moe_experts", None), getattr(config, "expert_model_parallel_size", 1)
    if experts and experts % ep:
        # Megatron's MoELayer asserts this with an empty message, once half the model is built.
        raise ValueError(
            f"num_moe_experts={experts} is not divisible by expert_model_parallel_size={ep}; "
            f"use a multiple of {ep} experts or an expert-parallel size that divides {experts}."
        )
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    norm = SequenceParallelNorm if not transformer_engine_available() else None
    if norm is None:
        from megatron.core.transformer.transformer_block import LayerNormImpl

        norm = LayerNormImpl
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * num_layers, layer_norm=norm)


def gpt_mtp_block_spec(config, layer_spec, use_te: bool = False, vp_stage: Optional[int] = None):
    """Megatron's multi-token-prediction block spec (``config.mtp_num_layers`` layers, on the
    stage that holds them; None elsewhere or without MTP) whose transformer layer is
    ``layer_spec`` (so our attention and MLA there too) and, on the local backend, whose own
    norms (``enorm``, ``hnorm``, the final one) support sequence parallelism."""
    if not getattr(config, "mtp_num_layers", None):
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    spec = get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=use_te, vp_stage=vp_stage)
    if spec is not None and not use_te:
        for layer in spec.layer_specs:
            use_sequence_parallel_norms(layer)
    return spec
