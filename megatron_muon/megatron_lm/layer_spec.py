"""The layer spec of Megatron-LM's ``GPTModelConfig`` (what ``tools/pretrain_gpt.py`` builds),
with the modules Muon and QK-Clip need on the local (transformer-engine-free) backend."""

from __future__ import annotations

from typing import Optional

from megatron_muon.attention import RecordingDotProductAttention
from megatron_muon.layer_specs import use_sequence_parallel_norms, use_tensor_parallel_mla


def megatron_lm_layer_spec(config, vp_stage: Optional[int] = None):
    """The layer (or block) spec for Megatron-LM's ``GPTModelConfig.transformer_layer_spec``.

    With transformer-engine: Megatron-LM's own choice, unchanged (TE's attention records the
    max logits QK-Clip needs). Local: Megatron-LM's choice with megatron_muon's modules
    swapped in: the recording core attention (MLA head sizes, QK-Clip), TP-correct MLA and,
    with sequence parallelism, norms that support it (a block spec, so the final norm too).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.training.models.gpt import default_layer_spec

    transformer = config.transformer
    if transformer.transformer_impl != "local":
        return default_layer_spec(config, vp_stage)
    sequence_parallel = transformer.sequence_parallel
    if sequence_parallel and transformer.num_moe_experts is None:
        spec = get_gpt_decoder_block_spec(
            transformer, use_transformer_engine=False, normalization=transformer.normalization, vp_stage=vp_stage
        )
    else:
        spec = default_layer_spec(config, vp_stage)
    layers = getattr(spec, "layer_specs", None) or [spec]
    for layer in layers:
        layer.submodules.self_attention.submodules.core_attention = RecordingDotProductAttention
    use_tensor_parallel_mla(spec)
    if sequence_parallel:
        use_sequence_parallel_norms(spec)
        for layer in layers:
            use_sequence_parallel_norms(layer)
    return spec


def gpt_model_config(args):
    """Megatron-LM's ``GPTModelConfig`` from its arguments, with :func:`megatron_lm_layer_spec`
    unless ``--spec`` names one: the model ``tools/pretrain_gpt.py`` trains (and the
    checkpoint converter rebuilds)."""
    from megatron.training.argument_utils import gpt_config_from_args

    config = gpt_config_from_args(args)
    if args.spec is None:
        config.transformer_layer_spec = megatron_lm_layer_spec
    return config
