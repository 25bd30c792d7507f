"""The model: ``TransformerConfig`` from Megatron-LM arguments, ``GPTModel`` chunks, DDP.

``transformer_config`` follows Megatron-LM's ``core_transformer_config_from_args``: every
argument whose name is a field of the config class is passed through, plus the same
special cases (``--swiglu``, ``--num-experts``, ``--norm-epsilon``, ``--group-query-attention``
...). Without transformer-engine, MLA (``--multi-latent-attention``) and QK-Clip / max-logit
logging need the core attention of ``megatron_muon.attention``: the local
``DotProductAttention`` rejects MLA's head sizes and records no per-head logits.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import warnings
from typing import Any, Dict, List

import torch
import torch.nn.functional as F

from .distributed import use_cuda


def have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def transformer_impl(args: argparse.Namespace) -> str:
    if args.transformer_impl:
        return args.transformer_impl
    return "transformer_engine" if use_cuda() and have_transformer_engine() else "local"


def transformer_config(args: argparse.Namespace):
    """The Megatron ``TransformerConfig`` (``MLATransformerConfig`` for MLA) for ``args``."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    cls = MLATransformerConfig if args.multi_latent_attention else TransformerConfig
    kw: Dict[str, Any] = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    kw.update(
        num_moe_experts=args.num_experts,
        layernorm_epsilon=args.norm_epsilon,
        pipeline_dtype=args.params_dtype,
        deallocate_pipeline_outputs=True,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        transformer_impl=transformer_impl(args),
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
    )
    if args.swiglu:
        kw.update(activation_func=F.silu, gated_linear_unit=True)
    if args.rope_type is None:
        kw.pop("rope_type", None)
    elif not args.multi_latent_attention and args.rope_type != "rope":
        raise ValueError(f"--rope-type {args.rope_type} needs --multi-latent-attention")
    if args.moe_z_loss_coeff is None:
        kw.pop("moe_z_loss_coeff", None)
    if args.num_experts and not use_cuda() and args.moe_token_dispatcher_type != "allgather":
        warnings.warn(
            f"--moe-token-dispatcher-type {args.moe_token_dispatcher_type} needs NCCL; "
            "using 'allgather' on the CPU (gloo rejects the all-to-all split tensors)."
        )
        kw["moe_token_dispatcher_type"] = "allgather"
    return cls(**kw)


def core_attention_class():
    """The core-attention module of ``megatron_muon.attention`` (plain torch, MHA/GQA/MLA,
    records per-head max logits in ``current_max_attn_logits``)."""
    try:
        attention = importlib.import_module("megatron_muon.attention")
    except ImportError as exc:
        raise RuntimeError(
            "This model needs megatron_muon.attention (megatron_muon's own core attention, which "
            "handles MLA head sizes and records the per-head max attention logits QK-Clip needs), "
            f"and it could not be imported: {exc}. Multi-latent attention, and --qk-clip / "
            "--log-max-attention-logit without transformer-engine, are unavailable until it is."
        ) from exc
    for name in ("RecordingDotProductAttention", "CoreAttention"):
        cls = getattr(attention, name, None)
        if isinstance(cls, type):
            return cls
    raise RuntimeError("megatron_muon.attention defines no core-attention class (expected RecordingDotProductAttention).")


def needs_own_attention(args: argparse.Namespace) -> bool:
    """Transformer-engine's attention handles MLA and records max logits itself; the
    local implementation needs megatron_muon's for either."""
    local = transformer_impl(args) == "local"
    return local and bool(args.multi_latent_attention or args.qk_clip or args.log_max_attention_logit)


def _set_core_attention(spec: Any, cls: type) -> None:
    layer_specs = getattr(spec, "layer_specs", None)
    for layer in layer_specs if layer_specs is not None else [spec]:
        layer.submodules.self_attention.submodules.core_attention = cls


def layer_spec(args: argparse.Namespace, config, vp_stage=None):
    """The layer spec; a block spec of dense / MoE layers with ``--num-experts``, and with
    sequence parallelism on the local (torch) implementation, whose norms it replaces."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    te = config.transformer_impl == "transformer_engine"
    sp_norms = not te and config.sequence_parallel
    if args.num_experts or sp_norms:
        spec = specs.get_gpt_decoder_block_spec(
            config, use_transformer_engine=te, normalization=args.normalization, vp_stage=vp_stage
        )
    elif te:
        spec = specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=None, moe_grouped_gemm=False, qk_layernorm=args.qk_layernorm,
            multi_latent_attention=args.multi_latent_attention,
        )
    else:
        spec = specs.get_gpt_layer_local_spec(
            num_experts=None, moe_grouped_gemm=False, qk_layernorm=args.qk_layernorm,
            multi_latent_attention=args.multi_latent_attention, normalization=args.normalization,
        )
    if needs_own_attention(args):
        _set_core_attention(spec, core_attention_class())
    if not te and args.multi_latent_attention:
        # Megatron's local MLA gets TP > 1 gradients wrong (see the corrected class).
        from megatron_muon.layer_specs import use_tensor_parallel_mla

        use_tensor_parallel_mla(spec)
    if sp_norms:
        _use_sequence_parallel_norms(spec)
    return spec


def _use_sequence_parallel_norms(block_spec) -> None:
    """Megatron's local torch norms refuse sequence parallelism; use megatron_muon's."""
    from megatron_muon.norms import use_sequence_parallel_norms

    use_sequence_parallel_norms(block_spec)  # the final norm
    for layer in block_spec.layer_specs:
        use_sequence_parallel_norms(layer)


def build_model(args: argparse.Namespace, config, vocab_size: int) -> List[torch.nn.Module]:
    """This rank's ``GPTModel`` chunk(s) (one per virtual pipeline stage), in
    ``Float16Module`` for bf16 / fp16, each wrapped in Megatron DDP with the distributed
    optimizer's buffer layout (SGD: the plain layout), as Megatron-LM's ``get_model``."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    vpp = args.virtual_pipeline_model_parallel_size or 1
    chunks: List[torch.nn.Module] = []
    for stage in range(vpp):
        vp = stage if vpp > 1 else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(args, config, vp_stage=vp),
            vocab_size=vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            parallel_output=True,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_percent=args.rotary_percent,
            rotary_base=args.rotary_base,
            vp_stage=vp,
        )
        if use_cuda():
            model.cuda(torch.cuda.current_device())
        if args.bf16 or args.fp16:
            model = Float16Module(config, model)
        chunks.append(model)
    if args.overlap_param_gather:
        warnings.warn("--overlap-param-gather is accepted but not overlapped by this driver.")
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        use_distributed_optimizer=args.use_distributed_optimizer,
        bucket_size=args.ddp_bucket_size,
    )
    layouts = [None] * len(chunks)
    if args.optimizer == "muon" and args.use_distributed_optimizer:
        # Owner-aligned DDP buffers for our Muon (muon_buffer_layout='owner', the default).
        from megatron_muon import muon_param_layout

        from .optim import optimizer_config

        muon_config = optimizer_config(args)
        if muon_config.muon_buffer_layout == "owner":
            layouts = [muon_param_layout(muon_config, c, ddp_config, disable_bucketing=i > 0) for i, c in enumerate(chunks)]
    return [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0,
                                **({} if layout is None else {"full_param_layout": layout}))
        for i, (chunk, layout) in enumerate(zip(chunks, layouts))
    ]


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside DDP / ``Float16Module``."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    while isinstance(chunk, (DistributedDataParallel, Float16Module)):
        chunk = chunk.module
    return chunk


def count_parameters(model: List[torch.nn.Module]) -> int:
    """Parameters on this rank (shared embeddings counted once)."""
    seen, total = set(), 0
    for chunk in model:
        for p in chunk.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total
