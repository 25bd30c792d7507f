"""A GPT's parameters as Megatron-core lays them out, from its description alone.

The scale model needs, for one pipeline stage and one tensor-parallel rank, every
parameter that Megatron DDP puts into its buffers: local (per TP rank) shape, tensor-
parallel attributes, whether it is an expert, embedding or output weight, and which
module it belongs to (the layout rules of ``megatron_muon.matrices`` decide Q/K/V and
MLA splits from that). ``ModelShape`` describes the model (from a recipe, through the
training driver's own argument parser, or from the CPU harness's ``TinyModelSpec``);
``stage_params`` yields meta-tensor parameters in ``GPTModel.named_parameters()`` order,
which is the order DDP lays buffers out in. No memory is allocated.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence

import torch


@dataclass
class ModelShape:
    """What determines the optimizer's work: shapes, layers, and tokens per step."""

    name: str
    num_layers: int
    hidden: int
    ffn: int
    heads: int
    groups: int
    kv_channels: int
    vocab: int
    seq_length: int
    global_batch: int
    active_params: int
    micro_batch: int = 1
    swiglu: bool = True
    untie: bool = True
    qk_layernorm: bool = False
    num_experts: int = 0
    moe_ffn: int = 0
    shared_ffn: int = 0
    moe_pattern: List[int] = field(default_factory=list)
    mla: bool = False
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 0
    qk_head_dim: int = 0
    qk_pos_dim: int = 0
    v_head_dim: int = 0
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    split_glu: bool = False
    """The recipe's ``muon_split_glu``: the gate and up halves of a gated fc1 are Muon
    matrices of their own (a setting of the optimizer that changes its matrices' shapes)."""

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_length

    @property
    def model_flops(self) -> float:
        """6 x active parameters x tokens per step (forward + backward)."""
        return 6.0 * self.active_params * self.tokens_per_step

    def model_config(self) -> SimpleNamespace:
        """The TransformerConfig fields the Muon layout rules read."""
        return SimpleNamespace(
            num_attention_heads=self.heads,
            num_query_groups=self.groups,
            kv_channels=self.kv_channels,
            hidden_size=self.hidden,
            gated_linear_unit=self.swiglu,
            qk_head_dim=self.qk_head_dim,
            qk_pos_emb_head_dim=self.qk_pos_dim,
            v_head_dim=self.v_head_dim,
        )

    def stage_layers(self, pp: int) -> List[List[int]]:
        """Layer indices of each pipeline stage (Megatron's uneven first/last stages)."""
        first, last = self.first_stage_layers, self.last_stage_layers
        if pp == 1:
            return [list(range(self.num_layers))]
        counts = [None] * pp
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        rest = self.num_layers - sum(c for c in counts if c is not None)
        free = [i for i, c in enumerate(counts) if c is None]
        for i in free:
            counts[i] = rest // len(free)
        if sum(counts) != self.num_layers:
            raise ValueError(f"{self.num_layers} layers do not split into {pp} stages as {counts}")
        out, start = [], 0
        for c in counts:
            out.append(list(range(start, start + c)))
            start += c
        return out


def from_recipe(recipe: str, gpus: int, tp: int, pp: int, ep: int, etp: Optional[int] = None) -> ModelShape:
    """A recipe read by Megatron-LM's own parser and validation (as ``tools/pretrain_gpt.py``
    reads it: same defaults and derived values)."""
    from megatron_muon.megatron_lm.launch import validated_args
    from tools.bench import sizing

    argv = [
        "--recipe",
        recipe,
        "--tensor-model-parallel-size",
        str(tp),
        "--pipeline-model-parallel-size",
        str(pp),
        "--expert-model-parallel-size",
        str(ep),
    ]
    if etp is not None:
        argv += ["--expert-tensor-parallel-size", str(etp)]
    args = validated_args(argv, world_size=gpus)
    divisor = args.make_vocab_size_divisible_by * tp
    vocab = -(-args.vocab_size // divisor) * divisor
    return ModelShape(
        name=recipe,
        num_layers=args.num_layers,
        hidden=args.hidden_size,
        ffn=args.ffn_hidden_size,
        heads=args.num_attention_heads,
        groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        vocab=vocab,
        seq_length=args.seq_length,
        global_batch=args.global_batch_size,
        active_params=sizing.count_parameters(args, vocab).active,
        micro_batch=args.micro_batch_size,
        swiglu=args.swiglu,
        untie=args.untie_embeddings_and_output_weights,
        qk_layernorm=args.qk_layernorm,
        num_experts=args.num_experts or 0,
        moe_ffn=args.moe_ffn_hidden_size or 0,
        shared_ffn=args.moe_shared_expert_intermediate_size or 0,
        moe_pattern=sizing.moe_layer_pattern(args),
        mla=args.multi_latent_attention,
        q_lora_rank=args.q_lora_rank,
        kv_lora_rank=args.kv_lora_rank,
        qk_head_dim=args.qk_head_dim,
        qk_pos_dim=args.qk_pos_emb_head_dim,
        v_head_dim=args.v_head_dim,
        first_stage_layers=args.decoder_first_pipeline_num_layers,
        last_stage_layers=args.decoder_last_pipeline_num_layers,
        split_glu=bool(getattr(args, "muon_split_glu", False)),
    )


def llama3_70b(tp: int, vocab_divisor: int = 128) -> ModelShape:
    """Llama-3-70B as Meta publishes it (80 layers, hidden 8192, FFN 28672, 64 heads in 8
    groups of 128 channels, vocabulary 128256, 8192 tokens, SwiGLU, untied embeddings), its
    vocabulary padded as Megatron pads it at ``tp``; 16M tokens per step. No recipe ships it:
    the scale model's start-up figures use its shapes."""
    divisor = vocab_divisor * tp
    vocab = -(-128256 // divisor) * divisor
    layer = 8192 * (64 + 2 * 8) * 128 + 64 * 128 * 8192 + 3 * 8192 * 28672 + 2 * 8192
    return ModelShape(
        name="llama3_70b", num_layers=80, hidden=8192, ffn=28672, heads=64, groups=8, kv_channels=128,
        vocab=vocab, seq_length=8192, global_batch=2048, active_params=80 * layer + 2 * 128256 * 8192 + 8192,
    )  # fmt: skip


def from_tiny(spec_kwargs: Dict[str, Any], global_batch: int) -> ModelShape:
    """The CPU harness's ``TinyModelSpec`` (dense GQA / MHA / MoE)."""
    from megatron_muon.testing.models import TinyModelSpec

    s = TinyModelSpec(**spec_kwargs)
    if s.mla:
        raise NotImplementedError("from_tiny: MLA tiny models are not described here")
    groups = s.num_query_groups or s.num_attention_heads
    d = s.hidden_size // s.num_attention_heads
    experts = s.num_moe_experts or 0
    moe_ffn = s.moe_ffn_hidden_size or s.ffn_hidden_size
    glu = 3 if s.swiglu else 2
    attn = s.hidden_size * (s.num_attention_heads + 2 * groups) * d + s.num_attention_heads * d * s.hidden_size
    mlp = glu * s.hidden_size * (s.moe_router_topk * moe_ffn if experts else s.ffn_hidden_size)
    active = s.num_layers * (attn + mlp + 2 * s.hidden_size) + s.vocab_size * s.hidden_size * 2 + s.hidden_size
    return ModelShape(
        name="tiny_" + s.kind,
        num_layers=s.num_layers,
        hidden=s.hidden_size,
        ffn=s.ffn_hidden_size,
        heads=s.num_attention_heads,
        groups=groups,
        kv_channels=d,
        vocab=s.vocab_size,
        seq_length=s.seq_length,
        global_batch=global_batch,
        active_params=active,
        swiglu=s.swiglu,
        untie=s.untie_embeddings_and_output_weights,
        num_experts=experts,
        moe_ffn=moe_ffn,
        shared_ffn=s.moe_shared_expert_intermediate_size or 0,
        moe_pattern=[1 if experts else 0] * s.num_layers,
    )


# ---------------------------------------------------------------------------------------
# Parameters of one pipeline stage on one TP rank
# ---------------------------------------------------------------------------------------


@dataclass
class StageParam:
    """One parameter as DDP sees it, plus what the layout rules need."""

    name: str
    param: torch.nn.Parameter
    parent_attr: Optional[str]
    parent_kind: Optional[str]
    """'attention' (fused QKV), 'mla' or None."""
    expert: bool = False
    router: bool = False

    @property
    def is_matrix(self) -> bool:
        return self.param.dim() == 2 and not getattr(self.param, "is_embedding_or_output_parameter", False)


def _meta(
    shape: Sequence[int], partition_dim: Optional[int], tp: int, expert: bool = False, embedding: bool = False
) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.empty(tuple(shape), device="meta"))
    if partition_dim is not None and tp > 1:
        p.tensor_model_parallel = True
        p.partition_dim = partition_dim
    if expert:
        p.allreduce = False
    if embedding:
        p.is_embedding_or_output_parameter = True
    return p


def stage_params(m: ModelShape, stage: int, pp: int, tp: int, ep: int, etp: int) -> List[StageParam]:
    """This stage's parameters on one TP rank, in ``GPTModel.named_parameters()`` order."""
    out: List[StageParam] = []

    def add(
        name,
        shape,
        pdim=None,
        parent_attr=None,
        parent_kind=None,
        expert=False,
        router=False,
        embedding=False,
        tp_size=tp,
    ):
        out.append(
            StageParam(name, _meta(shape, pdim, tp_size, expert, embedding), parent_attr, parent_kind, expert, router)
        )

    h, d = m.hidden, m.kv_channels
    fc1_mult = 2 if m.swiglu else 1
    if stage == 0:
        add("embedding.word_embeddings.weight", (m.vocab // tp, h), 0, embedding=True)
    for i in m.stage_layers(pp)[stage]:
        pre = f"decoder.layers.{i}."
        add(pre + "input_layernorm.weight", (h,))
        if m.mla:
            a = pre + "self_attention."
            qk = m.qk_head_dim + m.qk_pos_dim
            add(a + "linear_proj.weight", (h, m.heads * m.v_head_dim // tp), 1, "linear_proj", "mla")
            if m.q_lora_rank:
                add(a + "linear_q_down_proj.weight", (m.q_lora_rank, h), None, "linear_q_down_proj", "mla")
                add(a + "linear_q_up_proj.weight", (m.heads * qk // tp, m.q_lora_rank), 0, "linear_q_up_proj", "mla")
            else:
                add(a + "linear_q_proj.weight", (m.heads * qk // tp, h), 0, "linear_q_proj", "mla")
            add(
                a + "linear_kv_down_proj.weight", (m.kv_lora_rank + m.qk_pos_dim, h), None, "linear_kv_down_proj", "mla"
            )
            add(
                a + "linear_kv_up_proj.weight",
                (m.heads * (m.qk_head_dim + m.v_head_dim) // tp, m.kv_lora_rank),
                0,
                "linear_kv_up_proj",
                "mla",
            )
            if m.q_lora_rank:
                add(a + "q_layernorm.weight", (m.q_lora_rank,))
            add(a + "kv_layernorm.weight", (m.kv_lora_rank,))
        else:
            a = pre + "self_attention."
            add(a + "linear_proj.weight", (h, m.heads * d // tp), 1, "linear_proj", "attention")
            add(a + "linear_qkv.weight", ((m.heads + 2 * m.groups) * d // tp, h), 0, "linear_qkv", "attention")
            if m.qk_layernorm:
                add(a + "q_layernorm.weight", (d,))
                add(a + "k_layernorm.weight", (d,))
        add(pre + "pre_mlp_layernorm.weight", (h,))
        if m.num_experts and m.moe_pattern[i]:
            add(pre + "mlp.router.weight", (m.num_experts, h), router=True)
            for e in range(m.num_experts // ep):
                x = f"{pre}mlp.experts.local_experts.{e}."
                add(
                    x + "linear_fc1.weight", (fc1_mult * m.moe_ffn // etp, h), 0, "linear_fc1", expert=True, tp_size=etp
                )
                add(x + "linear_fc2.weight", (h, m.moe_ffn // etp), 1, "linear_fc2", expert=True, tp_size=etp)
            if m.shared_ffn:
                s = pre + "mlp.shared_experts."
                add(s + "linear_fc1.weight", (fc1_mult * m.shared_ffn // tp, h), 0, "linear_fc1")
                add(s + "linear_fc2.weight", (h, m.shared_ffn // tp), 1, "linear_fc2")
        else:
            add(pre + "mlp.linear_fc1.weight", (fc1_mult * m.ffn // tp, h), 0, "linear_fc1")
            add(pre + "mlp.linear_fc2.weight", (h, m.ffn // tp), 1, "linear_fc2")
    if stage == pp - 1:
        add("decoder.final_layernorm.weight", (h,))
        if m.untie or pp > 1:
            add("output_layer.weight", (m.vocab // tp, h), 0, embedding=True)
    return out


# ---------------------------------------------------------------------------------------
# DDP buffer layouts
# ---------------------------------------------------------------------------------------


def ddp_config(grad_reduce_in_fp32: bool):
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(grad_reduce_in_fp32=grad_reduce_in_fp32, use_distributed_optimizer=True)


def buffer_layouts(
    params: List[StageParam], dp: int, edp: int, bucket_size: Optional[int], grad_reduce_in_fp32: bool, layer_wise: bool
):
    """Megatron's own layout functions on the stage's (meta) params: the byte-level
    distributed-optimizer layout, or the layer-wise one Megatron's Muon needs."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.layer_wise_optimizer import (
        LayerWiseDistributedOptimizer,
        is_managed_by_layer_wise_optimizer,
    )

    plist = [sp.param for sp in params]
    for p in plist:
        if layer_wise:
            p.is_managed_by_layer_wise_optimizer = is_managed_by_layer_wise_optimizer(p)
        elif hasattr(p, "is_managed_by_layer_wise_optimizer"):
            del p.is_managed_by_layer_wise_optimizer
    cls = LayerWiseDistributedOptimizer if layer_wise else DistributedOptimizer
    return cls.compute_full_param_layout(
        plist, bucket_size, dp, ddp_config(grad_reduce_in_fp32), expert_data_parallel_world_size=edp
    )


_FSDPBufferKey = namedtuple("_FSDPBufferKey", "is_expert_parallel is_managed_by_layer_wise_optimizer")


class _FSDPUnit(torch.nn.Module):
    """A decoder layer: the unit Megatron-FSDP gathers whole with ``optim_grads_params``."""


def fsdp_layouts(params: List[StageParam], dp: int, edp: int):
    """Megatron-FSDP's buffer index of the stage's (meta) params with ``optim_grads_params``,
    from Megatron-FSDP's own grouping (``_get_parameter_groups``: per decoder layer, dtype and
    expert-or-not, items sorted and aligned by row length) and index
    (``build_data_parallel_buffer_index``), in the shape of ``buffer_layouts``' result: per
    dense / expert key a layout with ``param_index_map`` and ``bucket_indices`` (one bucket
    per parameter group, cut into DP equal shards as Megatron-FSDP cuts it)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import (
        BucketingPolicy,
        _get_parameter_groups,
        build_data_parallel_buffer_index,
    )

    root = torch.nn.Module()
    for sp in params:
        parent = root
        *path, leaf = sp.name.split(".")
        for i, part in enumerate(path):
            if not hasattr(parent, part):
                unit = path[i - 1 : i] == ["layers"] and path[i - 2 : i - 1] == ["decoder"]
                parent.add_module(part, _FSDPUnit() if unit else torch.nn.Module())
            parent = getattr(parent, part)
        parent.register_parameter(leaf, sp.param)
    policy = BucketingPolicy(
        suggested_bucket_size=None, fsdp_unit_modules=[_FSDPUnit], data_parallel_sharding_strategy="optim_grads_params"
    )
    groups, _, _ = _get_parameter_groups(root, policy, {})
    from megatron.core.distributed import DistributedDataParallelConfig

    config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params"
    )
    layouts: Dict[bool, SimpleNamespace] = {}
    for bucket_id, group in enumerate(groups):
        expert = bool(group.is_expert_param)
        layout = layouts.setdefault(expert, SimpleNamespace(param_index_map={}, bucket_indices=[], numel=0))
        items, bucket, _ = build_data_parallel_buffer_index(
            [p.shape for p in group.params], 0, edp if expert else dp, True, config, bucket_id, group.chunk_size_factor
        )
        offset = layout.numel - bucket.global_data_index
        for item_id, param in enumerate(group.params):
            start = offset + items[item_id].global_data_index
            item = items[item_id]
            layout.param_index_map[param] = (start, start + item.size, len(layout.bucket_indices))
        layout.bucket_indices.append((layout.numel, layout.numel + bucket.size))
        layout.numel += bucket.size
    return SimpleNamespace(layouts={_FSDPBufferKey(e, False): lay for e, lay in layouts.items()})
