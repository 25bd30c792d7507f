"""Ownership plans for model shapes, without building a model or any process group.

The planner needs only parameter shapes, their tensor-parallel attributes, the layout
rules and the data-parallel byte ranges. This module fakes exactly those (meta tensors,
stand-in modules, Megatron's own DDP buffer-layout function) so that the plan of a
DeepSeek-V3-sized layer on 64 expert-parallel ranks can be computed on a laptop: the
number of logical matrices and the Newton–Schulz FLOPs each rank would own.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron_muon.config import MuonConfig
from megatron_muon.matrices import MuonParam, ParamContext, logical_matrices
from megatron_muon.planner import Plan, plan_for_config
from megatron_muon.process_groups import OrthoGroup
from megatron_muon.shard_map import dp_ranges_in_layout


class ShapeOnlyLinear(torch.nn.Module):
    """Stands in for a parallel linear layer (recognised by the layout rules by name)."""


@dataclass
class ParamShape:
    """One weight: its local (per TP rank) shape, TP partition dim, and where it sits."""

    name: str
    shape: Tuple[int, int]
    partition_dim: Optional[int] = None
    parent_attr: Optional[str] = None
    """'linear_fc1', 'linear_qkv', ... (what the layout rules look at)."""


def _dp_ranges(params: Sequence[torch.Tensor], dp_size: int) -> List[List[Tuple[int, int]]]:
    """Each DP rank's flat range of every param, as Megatron DDP lays out one buffer."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    layout = DistributedOptimizer._compute_per_buffer_param_layout(
        list(params), None, dp_size, DistributedDataParallelConfig(use_distributed_optimizer=True)
    )
    return [dp_ranges_in_layout(layout, param, dp_size) for param in params]


def synthetic_plan(
    shapes: Sequence[ParamShape],
    model_config: SimpleNamespace,
    config: MuonConfig,
    tp_size: int,
    dp_size: int,
    gpus_per_node: Optional[int] = None,
) -> Plan:
    """The plan one orthogonalization group (``tp_size`` x ``dp_size`` ranks) would run,
    its ranks ``gpus_per_node`` to a node in group order (None: all on one node)."""
    params, muon_params = [], []
    for spec in shapes:
        param = torch.nn.Parameter(torch.empty(spec.shape, device="meta"))
        if spec.partition_dim is not None and tp_size > 1:
            param.tensor_model_parallel = True
            param.partition_dim = spec.partition_dim
        module = ShapeOnlyLinear()
        ctx = ParamContext(
            name=spec.name,
            param=param,
            module=module,
            attr="weight",
            parent=None,
            parent_attr=spec.parent_attr,
            model_config=model_config,
            config=config,
            tp_size=tp_size,
        )
        params.append(param)
        muon_params.append(MuonParam(0, spec.name, param, logical_matrices(ctx)))
    ranges = _dp_ranges(params, dp_size)
    coords = [(t, r) for r in range(dp_size) for t in range(tp_size)]
    nodes = tuple(r // gpus_per_node for r in range(len(coords))) if gpus_per_node else ()
    group = OrthoGroup(
        group=None, rank=0, size=len(coords), coords=coords, tp_size=tp_size, dp_size=dp_size, nodes=nodes
    )
    return plan_for_config(config, muon_params, {i: ranges[i] for i in range(len(params))}, group)


def moe_expert_layer_shapes(
    num_experts: int, ep_size: int, hidden: int, ffn: int, glu: bool, etp_size: int = 1
) -> List[ParamShape]:
    """One MoE layer's routed-expert weights on one expert-parallel rank (TEGroupedMLP /
    SequentialMLP layout: one (out, in) matrix per expert and projection)."""
    local = num_experts // ep_size
    fc1_rows = (2 if glu else 1) * ffn // etp_size
    out = []
    for e in range(local):
        out.append(ParamShape(f"experts.linear_fc1.weight{e}", (fc1_rows, hidden), 0, "linear_fc1"))
        out.append(ParamShape(f"experts.linear_fc2.weight{e}", (hidden, ffn // etp_size), 1, "linear_fc2"))
    return out


def deepseek_v3_expert_plan(edp_size: int = 1, etp_size: int = 1, ep_size: int = 64, **cfg) -> Dict[str, object]:
    """Plan statistics of one DeepSeek-V3 MoE layer's routed experts (256 experts, hidden
    7168, expert ffn 2048, SwiGLU) on ``ep_size`` expert-parallel ranks."""
    from megatron_muon.planner import plan_statistics

    config = MuonConfig(lr=1e-3, **cfg)
    model_config = SimpleNamespace(gated_linear_unit=True, hidden_size=7168)
    shapes = moe_expert_layer_shapes(256, ep_size, 7168, 2048, glu=True, etp_size=etp_size)
    plan = synthetic_plan(shapes, model_config, config, etp_size, edp_size)
    stats = plan_statistics(plan)
    stats["experts_per_ep_rank"] = 256 // ep_size
    return stats
