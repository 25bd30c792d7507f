"""Tiny real Megatron-core models for tests and laptop debugging, and how to train them.

Everything here is a thin layer over Megatron-core itself (``GPTModel``, the local layer
spec, ``DistributedDataParallel``, ``get_forward_backward_func``); the only additions are
what makes runs in different parallel layouts comparable:

* ``canonical_init_`` sets every parameter from a seed and its *global* name and shape
  (Megatron's own ``sharded_state_dict`` keys), so a TP2xPP2 model and a one-rank model
  start from exactly the same weights;
* ``gather_canonical_state`` collects the local pieces of every parameter, keyed the same
  way, so the parent process can assemble the full model from any layout;
* ``reference_train`` trains the one-rank model with the single-process oracle
  (``megatron_muon.reference.ReferenceMuon``), the numbers every layout is checked against.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from ..config import MuonConfig

# ---------------------------------------------------------------------------------------
# Model configuration
# ---------------------------------------------------------------------------------------


@dataclass
class TinyModelSpec:
    """A tiny GPT. ``kind`` is 'gqa', 'mha', 'moe' or 'mla'; the rest are Megatron names."""

    kind: str = "gqa"
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = 2
    vocab_size: int = 128
    seq_length: int = 16
    swiglu: bool = True
    num_moe_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    moe_shared_expert_intermediate_size: Optional[int] = None
    untie_embeddings_and_output_weights: bool = True
    bf16: bool = False
    fp16: bool = False
    sequence_parallel: bool = False
    mla: bool = False
    """Multi-latent attention (set by kind='mla'; combine with kind='moe' for MoE + MLA)."""
    mtp_num_layers: Optional[int] = None
    """Multi-token prediction layers (DeepSeek-V3's MTP), each built like the decoder's layers."""
    extra: Dict[str, Any] = field(default_factory=dict)
    expert_layout: str = "sequential"
    """How routed experts store their weights: 'sequential' (SequentialMLP), 'legacy_grouped'
    (fused ``weight1``/``weight2``, ``experts.LegacyGroupedMLP``) or 'te_grouped'
    (``linear_fc1.weight<i>``: TEGroupedMLP, or its stand-in without transformer-engine)."""

    def __post_init__(self) -> None:
        if self.kind == "mha":
            self.num_query_groups = None
        if self.kind == "moe" and self.num_moe_experts is None:
            self.num_moe_experts = 4
            self.moe_ffn_hidden_size = self.moe_ffn_hidden_size or 64
        if self.kind == "mla":
            self.mla = True
        if self.mla:
            self.num_query_groups = None
        if self.expert_layout not in ("sequential", "legacy_grouped", "te_grouped"):
            raise ValueError(f"unknown expert_layout {self.expert_layout!r}")


def transformer_config(spec: TinyModelSpec):
    """The Megatron ``TransformerConfig`` for ``spec`` in the current parallel layout."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    if spec.bf16 and spec.fp16:
        raise ValueError("TinyModelSpec: bf16=True and fp16=True are both set; choose one precision.")
    ep = parallel_state.get_expert_model_parallel_world_size()
    if spec.num_moe_experts and spec.num_moe_experts % ep:
        # Megatron's MoELayer asserts this with an empty message, after half the model is built.
        raise ValueError(
            f"TinyModelSpec.num_moe_experts={spec.num_moe_experts} is not divisible by "
            f"expert_model_parallel_size={ep}; use a multiple of {ep} experts or another EP size."
        )
    dtype = torch.bfloat16 if spec.bf16 else torch.float16 if spec.fp16 else torch.float32
    kwargs: Dict[str, Any] = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        normalization="RMSNorm",
        add_bias_linear=False,
        gated_linear_unit=spec.swiglu,
        activation_func=F.silu if spec.swiglu else F.gelu,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=spec.bf16,
        fp16=spec.fp16,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=(parallel_state.get_virtual_pipeline_model_parallel_world_size()),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
        sequence_parallel=spec.sequence_parallel,
        mtp_num_layers=spec.mtp_num_layers,
    )
    if spec.num_moe_experts:
        kwargs.update(
            num_moe_experts=spec.num_moe_experts,
            moe_router_topk=spec.moe_router_topk,
            moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size,
            moe_token_dispatcher_type="allgather",  # gloo rejects the alltoall split tensors
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
        )
    if spec.mla:
        # Small MLA: latent q and kv, per head 16 nope + 8 rope dims for q/k, 16 for v.
        # Megatron's local MLA spec puts RMSNorms on the latents (qk_layernorm).
        kwargs.update(
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_head_dim=16,
            qk_pos_emb_head_dim=8,
            v_head_dim=16,
            rope_type="rope",
            qk_layernorm=True,
        )
        kwargs.update(spec.extra)
        return MLATransformerConfig(**kwargs)
    kwargs.update(spec.extra)
    return TransformerConfig(**kwargs)


def build_model_chunks(spec: TinyModelSpec, config=None) -> List[torch.nn.Module]:
    """Build this rank's ``GPTModel`` chunk(s) (several with virtual pipeline stages)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from ..layer_specs import gpt_block_spec, gpt_layer_spec, gpt_mtp_block_spec

    config = config or transformer_config(spec)
    # Megatron's local spec with our max-logit-recording core attention (MHA/GQA/MLA) and
    # a sequence-parallel-capable torch norm.
    layer_spec = gpt_layer_spec(
        num_experts=spec.num_moe_experts,
        multi_latent_attention=spec.mla,
        qk_layernorm=spec.mla or bool(spec.extra.get("qk_layernorm", False)),
        normalization="RMSNorm",
        use_te=False,
    )
    if spec.num_moe_experts and spec.expert_layout != "sequential":
        from .experts import with_experts_layout

        layer_spec = with_experts_layout(layer_spec, spec.expert_layout)
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    chunks = []
    for vp_stage in range(vpp):
        vp = vp_stage if vpp > 1 else None
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=gpt_block_spec(config, layer_spec, vp_stage=vp),
                mtp_block_spec=gpt_mtp_block_spec(config, layer_spec, vp_stage=vp),
                vocab_size=spec.vocab_size,
                max_sequence_length=spec.seq_length,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                share_embeddings_and_output_weights=not spec.untie_embeddings_and_output_weights,
                position_embedding_type="rope",
                vp_stage=vp,
            )
        )
    return chunks


# ---------------------------------------------------------------------------------------
# Layout-independent weights: every parameter addressed by its global (checkpoint) key
# ---------------------------------------------------------------------------------------


def _sharded_tensors(chunk: torch.nn.Module) -> List[Any]:
    """Megatron's ``ShardedTensor``s for a chunk's parameters (factories expanded)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = []
    for value in nested_values(chunk.sharded_state_dict()):
        if isinstance(value, ShardedTensorFactory):
            out.extend(v for v in nested_values(value.build()) if isinstance(v, ShardedTensor))
        elif isinstance(value, ShardedTensor):
            out.append(value)
    # Only parameters (not extra state or buffers such as rotary inv_freq).
    storages = {p.untyped_storage().data_ptr() for p in chunk.parameters()}
    return [st for st in out if st.data is not None and st.data.untyped_storage().data_ptr() in storages]


def param_region(st, chunks: List[torch.nn.Module]) -> Tuple[torch.nn.Parameter, int]:
    """The parameter a ``ShardedTensor``'s data lies in, and where it starts in the
    parameter's flat storage (a GLU half or an expert of fused storage is a view)."""
    for chunk in chunks:
        for param in chunk.parameters():
            if param.untyped_storage().data_ptr() == st.data.untyped_storage().data_ptr():
                offset = (st.data.data_ptr() - param.data_ptr()) // param.element_size()
                if 0 <= offset and offset + st.data.numel() <= param.numel():
                    return param, offset
    raise KeyError(f"no parameter holds the data of {st.key}")


def _seeded_global(
    key: str, shape: Tuple[int, ...], seed: int, std: float, device: Union[str, torch.device] = "cpu"
) -> torch.Tensor:
    """The canonical tensor of ``key``, drawn on ``device``'s generator: a GPU draws other
    numbers than the CPU for the same seed, but every rank and peer on it the same ones, and
    at its speed (a model of 0.5 B parameters took about 30 s per peer on a GPU machine's CPU)."""
    digest = int(hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()[:15], 16)
    gen = torch.Generator(device=device).manual_seed(digest)
    if key.endswith("layer_norm_weight") or key.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen, device=device)
    return std * torch.randn(shape, generator=gen, device=device)


@torch.no_grad()
def canonical_init_(chunks: List[torch.nn.Module], seed: int = 0, std: float = 0.05) -> None:
    """Overwrite every parameter with a slice of a seeded tensor of its global shape. A key's
    global tensor stacks every layer (and expert) of it: drawn once, then sliced per layer."""
    drawn: Dict[Tuple[str, Tuple[int, ...]], torch.Tensor] = {}
    for chunk in chunks:
        for st in _sharded_tensors(chunk):
            at = (st.key, tuple(st.global_shape))
            if at not in drawn:
                drawn[at] = _seeded_global(st.key, st.global_shape, seed, std, st.data.device)
            st.data.copy_(drawn[at][st.global_slice()].reshape(st.data.shape))


@torch.no_grad()
def gather_canonical_state(chunks: List[torch.nn.Module]) -> Dict[str, List[Tuple[Any, torch.Tensor]]]:
    """This rank's pieces of every parameter: ``{key: [(global_slice, fp32 data), ...]}``."""
    out: Dict[str, List[Tuple[Any, torch.Tensor]]] = {}
    for chunk in chunks:
        for st in _sharded_tensors(chunk):
            out.setdefault(st.key, []).append(
                ((tuple(st.global_shape), st.global_slice()), st.data.detach().float().clone())
            )
    return out


def gather_canonical_optimizer_state(
    model: List[torch.nn.Module], optimizer
) -> Dict[str, List[Tuple[Any, torch.Tensor]]]:
    """This rank's pieces of every optimizer state tensor in model coordinates
    (``optimizer.state.<state>.<param key>``), as ``gather_canonical_state`` does for
    parameters; merge the ranks' results with ``merge_canonical_states``."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from ..checkpoint.training_state import model_sharded_state_dict

    model_sd = model_sharded_state_dict(model)
    out: Dict[str, List[Tuple[Any, torch.Tensor]]] = {}
    for value in nested_values(optimizer.sharded_state_dict(model_sd)["param_state"]):
        built = nested_values(value.build()) if isinstance(value, ShardedTensorFactory) else [value]
        for st in built:
            if isinstance(st, ShardedTensor):
                out.setdefault(st.key, []).append(
                    ((tuple(st.global_shape), st.global_slice()), st.data.detach().float().clone())
                )
    return out


def merge_canonical_states(per_rank: List[Dict[str, list]]) -> Dict[str, torch.Tensor]:
    """Assemble full tensors from ``gather_canonical_state`` results of all ranks."""
    full: Dict[str, torch.Tensor] = {}
    for state in per_rank:
        for key, pieces in state.items():
            for (shape, where), data in pieces:
                if key not in full:
                    full[key] = torch.full(shape, float("nan"))
                full[key][where] = data.reshape(full[key][where].shape)
    for key, value in full.items():
        if torch.isnan(value).any():
            raise AssertionError(f"no rank reported part of parameter {key}")
    return full


# ---------------------------------------------------------------------------------------
# Wrapping and training
# ---------------------------------------------------------------------------------------


def wrap_ddp(
    chunks: List[torch.nn.Module],
    config,
    use_distributed_optimizer: bool = True,
    overlap_grad_reduce: bool = False,
    overlap_param_gather: bool = False,
    bucket_size: Optional[int] = None,
    full_param_layout=None,
    muon_config=None,
) -> List[torch.nn.Module]:
    """Wrap chunks in Megatron DDP the way Megatron-LM's ``get_model`` does; with a
    ``muon_config`` asking for ``muon_buffer_layout='owner_aligned'``, each chunk gets
    ``megatron_muon.owner_aligned_param_layout``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        use_distributed_optimizer=use_distributed_optimizer,
        bucket_size=bucket_size,
    )
    layouts = [full_param_layout] * len(chunks)
    if muon_config is not None and muon_config.muon_buffer_layout == "owner_aligned":
        from megatron_muon.buffer_layout import owner_aligned_param_layout

        layouts = [
            owner_aligned_param_layout(muon_config, c, ddp_config, disable_bucketing=i > 0)
            for i, c in enumerate(chunks)
        ]
    return [
        DistributedDataParallel(
            config=config,
            ddp_config=ddp_config,
            module=chunk,
            disable_bucketing=i > 0,
            **({} if layout is None else {"full_param_layout": layout}),
        )
        for i, (chunk, layout) in enumerate(zip(chunks, layouts))
    ]


def wrap_megatron_fsdp(
    chunks: List[torch.nn.Module], config, strategy: str = "optim_grads_params", **ddp_overrides
) -> List[torch.nn.Module]:
    """Wrap chunks in Megatron-FSDP (``FullyShardedDataParallel``) with the sharding
    ``strategy``, as Megatron-LM's ``get_model`` does with ``--use-megatron-fsdp``.

    fp32 main gradients (Megatron-FSDP's default is the parameter dtype, and it ignores
    ``grad_reduce_in_fp32``), ``overlap_grad_reduce`` (its 'optim' sharding reduces twice
    without it), no ``PREMUL_SUM`` on the CPU (gloo lacks it), and Megatron-FSDP's
    accumulation fixed for one-rank groups (``megatron_muon.storage.megatron_fsdp``)."""
    from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel

    from ..storage.megatron_fsdp import fix_gradient_accumulation_on_single_rank_groups

    fix_gradient_accumulation_on_single_rank_groups()
    options = dict(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=True,
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=strategy,
        overlap_grad_reduce=True,
        megatron_fsdp_main_grads_dtype=torch.float32,
        gradient_reduce_div_fusion=torch.cuda.is_available(),
    )
    options.update(ddp_overrides)
    ddp_config = DistributedDataParallelConfig(**options)
    return [FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=chunk) for chunk in chunks]


@torch.no_grad()
def megatron_fsdp_weights(model: List[torch.nn.Module]) -> List[Dict[str, torch.Tensor]]:
    """Every parameter of Megatron-FSDP-wrapped ``model``, whole (tensor-parallel local),
    by its name in the chunk: all-gathered from the fp32 main-weight shards of the DP ranks
    and cast to the parameter dtype, as Megatron-FSDP's parameter all-gather does."""
    import torch.distributed as dist

    from ..storage.megatron_fsdp import local_flat, shard_ranges

    out = []
    for chunk in model:
        chunk.start_param_sync(force_sync=True)  # no gather of its own still in flight
        names = chunk.param_and_grad_buffer.param_to_name
        weights = {}
        for param, ranges, _, group in shard_ranges(chunk):
            raw = param.orig_param
            mine = torch.zeros(max(e - s for s, e in ranges), dtype=torch.float32)
            local = local_flat(param)
            mine[: local.numel()] = local
            pieces = [torch.empty_like(mine) for _ in ranges]
            dist.all_gather(pieces, mine, group=group)
            full = torch.empty(raw.shape.numel(), dtype=torch.float32)
            for (s, e), piece in zip(ranges, pieces):
                full[s:e] = piece[: e - s]
            weights[names[raw]] = full.view(raw.shape).to(raw.dtype)
        out.append(weights)
    return out


@torch.no_grad()
def gather_canonical_state_of_megatron_fsdp(model: List[torch.nn.Module], spec: TinyModelSpec) -> Dict[str, list]:
    """``gather_canonical_state`` for a Megatron-FSDP-wrapped model: its weights loaded into
    a fresh unwrapped copy (Megatron-FSDP's state-dict hooks return its own shards)."""
    fresh = build_model_chunks(spec)
    for chunk, weights in zip(fresh, megatron_fsdp_weights(model)):
        for name, param in chunk.named_parameters():
            param.copy_(weights[name])
    return gather_canonical_state(fresh)


def synthetic_batches(spec: TinyModelSpec, global_batch_size: int, num_steps: int, seed: int = 0) -> List[torch.Tensor]:
    """Token batches ``[global_batch_size, seq_length + 1]``, identical on every rank."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    return [
        torch.randint(0, spec.vocab_size, (global_batch_size, spec.seq_length + 1), generator=gen)
        for _ in range(num_steps)
    ]


def _microbatches(tokens: torch.Tensor, micro_batch_size: int) -> Iterator[Dict[str, torch.Tensor]]:
    """Split this data-parallel rank's share of a global batch into micro-batches."""
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    local = tokens.chunk(dp, dim=0)[rank]
    for mb in local.split(micro_batch_size, dim=0):
        yield {"tokens": mb[:, :-1].contiguous(), "labels": mb[:, 1:].contiguous()}


def _forward_step(data_iterator, model):
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    batch = dict(next(data_iterator))
    batch["position_ids"] = torch.arange(batch["tokens"].shape[1]).unsqueeze(0).expand_as(batch["tokens"])
    # Each context-parallel rank keeps its two chunks of the sequence (Megatron's split).
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=parallel_state.get_context_parallel_group())
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def forward_backward(
    model: List[torch.nn.Module],
    tokens: torch.Tensor,
    micro_batch_size: int,
    spec: TinyModelSpec,
    forward_only: bool = False,
    optimizer=None,
) -> Optional[float]:
    """One global batch through Megatron's pipeline schedule. Returns the mean loss
    (averaged over micro-batches and data-parallel ranks) on every rank.

    ``optimizer``: its ``scale_loss`` becomes ``config.grad_scale_func``, as Megatron-LM's
    training setup does, so the schedule multiplies the loss by the loss scale before
    backward (fp16: the optimizer divides the gradients by it again). An fp16 model needs
    it for a backward pass (without it the gradients would be too small by the scale)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp = parallel_state.get_data_parallel_world_size()
    num_microbatches = tokens.shape[0] // dp // micro_batch_size
    config = model[0].config
    config.grad_scale_func = optimizer.scale_loss if optimizer is not None else None
    if config.fp16 and not forward_only and optimizer is None:
        raise ValueError(
            "forward_backward: an fp16 model's backward needs the optimizer's loss scale; "
            "pass optimizer=... (its scale_loss becomes config.grad_scale_func, as in Megatron-LM)."
        )
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    iters = [_microbatches(tokens, micro_batch_size) for _ in model]
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iters if len(model) > 1 else iters[0],
        model=model,
        num_microbatches=num_microbatches,
        seq_length=spec.seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )
    return _reduce_loss(losses)


def _reduce_loss(losses: List[Dict[str, torch.Tensor]]) -> float:
    """Mean loss over micro-batches and data- and context-parallel ranks (each CP rank's
    loss is the mean over its tokens, all equally many), broadcast from the last stage."""
    from megatron.core import parallel_state

    value = torch.zeros(1)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True) and losses:
        value[0] = torch.stack([x["lm loss"] for x in losses]).mean()
    torch.distributed.all_reduce(value, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    value /= parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    torch.distributed.all_reduce(value, group=parallel_state.get_pipeline_model_parallel_group())
    return float(value[0])


def train_step(
    model: List[torch.nn.Module],
    optimizer,
    tokens: torch.Tensor,
    micro_batch_size: int,
    spec: TinyModelSpec,
) -> Tuple[float, bool]:
    """Zero grads, forward/backward one global batch, ``optimizer.step()``.

    Returns ``(loss, update_successful)``.
    """
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    loss = forward_backward(model, tokens, micro_batch_size, spec, optimizer=optimizer)
    ok, _, _ = optimizer.step()
    return loss, bool(ok)


def megatron_adam_optimizer(model: List[torch.nn.Module], lr: float = 1e-2, **overrides):
    """Megatron's own DistributedOptimizer + AdamW (the peer every comparison starts from)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg = dict(
        optimizer="adam",
        lr=lr,
        weight_decay=0.01,
        adam_beta1=0.9,
        adam_beta2=0.95,
        clip_grad=1.0,
        bf16=model[0].config.bf16,
        fp16=model[0].config.fp16,
        params_dtype=model[0].config.params_dtype,
        use_distributed_optimizer=model[0].ddp_config.use_distributed_optimizer,
    )
    cfg.update(overrides)
    return get_megatron_optimizer(OptimizerConfig(**cfg), model)


def reference_train(
    spec,
    config: MuonConfig,
    batches: Sequence[torch.Tensor],
    micro_batch_size: int,
    lrs: Optional[Sequence[float]] = None,
    cautious_masks: Optional[Sequence[Dict[str, torch.Tensor]]] = None,
):
    """Train the one-rank model of ``spec`` with ``ReferenceMuon``; run it inside
    ``run_distributed(reference_train, 1, spec, config, batches, micro_batch_size)``.

    Each batch ``[B, seq+1]`` is cut into ``B / micro_batch_size`` micro-batches; the loss
    is Megatron's: mean over micro-batches of each micro-batch's mean token loss (so each
    micro-batch's backward is scaled by ``1 / num_microbatches``). No DDP: grads land in
    ``.grad``. ``lrs`` optionally gives each step's lr. Returns ``(losses, state)``: each
    step's loss (forward before that step's update) and ``gather_canonical_state``.
    """
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    from .reference import ReferenceMuon

    chunks = build_model_chunks(spec)
    assert len(chunks) == 1, "reference_train runs a one-rank model"
    model = chunks[0]
    canonical_init_(chunks, seed=0)
    opt = ReferenceMuon(chunks, config)
    keys = {id(p): k for k, p in opt.params.items()}
    losses, flips = [], []
    for i, tokens in enumerate(batches):
        model.zero_grad(set_to_none=True)
        micro = tokens.split(micro_batch_size, dim=0)
        # The MTP loss's backward scale, as Megatron's schedule sets it for each micro-batch.
        MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0 / len(micro)))
        total = 0.0
        for mb in micro:
            inputs, labels = mb[:, :-1].contiguous(), mb[:, 1:].contiguous()
            position_ids = torch.arange(inputs.shape[1]).unsqueeze(0).expand_as(inputs)
            loss = model(inputs, position_ids, None, labels=labels).float().mean()
            (loss / len(micro)).backward()
            total += float(loss.detach())
        losses.append(total / len(micro))
        masks = None
        if cautious_masks is not None:
            masks = {}
            for st in _sharded_tensors(model):
                if st.key in cautious_masks[i]:
                    param, offset = param_region(st, chunks)
                    mask = masks.setdefault(keys[id(param)], torch.zeros_like(param))
                    mask.view(-1)[offset : offset + st.data.numel()] = cautious_masks[i][st.key][
                        st.global_slice()
                    ].reshape(-1)
        opt.step(lr=None if lrs is None else lrs[i], cautious_masks=masks)
        flips.append({k: s["cautious"] for k, s in opt.state.items() if "cautious" in s})
    if cautious_masks is not None:
        return losses, gather_canonical_state(chunks), flips
    return losses, gather_canonical_state(chunks)
