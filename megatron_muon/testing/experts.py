"""Expert-weight layouts that megatron-core 0.19.2 cannot build on the CPU, as small modules.

Megatron-core 0.19.2 ships two expert modules: ``SequentialMLP`` (one ``MLP`` per expert,
``local_experts.<i>.linear_fc1/2.weight``) and ``TEGroupedMLP`` (``linear_fc1.weight<i>``,
``linear_fc2.weight<i>``; needs transformer-engine). Two more layouts matter to an
optimizer that must recognise every expert matrix:

* ``LegacyGroupedMLP``: the fused storage of the legacy ``GroupedMLP`` (removed from
  Megatron-core, alive in old checkpoints). ``weight1`` is ``[hidden, E_local * ffn_local
  (*2 with GLU)]`` and ``weight2`` is ``[E_local * ffn_local, hidden]``, but the forward reads
  them as ``weight1.view(E_local, hidden, -1)`` and ``weight2.view(E_local, -1, hidden)``:
  per-expert ``(in, out)`` matrices laid out expert-major in memory. With GLU each
  expert's fc1 columns are ``[gate | up]`` halves, as SequentialMLP's fc1 rows are
  ``[gate; up]``. The grouped matmul is a plain loop over experts.
* ``TEGroupedMLPStandIn``: Megatron's own ``TEGroupedMLP`` class with pure-torch
  stand-ins for transformer-engine's grouped linears, so its parameters carry TE's names
  (``experts.linear_fc1.weight<i>``) without TE installed.

Both compute exactly what ``SequentialMLP`` computes for the same per-expert weights, and
both give the same ``sharded_state_dict`` keys and global offsets as ``SequentialMLP`` (so
``models.canonical_init_`` starts every layout from identical weights and a Megatron
checkpoint written in one layout loads into another). ``local_expert_matrices`` reads the
per-expert ``(out, in)`` matrices (or their gradients) of any of the three layouts.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.tensor_parallel.layers import _initialize_affine_weight_gpu
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)


def _expert_process_groups(pg_collection: Any) -> Any:
    if pg_collection is None:
        from megatron.core.transformer.moe.moe_utils import ProcessGroupCollection

        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    return pg_collection


def _uses_expert_groups(config: TransformerConfig) -> bool:
    """Megatron's rule for ``param.allreduce = False`` on expert weights: their gradients
    are reduced over the expert-data-parallel group whenever that differs from the dense one."""
    return config.expert_model_parallel_size > 1 or (
        config.expert_tensor_parallel_size != config.tensor_model_parallel_size
    )


def _glu_activation(config: TransformerConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation ``MLP`` applies to fc1's output (unfused path; the fused kernels
    compute the same function)."""
    if not config.gated_linear_unit:
        return config.activation_func

    def glu(x: torch.Tensor) -> torch.Tensor:
        x_glu, x_linear = torch.chunk(x, 2, dim=-1)
        if (val := config.activation_func_clamp_value) is not None:
            x_glu = x_glu.clamp(min=None, max=val)
            x_linear = x_linear.clamp(min=-val, max=val)
        return config.activation_func(x_glu) * (x_linear + config.glu_linear_offset)

    return glu


# ---------------------------------------------------------------------------------------
# Legacy fused GroupedMLP
# ---------------------------------------------------------------------------------------


class LegacyGroupedMLP(MegatronModule):
    """Experts stored as the legacy fused ``GroupedMLP`` stored them (see module docstring).

    Constructed like every MoE experts module of Megatron-core 0.19.2:
    ``LegacyGroupedMLP(num_local_experts, config, pg_collection=..., name=...)``.
    """

    def __init__(
        self,
        num_local_experts: int,
        config: TransformerConfig,
        submodules: Any = None,
        pg_collection: Any = None,
        name: Optional[str] = None,
    ) -> None:
        super().__init__(config=config)
        if config.add_bias_linear:
            raise ValueError("LegacyGroupedMLP has no biases (as the legacy GroupedMLP): set add_bias_linear=False")
        if config.moe_latent_size is not None:
            raise ValueError("LegacyGroupedMLP does not support moe_latent_size")
        pg_collection = _expert_process_groups(pg_collection)
        self.num_local_experts = num_local_experts
        self.ep_group = pg_collection.ep
        self.tp_group = pg_collection.expt_tp
        self.dp_group = pg_collection.expt_dp
        tp_size = self.tp_group.size()
        ffn = config.moe_ffn_hidden_size
        if ffn % tp_size:
            raise ValueError(f"moe_ffn_hidden_size={ffn} is not divisible by expert TP {tp_size}")
        self.ffn_local = ffn // tp_size
        self.glu = bool(config.gated_linear_unit)
        hidden = config.hidden_size
        fc1_cols = num_local_experts * self.ffn_local * (2 if self.glu else 1)
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        dtype = config.params_dtype
        self.weight1 = torch.nn.Parameter(torch.empty(hidden, fc1_cols, device=device, dtype=dtype))
        self.weight2 = torch.nn.Parameter(
            torch.empty(num_local_experts * self.ffn_local, hidden, device=device, dtype=dtype)
        )
        # As the legacy GroupedMLP: expert TP splits weight1 by columns, weight2 by rows.
        for weight, dim, init in (
            (self.weight1, 1, config.init_method),
            (self.weight2, 0, config.output_layer_init_method),
        ):
            if config.perform_initialization:
                _initialize_affine_weight_gpu(weight, init, partition_dim=dim, is_expert=True)
            else:
                weight.tensor_model_parallel = True
                weight.partition_dim = dim
                weight.partition_stride = 1
            weight.allreduce = not _uses_expert_groups(config)
        self.activation_func = _glu_activation(config)

    def expert_views(self, weight1: torch.Tensor, weight2: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(E_local, hidden, ffn_local[*2])`` and ``(E_local, ffn_local, hidden)`` views."""
        hidden, experts = self.config.hidden_size, self.num_local_experts
        return weight1.view(experts, hidden, -1), weight2.view(experts, -1, hidden)

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ) -> Tuple[torch.Tensor, None]:
        """Grouped matmul over the tokens of each local expert (already permuted)."""
        hidden_states, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:
            assert self.config.moe_router_topk == 1, "moe_apply_probs_on_input needs topk=1"
            hidden_states = (probs.unsqueeze(-1) * hidden_states).to(hidden_states.dtype)
            probs = torch.ones_like(probs)
        counts = _as_list(tokens_per_expert)
        w1, w2 = self.expert_views(self.weight1, self.weight2)
        outputs = []
        # An expert with no tokens still multiplies an empty block, so its weights keep
        # a (zero) gradient like SequentialMLP's.
        tokens, token_probs = torch.split(hidden_states, counts), torch.split(probs, counts)
        for e, (x, p) in enumerate(zip(tokens, token_probs)):
            h = self.activation_func(x @ w1[e])
            h = (h * p.unsqueeze(-1)).to(h.dtype)
            outputs.append(h @ w2[e])
        return torch.cat(outputs, dim=0), None

    def backward_dw(self) -> None:
        """Weight gradients are never delayed here."""

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None
    ) -> Dict[str, Any]:
        """Per-expert pieces under SequentialMLP's keys and global offsets.

        ``{prefix}weight1`` becomes, per local expert, the ``(2*ffn_local, hidden)`` view
        ``weight1.view(E, hidden, -1)[e].T`` split into gate and up halves, keyed
        ``{prefix}experts.linear_fc1.weight`` with the expert axis and the GLU/TP placement
        of ``apply_swiglu_sharded_factory``; ``weight2`` likewise as ``(hidden, ffn_local)``.
        The pieces are views of the tensor handed to the factory, so writing into them
        writes the fused storage; loading reassembles the fused tensor.
        """
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        if (metadata or {}).get("singleton_local_shards", False):
            raise NotImplementedError("LegacyGroupedMLP: singleton_local_shards is not supported")
        ep_rank, ep_size = self.ep_group.rank(), self.ep_group.size()
        tp_rank, tp_size = self.tp_group.rank(), self.tp_group.size()
        replica_id = (0, 0, self.dp_group.rank())
        ep_axis = len(sharded_offsets)
        num_global = ep_size * self.num_local_experts
        hidden = self.config.hidden_size
        E = self.num_local_experts

        def expert_offsets(e: int) -> tuple:
            return (*sharded_offsets, (ep_axis, ep_rank * E + e, num_global))

        def fc1_build(key, data, replica, flattened_range):
            _no_flattened_range(flattened_range)
            views = data.view(E, hidden, -1).transpose(1, 2)  # (E, 2*ffn_local, hidden)
            out = []
            for e in range(E):
                if self.glu:
                    gate, up = torch.chunk(views[e], 2, dim=0)
                    parts = [(gate, tp_rank, 2 * tp_size), (up, tp_size + tp_rank, 2 * tp_size)]
                else:
                    parts = [(views[e], tp_rank, tp_size)]
                out.append(
                    [
                        ShardedTensor.from_rank_offsets(
                            key,
                            t,
                            *expert_offsets(e),
                            (ep_axis + 1, rank, frags),
                            replica_id=replica,
                            prepend_axis_num=ep_axis + 1,
                        )
                        for t, rank, frags in parts
                    ]
                )
            return out

        def fc1_merge(loaded):
            per_expert = [torch.cat(parts, dim=0).t() for parts in loaded]  # (hidden, 2*ffn_local)
            return torch.stack(per_expert).reshape(hidden, -1)

        def fc2_build(key, data, replica, flattened_range):
            _no_flattened_range(flattened_range)
            views = data.view(E, -1, hidden).transpose(1, 2)  # (E, hidden, ffn_local)
            return [
                ShardedTensor.from_rank_offsets(
                    key,
                    views[e],
                    *expert_offsets(e),
                    (ep_axis + 2, tp_rank, tp_size),
                    replica_id=replica,
                    prepend_axis_num=ep_axis + 1,
                )
                for e in range(E)
            ]

        def fc2_merge(loaded):
            return torch.stack([t.t() for t in loaded]).reshape(-1, hidden)

        return {
            f"{prefix}weight1": ShardedTensorFactory(
                f"{prefix}experts.linear_fc1.weight", self.weight1, fc1_build, fc1_merge, replica_id
            ),
            f"{prefix}weight2": ShardedTensorFactory(
                f"{prefix}experts.linear_fc2.weight", self.weight2, fc2_build, fc2_merge, replica_id
            ),
        }


def _no_flattened_range(flattened_range: Optional[slice]) -> None:
    if flattened_range is not None:
        raise NotImplementedError("flattened ShardedTensors are not supported (dropped in 0.19)")


def _as_list(counts: Any) -> List[int]:
    return counts.tolist() if torch.is_tensor(counts) else list(counts)


# ---------------------------------------------------------------------------------------
# TEGroupedMLP without transformer-engine
# ---------------------------------------------------------------------------------------


class _StandInGroupedLinear(torch.nn.Module):
    """Pure-torch stand-in for TE's ``GroupedLinear`` as ``TEGroupedMLP`` uses it: one 2-D
    parameter ``weight<i>`` per local expert, ``forward(x, m_splits) -> (y, None)``. Its
    subclasses' names end in ``GroupedLinear`` as transformer-engine's do
    (``TEColumnParallelGroupedLinear``), which is how the layout rules know a grouped linear
    (``matrices.is_linear_module``)."""

    parallel_mode = "column"

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        config: TransformerConfig,
        init_method: Callable,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: Optional[str] = None,
        pg_collection: Any = None,
        name: Optional[str] = None,
    ) -> None:
        super().__init__()
        if bias:
            raise ValueError("the TEGroupedMLP stand-in has no biases: set add_bias_linear=False")
        assert is_expert, "grouped linears are expert layers"
        self._pg_collection = _expert_process_groups(pg_collection)
        self.config = config
        tp_size = self._pg_collection.expt_tp.size()
        column = self.parallel_mode == "column"
        # Megatron's token dispatcher does the expert-TP communication; each rank holds
        # a slice of every expert matrix (fc1 by rows, fc2 by columns).
        out_size = output_size // tp_size if column else output_size
        in_size = input_size if column else input_size // tp_size
        self.num_gemms = num_gemms
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        for i in range(num_gemms):
            weight = torch.nn.Parameter(torch.empty(out_size, in_size, device=device, dtype=config.params_dtype))
            dim = 0 if column else 1
            if config.perform_initialization:
                _initialize_affine_weight_gpu(weight, init_method, dim, is_expert=True)
            else:
                weight.tensor_model_parallel = True
                weight.partition_dim = dim
                weight.partition_stride = 1
            weight.allreduce = not _uses_expert_groups(config)
            self.register_parameter(f"weight{i}", weight)

    def forward(self, x: torch.Tensor, m_splits: List[int]) -> Tuple[torch.Tensor, None]:
        parts = torch.split(x, _as_list(m_splits))
        parts = [F.linear(xi, getattr(self, f"weight{i}")) for i, xi in enumerate(parts)]
        return torch.cat(parts, dim=0), None

    def backward_dw(self) -> None:
        """Weight gradients are never delayed here."""

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None
    ) -> Dict[str, Any]:
        """As ``TEGroupedLinear._sharded_state_dict_grouped`` (without FP8 extra state):
        ``weight<i>`` under the key ``{prefix}weight`` with a global-expert axis."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        if (metadata or {}).get("singleton_local_shards", False):
            raise NotImplementedError("TEGroupedMLP stand-in: singleton_local_shards unsupported")
        pgs = self._pg_collection
        num_global = pgs.ep.size() * self.num_gemms
        ep_axis = len(sharded_offsets)
        tp_axis = 0 if self.parallel_mode == "column" else 1
        out = {}
        for i in range(self.num_gemms):
            sub = make_sharded_tensors_for_checkpoint(
                {f"{i}.weight": getattr(self, f"weight{i}")},
                "",
                {f"{i}.weight": tp_axis},
                (*sharded_offsets, (ep_axis, pgs.ep.rank() * self.num_gemms + i, num_global)),
                tp_group=pgs.expt_tp,
                dp_cp_group=metadata["dp_cp_group"],
            )
            sh = sub[f"{i}.weight"]
            sh.key = f"{prefix}weight"
            sh.replica_id = (*sh.replica_id[:2], pgs.expt_dp.rank())
            out[f"{prefix}weight{i}"] = sh
        return out


class _StandInColumnParallelGroupedLinear(_StandInGroupedLinear):
    parallel_mode = "column"


class _StandInRowParallelGroupedLinear(_StandInGroupedLinear):
    parallel_mode = "row"


class TEGroupedMLPStandIn(TEGroupedMLP):
    """Megatron's ``TEGroupedMLP`` (its forward, activation and ``sharded_state_dict``) over
    pure-torch grouped linears: parameter names ``linear_fc1.weight<i>`` /
    ``linear_fc2.weight<i>`` as with transformer-engine. Only fp32/bf16, no biases."""

    def __init__(
        self,
        num_local_experts: int,
        config: TransformerConfig,
        submodules: Optional[GroupedMLPSubmodules] = None,
        pg_collection: Any = None,
        name: Optional[str] = None,
    ) -> None:
        super().__init__(
            num_local_experts,
            config,
            submodules or te_grouped_standin_submodules(),
            pg_collection=_expert_process_groups(pg_collection),
            name=name,
        )


def te_grouped_standin_submodules() -> GroupedMLPSubmodules:
    """``GroupedMLPSubmodules`` whose linears are the pure-torch stand-ins."""
    return GroupedMLPSubmodules(
        linear_fc1=_StandInColumnParallelGroupedLinear, linear_fc2=_StandInRowParallelGroupedLinear
    )


# ---------------------------------------------------------------------------------------
# Reading per-expert matrices of any layout
# ---------------------------------------------------------------------------------------


def _grad_of(param: torch.nn.Parameter) -> torch.Tensor:
    grad = getattr(param, "main_grad", None)
    if grad is None:
        grad = param.grad
    if grad is None:
        raise ValueError("parameter has neither main_grad nor grad")
    return grad


def local_expert_matrices(experts: torch.nn.Module, grads: bool = False) -> Dict[str, List[torch.Tensor]]:
    """This rank's per-expert ``(out, in)`` matrices of an experts module, as views.

    Returns ``{"fc1": [E_local x (ffn_local[*2], hidden)], "fc2": [E_local x (hidden, ffn_local)]}``
    for ``SequentialMLP``, ``TEGroupedMLP`` (or its stand-in) and ``LegacyGroupedMLP``; with
    GLU, fc1 rows are ``[gate; up]`` in every layout. ``grads=True`` reads ``main_grad``
    (Megatron DDP) or ``.grad`` instead. Views are writable: copying into them sets weights.
    """
    read = _grad_of if grads else (lambda p: p)
    if isinstance(experts, LegacyGroupedMLP):
        w1, w2 = experts.expert_views(read(experts.weight1), read(experts.weight2))
        return {"fc1": list(w1.transpose(1, 2).unbind()), "fc2": list(w2.transpose(1, 2).unbind())}
    if hasattr(experts, "local_experts"):
        return {
            "fc1": [read(m.linear_fc1.weight) for m in experts.local_experts],
            "fc2": [read(m.linear_fc2.weight) for m in experts.local_experts],
        }
    if hasattr(experts, "linear_fc1") and hasattr(experts.linear_fc1, "weight0"):
        n = experts.num_local_experts
        return {
            "fc1": [read(getattr(experts.linear_fc1, f"weight{i}")) for i in range(n)],
            "fc2": [read(getattr(experts.linear_fc2, f"weight{i}")) for i in range(n)],
        }
    raise TypeError(f"unknown experts layout: {type(experts).__name__}")


EXPERT_LAYOUTS = ("sequential", "legacy_grouped", "te_grouped")


def experts_builder(layout: str) -> Optional[Callable[..., torch.nn.Module]]:
    """The builder of MoELayer's ``experts`` submodule for ``layout`` (one of
    ``EXPERT_LAYOUTS``), or None for 'sequential' (keep the layer spec's own). A builder is
    called as ``builder(num_local_experts, config, pg_collection=..., name=...)`` (Megatron
    0.19's specs are such partials). 'te_grouped' builds the real ``TEGroupedMLP`` when
    transformer-engine is importable, else ``TEGroupedMLPStandIn``."""
    if layout == "sequential":
        return None
    if layout == "legacy_grouped":
        return LegacyGroupedMLP
    if layout == "te_grouped":
        try:
            import transformer_engine  # noqa: F401
            from megatron.core.extensions.transformer_engine import (
                TEColumnParallelGroupedLinear,
                TERowParallelGroupedLinear,
            )
        except ImportError:
            return TEGroupedMLPStandIn
        submodules = GroupedMLPSubmodules(
            linear_fc1=TEColumnParallelGroupedLinear, linear_fc2=TERowParallelGroupedLinear
        )
        return functools.partial(TEGroupedMLP, submodules=submodules)
    raise ValueError(f"expert_layout must be one of {EXPERT_LAYOUTS}, got {layout!r}")


def with_experts_layout(layer_spec: Any, layout: str) -> Any:
    """A copy of a GPT layer spec (local or TE) whose MoE layer builds ``layout`` experts.

    The layer's ``mlp`` must be an MoE layer (a partial or ``ModuleSpec`` with
    ``MoESubmodules``); the input spec is left unchanged.
    """
    builder = experts_builder(layout)
    if builder is None:
        return layer_spec
    layer_spec = copy.copy(layer_spec)
    layer_spec.submodules = copy.copy(layer_spec.submodules)
    mlp = layer_spec.submodules.mlp
    if isinstance(mlp, functools.partial):
        moe = dataclasses.replace(mlp.keywords["submodules"], experts=builder)
        keywords = {**mlp.keywords, "submodules": moe}
        layer_spec.submodules.mlp = functools.partial(mlp.func, *mlp.args, **keywords)
    else:  # ModuleSpec (older specs)
        layer_spec.submodules.mlp = dataclasses.replace(
            mlp, submodules=dataclasses.replace(mlp.submodules, experts=builder)
        )
    return layer_spec
