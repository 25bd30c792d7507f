"""The layer spec of Megatron-LM's ``GPTModelConfig`` (what ``tools/pretrain_gpt.py`` builds),
with the modules Muon and QK-Clip need on the local (transformer-engine-free) backend."""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from megatron_muon import patching
from megatron_muon.attention import RecordingDotProductAttention
from megatron_muon.layer_specs import use_sequence_parallel_norms, use_tensor_parallel_mla

from . import patches


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
    use_our_modules(spec, sequence_parallel)
    return spec


def use_our_modules(spec, sequence_parallel: bool) -> None:
    """Swap megatron_muon's modules into a local layer or block spec, in place: the
    recording core attention, TP-correct MLA and, with sequence parallelism, norms that
    support it."""
    layers = getattr(spec, "layer_specs", None) or [spec]
    for layer in layers:
        layer.submodules.self_attention.submodules.core_attention = RecordingDotProductAttention
    use_tensor_parallel_mla(spec)
    if sequence_parallel:
        use_sequence_parallel_norms(spec)
        for layer in layers:
            use_sequence_parallel_norms(layer)


def _with_our_mtp_layers(original: Callable, context: Any = None) -> Callable:
    """Megatron-LM's ``mtp_block_spec``, whose MTP layers get our modules when the model's
    layer spec is :func:`megatron_lm_layer_spec` on the local backend.

    Megatron-LM builds an MTP layer from its own default decoder layer spec
    (``get_gpt_decoder_layer_specs(...)[-1]``), not from the spec the model was given: on the
    local backend its ``DotProductAttention`` fails on MLA's head sizes (``k_channels``),
    records no max logits for QK-Clip, and its MLA reduces the TP gradients wrongly."""

    @functools.wraps(original)
    def mtp_block_spec(config, transformer_layer_spec, vp_stage=None):
        spec = original(config, transformer_layer_spec, vp_stage=vp_stage)
        transformer = config.transformer
        if spec is None or config.transformer_layer_spec is not megatron_lm_layer_spec:
            return spec
        if transformer.transformer_impl != "local":
            return spec
        for layer in spec.layer_specs:
            use_our_modules(layer.submodules.mtp_model_layer, transformer.sequence_parallel)
            if transformer.sequence_parallel:
                use_sequence_parallel_norms(layer)  # the MTP layer's own norms
        return spec

    return mtp_block_spec


def install_mtp_layer_spec() -> None:
    """Put ``patches.MTP_LAYERS`` (:func:`_with_our_mtp_layers` over Megatron-LM's
    ``mtp_block_spec``, which ``GPTModelBuilder.build_model`` looks up at call time) in force
    for the process; a second call is a no-op. It acts only on models built with
    :func:`megatron_lm_layer_spec`."""
    patching.install(patches.MTP_LAYERS)


def gpt_model_config(args):
    """Megatron-LM's ``GPTModelConfig`` from its arguments, with :func:`megatron_lm_layer_spec`
    unless ``--spec`` names one: the model ``tools/pretrain_gpt.py`` trains (and the
    checkpoint converter rebuilds)."""
    from megatron.training.argument_utils import gpt_config_from_args

    config = gpt_config_from_args(args)
    if args.spec is None:
        config.transformer_layer_spec = megatron_lm_layer_spec
        install_mtp_layer_spec()  # the MTP layers get the same modules
    return config
