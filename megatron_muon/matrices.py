"""Logical matrices: which matrices Muon orthogonalizes, and where their pieces live.

A Megatron parameter is a storage tensor, not necessarily one matrix. A fused
``linear_qkv`` holds Q, K and V of every query group; a gated ``linear_fc1`` holds gate
and up halves; fused expert storage holds one matrix per expert. Each such matrix is a
*logical matrix*, and Muon must orthogonalize it whole: across tensor-parallel ranks
(each holds a slice along the partition dim) and across data-parallel ranks (each holds
a contiguous byte range of the flattened parameter, the distributed-optimizer shard).

This module describes logical matrices purely in terms of the *local* storage layout,
which is identical on every rank of an orthogonalization group: a ``LogicalMatrix``
lists, for each tensor-parallel rank ``t``, the contiguous blocks of rank ``t``'s flat
parameter storage that form its piece, and the dim along which the pieces of all TP
ranks concatenate into the full matrix. The planner turns that into who sends what.

Layouts are rules in an open registry (``register_layout``): the first rule that claims
a parameter decides its matrices. The expert and MLA layouts register themselves the
same way.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .config import MuonConfig


@dataclass(frozen=True)
class Block:
    """``rows x cols`` elements starting at ``offset`` of a rank's flat parameter storage."""

    offset: int
    rows: int
    cols: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols


@dataclass(frozen=True)
class LogicalMatrix:
    """One matrix Muon sees, described over the tensor-parallel ranks that hold it.

    ``pieces`` maps a TP rank to the blocks of its local storage that form its piece (the
    blocks stack along rows). The full matrix is the concatenation of the pieces, in TP
    rank order, along ``tp_dim``. ``replicated`` marks a parameter that every TP rank
    holds identically (not tensor-parallel): its matrix is read from TP rank 0 and the
    update is written to every TP rank.

    ``column_groups > 1`` says that each piece is really ``column_groups`` matrices side by
    side (``[gate | up]`` halves of fused legacy expert storage): the owner gathers the
    whole unit and orthogonalizes each column group, joined across TP ranks, on its own.
    Column groups are not contiguous in memory, so splitting them after the gather keeps
    the communication plan small.
    """

    name: str
    param_name: str
    pieces: Tuple[Tuple[int, Tuple[Block, ...]], ...]
    tp_dim: Optional[int]
    replicated: bool = False
    transposed: bool = False
    """True when storage is (in, out) rather than nn.Linear's (out, in) (fused experts)."""
    role: Optional[str] = None
    """'q', 'k', 'v', 'gate', 'up', ... (QK-Clip and diagnostics)."""
    index: Optional[int] = None
    """Head, query-group or expert index where the matrix is one of several."""
    column_groups: int = 1

    @property
    def piece_shape(self) -> Tuple[int, int]:
        return self.piece_shape_on(self.pieces[0][0])

    def piece_shape_on(self, tp: int) -> Tuple[int, int]:
        """Shape of TP rank ``tp``'s piece. Pieces are equal, except for row-split weights
        whose TP slices cut through a logical matrix (fused QKV with fewer query groups
        than TP ranks), where they differ along ``tp_dim`` = 0."""
        blocks = dict(self.pieces)[tp]
        return sum(b.rows for b in blocks), blocks[0].cols

    def piece_extents(self) -> List[int]:
        """Each piece's extent along ``tp_dim`` per column group, in TP order (how an
        orthogonalized matrix is cut back into pieces)."""
        shapes = [self.piece_shape_on(t) for t, _ in self.pieces]
        return [r for r, _ in shapes] if self.tp_dim == 0 else [c // self.column_groups for _, c in shapes]

    @property
    def shape(self) -> Tuple[int, int]:
        """Full shape in storage orientation (what Newton–Schulz sees)."""
        rows, cols = self.piece_shape
        if self.tp_dim is None or self.replicated:
            return rows, cols
        if self.tp_dim == 0:
            return sum(self.piece_shape_on(t)[0] for t, _ in self.pieces), cols
        return rows, cols * len(self.pieces)

    @property
    def ns_shape(self) -> Tuple[int, int]:
        """Shape of each Newton–Schulz input (one per column group)."""
        rows, cols = self.shape
        return rows, cols // self.column_groups

    @property
    def scale_shape(self) -> Tuple[int, int]:
        """(out, in) for the update scale."""
        rows, cols = self.ns_shape
        return (cols, rows) if self.transposed else (rows, cols)

    def blockwise(self) -> List["LogicalMatrix"]:
        """The per-TP-rank matrices that blockwise mode orthogonalizes instead."""
        if len(self.pieces) == 1:
            return [self]
        return [
            LogicalMatrix(
                name=f"{self.name}@tp{t}",
                param_name=self.param_name,
                pieces=((t, blocks),),
                tp_dim=None,
                transposed=self.transposed,
                role=self.role,
                index=self.index,
                column_groups=self.column_groups,
            )
            for t, blocks in self.pieces
        ]


def storage_shape(param: torch.Tensor) -> torch.Size:
    """The shape of this rank's (tensor-parallel local) storage of ``param``. A Megatron-FSDP
    parameter is a ``DTensor`` whose shape is the tensor-parallel *global* one; its
    ``orig_param`` (the module's own parameter) has the local shape."""
    return getattr(param, "orig_param", param).shape


@dataclass
class ParamContext:
    """What a layout rule may look at to decide a parameter's logical matrices."""

    name: str
    param: torch.nn.Parameter
    module: torch.nn.Module
    attr: str
    parent: Optional[torch.nn.Module]
    parent_attr: Optional[str]
    model_config: object
    config: MuonConfig
    tp_size: int

    @property
    def shape(self) -> torch.Size:
        """This rank's (tensor-parallel local) storage shape of the parameter."""
        return storage_shape(self.param)

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def partition_dim(self) -> Optional[int]:
        if getattr(self.param, "tensor_model_parallel", False) and self.tp_size > 1:
            return int(self.param.partition_dim)
        return None

    def shape_error(self, expected: str) -> ValueError:
        return ValueError(
            f"Parameter {self.name} has local shape {tuple(self.shape)}, which contradicts "
            f"the model config ({expected}, tensor_model_parallel_size={self.tp_size}). Check "
            "the TransformerConfig passed to the model, or exclude the parameter from Muon "
            "with MuonConfig.muon_exclude_patterns."
        )


LayoutRule = Callable[[ParamContext], Optional[List[LogicalMatrix]]]
_LAYOUTS: List[Tuple[str, LayoutRule]] = []


def register_layout(name: str, rule: LayoutRule, first: bool = True) -> None:
    """Add a layout rule. Rules registered with ``first=True`` are tried before older ones."""
    entry = (name, rule)
    _LAYOUTS.insert(0, entry) if first else _LAYOUTS.append(entry)


def _every_tp(ctx: ParamContext, blocks: Sequence[Block]) -> Tuple[Tuple[int, Tuple[Block, ...]], ...]:
    return tuple((t, tuple(blocks)) for t in range(ctx.tp_size))


def whole_matrix(ctx: ParamContext, blocks: Optional[Sequence[Block]] = None, **kw) -> LogicalMatrix:
    """The parameter (or the given blocks of it) as one matrix across all TP ranks."""
    rows, cols = ctx.shape
    blocks = tuple(blocks) if blocks is not None else (Block(0, rows, cols),)
    dim = ctx.partition_dim
    return LogicalMatrix(
        name=kw.pop("name", ctx.name),
        param_name=ctx.name,
        pieces=_every_tp(ctx, blocks),
        tp_dim=dim,
        replicated=dim is None and ctx.tp_size > 1,
        **kw,
    )


_WEIGHT = re.compile(r"weight\d*$")


def is_linear_module(module: torch.nn.Module) -> bool:
    """A linear layer whose 2-D ``weight`` (or ``weight<i>`` of a grouped linear) is one
    (out, in) matrix: Megatron's parallel linears, transformer-engine's, torch's."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.moe.router import Router

    if isinstance(module, (torch.nn.Linear, ColumnParallelLinear, RowParallelLinear, Router)):
        return True
    # transformer-engine classes (TELinear, TEColumnParallelGroupedLinear, ...) are only
    # importable where TE is installed; recognise them by name.
    return type(module).__name__.endswith(("Linear", "GroupedLinear"))


def _plain_rule(ctx: ParamContext) -> Optional[List[LogicalMatrix]]:
    if len(ctx.shape) != 2 or not is_linear_module(ctx.module) or not _WEIGHT.match(ctx.attr):
        return None
    return [whole_matrix(ctx)]


def qkv_parts(model_config) -> List[Tuple[str, int]]:
    """(role, rows) of one query group of a fused QKV weight, in storage order (the one
    definition of the Q/K/V split; QK-Clip and the benchmarks use it too)."""
    heads = model_config.num_attention_heads
    groups = model_config.num_query_groups or heads
    d = model_config.kv_channels
    q = heads // groups * d
    parts = [("q", q)]
    if getattr(model_config, "attention_output_gate", False):
        parts.append(("q_gate", q))
    return parts + [("k", d), ("v", d)]


def mla_parts(model_config, projection: str) -> List[Tuple[str, int]]:
    """(role, rows) of one head of an MLA up-projection, in storage order: ``"q"``
    (``linear_q_proj`` / ``linear_q_up_proj``: nope, rope) or ``"kv"``
    (``linear_kv_up_proj``: k nope, v). QK-Clip reads the same definition."""
    if projection == "q":
        return [("q_nope", model_config.qk_head_dim), ("q_rope", model_config.qk_pos_emb_head_dim)]
    return [("k_nope", model_config.qk_head_dim), ("v", model_config.v_head_dim)]


def grouped_rows(
    ctx: ParamContext,
    groups: int,
    parts: Sequence[Tuple[str, int]],
    granularity: str,
    heads_in: Optional[Dict[str, int]] = None,
    describe: str = "",
) -> List[LogicalMatrix]:
    """Logical matrices of a column-parallel weight whose rows are ``groups`` repeats of
    ``parts`` ((role, rows), in storage order), the groups split evenly over TP ranks.

    granularity 'part': one matrix per role across all groups (and TP ranks); 'group':
    one per (role, group), living on one TP rank; 'head': like 'group', with each role in
    ``heads_in`` further cut into that many heads (the query heads of a GQA group).
    """
    group_rows = sum(r for _, r in parts)
    rows, cols = ctx.shape
    if groups < ctx.tp_size and ctx.tp_size % groups == 0 and ctx.partition_dim == 0:
        if rows * ctx.tp_size == groups * group_rows:
            return _groups_across_tp(ctx, groups, parts, granularity, heads_in or {})
    if groups % ctx.tp_size or rows != groups // ctx.tp_size * group_rows or ctx.partition_dim not in (0, None):
        raise ctx.shape_error(
            f"{describe}{', ' if describe else ''}{groups} groups of parts {list(parts)}: expected "
            f"[{groups // max(ctx.tp_size, 1)} x {group_rows} rows, {cols}]"
        )
    local_groups = groups // ctx.tp_size
    heads_in = heads_in or {}
    out: List[LogicalMatrix] = []

    def block(g: int, part_offset: int, part_rows: int) -> Block:
        return Block((g * group_rows + part_offset) * cols, part_rows, cols)

    offset = 0
    for role, part_rows in parts:
        if granularity == "part":
            blocks = [block(g, offset, part_rows) for g in range(local_groups)]
            out.append(whole_matrix(ctx, blocks, name=f"{ctx.name}[{role}]", role=role))
        else:
            per = heads_in.get(role, 1) if granularity == "head" else 1
            sub_rows = part_rows // per
            for t in range(ctx.tp_size):
                for g in range(local_groups):
                    for h in range(per):
                        index = (t * local_groups + g) * per + h
                        out.append(
                            LogicalMatrix(
                                name=f"{ctx.name}[{role}{index}]",
                                param_name=ctx.name,
                                pieces=((t, (block(g, offset + h * sub_rows, sub_rows),)),),
                                tp_dim=None,
                                role=role,
                                index=index,
                            )
                        )
        offset += part_rows
    return out


def rows_across_tp(ctx: ParamContext, global_rows: Sequence[Tuple[int, int]], **kw) -> LogicalMatrix:
    """The matrix made of the (start, count) ``global_rows`` of a column-parallel weight,
    wherever the TP slices put them (rank t holds global rows [t * local, (t + 1) * local)).
    Its pieces may differ in size and live on some TP ranks only."""
    local_rows, cols = ctx.shape
    pieces = []
    for t in range(ctx.tp_size):
        lo, hi = t * local_rows, (t + 1) * local_rows
        blocks = tuple(
            Block((a - lo) * cols, b - a, cols)
            for a, b in ((max(start, lo), min(start + count, hi)) for start, count in global_rows)
            if b > a
        )
        if blocks:
            pieces.append((t, blocks))
    return LogicalMatrix(param_name=ctx.name, pieces=tuple(pieces), tp_dim=0 if len(pieces) > 1 else None, **kw)


def _groups_across_tp(
    ctx: ParamContext, groups: int, parts: Sequence[Tuple[str, int]], granularity: str, heads_in: Dict[str, int]
) -> List[LogicalMatrix]:
    """``grouped_rows`` for fewer groups than TP ranks (Megatron's GQA with
    ``num_query_groups < tensor_model_parallel_size``): the weight's global rows, groups of
    ``parts`` in order, are cut into equal TP slices that split a group; each logical matrix
    is gathered from the slices that hold its rows."""
    group_rows = sum(r for _, r in parts)
    out: List[LogicalMatrix] = []
    offset = 0
    for role, part_rows in parts:
        per = heads_in.get(role, 1) if granularity == "head" else 1
        sub_rows = part_rows // per
        if granularity == "part":
            rows = [(g * group_rows + offset, part_rows) for g in range(groups)]
            out.append(rows_across_tp(ctx, rows, name=f"{ctx.name}[{role}]", role=role))
        else:
            for g in range(groups):
                for h in range(per):
                    index = g * per + h
                    rows = [(g * group_rows + offset + h * sub_rows, sub_rows)]
                    out.append(rows_across_tp(ctx, rows, name=f"{ctx.name}[{role}{index}]", role=role, index=index))
        offset += part_rows
    return out


def _fused_qkv_rule(ctx: ParamContext) -> Optional[List[LogicalMatrix]]:
    """Megatron's fused ``linear_qkv``: per query group, [q heads; (q gate;) k; v] rows."""
    from megatron.core.transformer.attention import SelfAttention

    if not (isinstance(ctx.parent, SelfAttention) and ctx.parent_attr == "linear_qkv"):
        return None
    if ctx.attr != "weight" or not ctx.config.muon_split_qkv:
        return None
    mc = ctx.model_config
    heads = mc.num_attention_heads
    groups = mc.num_query_groups or heads
    heads_per_group = heads // groups
    return grouped_rows(
        ctx,
        groups,
        qkv_parts(mc),
        ctx.config.muon_qkv_granularity,
        {"q": heads_per_group, "q_gate": heads_per_group},
        describe=f"num_query_groups={groups}, num_attention_heads={heads}, kv_channels={mc.kv_channels}",
    )


def _mla_rule(ctx: ParamContext) -> Optional[List[LogicalMatrix]]:
    """Multi-latent attention up-projections, per head: ``linear_q_proj`` /
    ``linear_q_up_proj`` rows are [q nope; q rope], ``linear_kv_up_proj`` rows are
    [k nope; v]. (The down-projections stay whole: their TP slices do not align with the
    latent / shared-rope boundary.)"""
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    if not isinstance(ctx.parent, MultiLatentAttention) or ctx.attr != "weight":
        return None
    if not ctx.config.muon_split_mla:
        return None
    mc = ctx.model_config
    if ctx.parent_attr in ("linear_q_proj", "linear_q_up_proj"):
        parts = mla_parts(mc, "q")
    elif ctx.parent_attr == "linear_kv_up_proj":
        parts = mla_parts(mc, "kv")
    else:
        return None
    granularity = "group" if ctx.config.muon_mla_granularity == "head" else "part"
    return grouped_rows(ctx, mc.num_attention_heads, parts, granularity)


def glu_halves(ctx: ParamContext, offset: int, rows: int, cols: int, prefix: str = "", index=None):
    """Gate and up halves of a gated fc1 block (local layout per TP rank: [gate; up])."""
    half = rows // 2
    return [
        whole_matrix(
            ctx,
            [Block(offset + i * half * cols, half, cols)],
            name=f"{ctx.name}{prefix}[{role}]",
            role=role,
            index=index,
        )
        for i, role in enumerate(("gate", "up"))
    ]


def _glu_fc1_rule(ctx: ParamContext) -> Optional[List[LogicalMatrix]]:
    """Gated fc1 of a dense MLP, a SequentialMLP expert (an MLP too) or a TEGroupedMLP
    (``linear_fc1.weight<i>``, one expert each): rows are [gate; up] on every TP rank."""
    if ctx.parent_attr != "linear_fc1" or not _WEIGHT.match(ctx.attr) or len(ctx.shape) != 2:
        return None
    if not is_linear_module(ctx.module):
        return None
    if not (ctx.config.muon_split_glu and ctx.model_config.gated_linear_unit):
        return None
    rows, cols = ctx.shape
    if rows % 2 or ctx.partition_dim not in (0, None):
        raise ctx.shape_error("gated_linear_unit: fc1 rows must be [gate; up] halves")
    return glu_halves(ctx, 0, rows, cols)


def _legacy_grouped_rule(ctx: ParamContext) -> Optional[List[LogicalMatrix]]:
    """Fused expert storage of the legacy ``GroupedMLP``: ``weight1`` is stored
    ``[hidden, E * ffn(*2 if GLU)]`` but read as ``view(E, hidden, -1)``, ``weight2`` as
    ``view(E, -1, hidden)``: expert e's matrix is the e-th contiguous block of memory, in
    (in, out) orientation. TP slices the ffn dim of each expert's view."""
    module = ctx.module
    if ctx.attr not in ("weight1", "weight2") or not hasattr(module, "num_local_experts"):
        return None
    experts = int(module.num_local_experts)
    hidden = ctx.model_config.hidden_size
    numel = ctx.numel
    if numel % (experts * hidden):
        raise ctx.shape_error(f"{experts} local experts x hidden_size={hidden}")
    ffn = numel // (experts * hidden)
    glu = ctx.attr == "weight1" and ctx.model_config.gated_linear_unit
    split = glu and ctx.config.muon_split_glu
    if split and ffn % 2:
        raise ctx.shape_error("gated_linear_unit: weight1 columns must be [gate | up] halves")
    if ctx.attr == "weight1":
        rows, cols, tp_dim = hidden, ffn, 1  # view (hidden, ffn_local [*2])
    else:
        rows, cols, tp_dim = ffn, hidden, 0  # view (ffn_local, hidden)
    tp_dim = tp_dim if ctx.tp_size > 1 else None
    ep_rank = _expert_rank(ctx)
    return [
        LogicalMatrix(
            name=f"{ctx.name}[expert{ep_rank * experts + e}]",
            param_name=ctx.name,
            pieces=_every_tp(ctx, [Block(e * rows * cols, rows, cols)]),
            tp_dim=tp_dim,
            transposed=True,
            role="fc1" if ctx.attr == "weight1" else "fc2",
            index=ep_rank * experts + e,
            column_groups=2 if split else 1,
        )
        for e in range(experts)
    ]


def _expert_prefix() -> str:
    """'ep<r>.' on expert-parallel rank r when expert parallelism is on, else ''."""
    try:
        from megatron.core import parallel_state

        if parallel_state.get_expert_model_parallel_world_size() > 1:
            return f"ep{parallel_state.get_expert_model_parallel_rank()}."
    except (AssertionError, AttributeError, RuntimeError):
        pass
    return ""


def _expert_rank(ctx: ParamContext) -> int:
    """This rank's expert-parallel rank (0 when expert parallelism is not initialised)."""
    try:
        from megatron.core import parallel_state

        return parallel_state.get_expert_model_parallel_rank()
    except (AssertionError, AttributeError, RuntimeError):
        return 0


register_layout("plain", _plain_rule)
register_layout("glu_fc1", _glu_fc1_rule)
register_layout("fused_qkv", _fused_qkv_rule)
register_layout("legacy_grouped_mlp", _legacy_grouped_rule)
register_layout("mla", _mla_rule)


# ---------------------------------------------------------------------------------------
# Which parameters are Muon matrices
# ---------------------------------------------------------------------------------------


def is_muon_matrix(name: str, ndim: int, role: str, exclude: Sequence[str] = (), router: bool = False) -> bool:
    """The one rule for which parameters Muon optimizes, by name, rank and role: tensors of
    two or more dims, except embeddings and the output layer (``role='embedding'``), the
    MoE router unless ``router`` (``role='router'``) and names matching an ``exclude``
    ``fnmatch`` pattern. :func:`is_muon_param` reads the role off the module; the checkpoint
    converter, which has no model, off the name."""
    if any(fnmatch.fnmatch(name, pattern) for pattern in exclude):
        return False
    if ndim < 2 or role == "embedding":
        return False
    return router if role == "router" else True


class UnmatchedExcludePattern(ValueError):
    """A ``muon_exclude_patterns`` entry that names no parameter of the model."""


def check_exclude_patterns_match(model_chunks: Sequence[torch.nn.Module], config: MuonConfig) -> None:
    """Every ``muon_exclude_patterns`` entry matches a trainable parameter's name on some
    rank: a pattern that matches nothing (a typo) would leave the matrices it meant to
    exclude on Muon without a word. Each rank sees only its pipeline stage's and its expert
    rank's parameters, so the ranks' matches are combined by an all-reduce (MAX) over the
    default process group when there is one; every rank then raises the same error."""
    import torch.distributed as dist

    patterns = list(config.muon_exclude_patterns)
    if not patterns:
        return
    params = [(n, p) for c in model_chunks for n, p in unwrap(c).named_parameters() if p.requires_grad]
    device = params[0][1].device if params else torch.device("cpu")
    hits = torch.tensor([any(fnmatch.fnmatch(n, pattern) for n, _ in params) for pattern in patterns], device=device)
    hits = hits.to(torch.int32)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(hits, op=dist.ReduceOp.MAX)
    missing = [pattern for pattern, hit in zip(patterns, hits.tolist()) if not hit]
    if missing:
        example = next((n for n, _ in params if ".layers." in n), params[0][0] if params else "")
        raise UnmatchedExcludePattern(
            f"--muon-exclude-patterns {' '.join(repr(m) for m in missing)} matches no parameter of the model "
            f"(fnmatch on names such as {example!r}): correct the pattern or drop it"
        )


def is_muon_param(name: str, param: torch.nn.Parameter, module: torch.nn.Module, config: MuonConfig) -> bool:
    """Whether ``param`` is a Muon matrix (:func:`is_muon_matrix`; ``muon_param_filter``,
    if set, decides instead)."""
    from megatron.core.transformer.moe.router import Router

    if config.muon_param_filter is not None:
        return bool(config.muon_param_filter(name, param))
    embedding = (
        getattr(param, "is_embedding_or_output_parameter", False)
        or isinstance(module, torch.nn.Embedding)
        or type(module).__name__.endswith("Embedding")
    )
    role = "embedding" if embedding else "router" if isinstance(module, Router) else "weight"
    return is_muon_matrix(name, param.dim(), role, config.muon_exclude_patterns, config.muon_router_optimizer == "muon")


def _module_index(
    model: torch.nn.Module,
) -> Dict[str, Tuple[torch.nn.Module, str, Optional[torch.nn.Module], Optional[str]]]:
    """name -> (owning module, attr, parent of owning module, owning module's attr in parent)."""
    modules = dict(model.named_modules())
    index = {}
    for mod_name, module in modules.items():
        parent_name, _, parent_attr = mod_name.rpartition(".")
        parent = modules.get(parent_name) if mod_name else None
        for attr, _ in module.named_parameters(recurse=False):
            full = f"{mod_name}.{attr}" if mod_name else attr
            index[full] = (module, attr, parent, parent_attr if mod_name else None)
    return index


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The model under Megatron's DDP / Float16Module wrappers."""
    while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
        chunk = chunk.module
    return chunk


@dataclass
class MuonParam:
    """A Muon-managed parameter of one model chunk and its logical matrices."""

    chunk_index: int
    name: str
    param: torch.nn.Parameter
    matrices: List[LogicalMatrix] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"chunk{self.chunk_index}.{self.name}"


def _check_tiling(layout_name: str, ctx: ParamContext, matrices: List[LogicalMatrix]) -> None:
    """Every element of every TP rank's storage belongs to exactly one logical matrix."""
    numel = ctx.numel
    for t in range(ctx.tp_size):
        blocks = sorted((b for m in matrices for tt, bs in m.pieces if tt == t for b in bs), key=lambda b: b.offset)
        end = 0
        for b in blocks:
            if b.offset != end:
                break
            end += b.numel
        if end != numel or sum(b.numel for b in blocks) != numel:
            raise ValueError(
                f"Layout '{layout_name}' does not tile parameter {ctx.name} on tensor-parallel "
                f"rank {t}: every element must belong to exactly one logical matrix."
            )


def logical_matrices(ctx: ParamContext) -> List[LogicalMatrix]:
    """The logical matrices of one parameter: the first layout rule that claims it."""
    for layout_name, rule in _LAYOUTS:
        matrices = rule(ctx)
        if matrices is not None:
            _check_tiling(layout_name, ctx, matrices)
            return matrices
    raise ValueError(
        f"No Muon layout claims parameter {ctx.name} of shape {tuple(ctx.shape)} "
        f"(a {len(ctx.shape)}-D tensor of module {type(ctx.module).__name__}). Fused or "
        "N-D storage must be described by a layout (megatron_muon.matrices.register_layout) "
        "so that Muon never orthogonalizes storage as if it were one matrix; or route the "
        "parameter to AdamW with MuonConfig.muon_exclude_patterns."
    )


def is_expert_parallel(param: torch.nn.Parameter) -> bool:
    """Megatron marks an expert-parallel parameter with ``allreduce = False`` (its gradient is
    reduced over the expert data-parallel group, its TP group is the expert TP group)."""
    return not getattr(param, "allreduce", True)


def collect_muon_params(
    model_chunks: Sequence[torch.nn.Module], config: MuonConfig, tp_sizes: Tuple[int, int]
) -> Tuple[List[MuonParam], List[Tuple[str, torch.nn.Parameter]]]:
    """Split the trainable parameters of all chunks into Muon params (with their logical
    matrices) and scalar params (name, param). ``tp_sizes``: the tensor-parallel size of
    dense and of expert-parallel parameters."""
    muon, scalar = [], []
    multi = len(model_chunks) > 1
    ep_prefix = _expert_prefix()
    for chunk_index, chunk in enumerate(model_chunks):
        model = unwrap(chunk)
        model_config = getattr(model, "config", None)
        index = _module_index(model)
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            module, attr, parent, parent_attr = index[name]
            if not is_muon_param(name, param, module, config):
                scalar.append((name, param))
                continue
            display = f"chunk{chunk_index}.{name}" if multi else name
            expert = is_expert_parallel(param)
            if expert:
                display = ep_prefix + display  # local expert indices repeat on every EP rank
            ctx = ParamContext(
                name=display,
                param=param,
                module=module,
                attr=attr,
                parent=parent,
                parent_attr=parent_attr,
                model_config=model_config,
                config=config,
                tp_size=tp_sizes[expert],
            )
            muon.append(MuonParam(chunk_index, name, param, logical_matrices(ctx)))
    return muon, scalar
