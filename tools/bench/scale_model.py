#!/usr/bin/env python
"""Scale model: Newton–Schulz FLOPs, bytes per link class and optimizer-step time of real
models on real clusters, for ours and the peers' schemes, without a GPU.

Input: a recipe (``recipes/*.yaml``, read by the training driver's own parser) and a
cluster (GPU count, TP / PP / EP / expert-TP, GPUs per node, intra- and inter-node
bandwidth per GPU, dense bf16 peak). For every pipeline stage it lays out the stage's
parameters exactly as Megatron DDP would (Megatron's own layout functions, on meta
tensors) and then:

* **ours** (exact / blockwise / duplicated): builds our ownership plan
  (``megatron_muon.planner.build_plan`` on the logical matrices of
  ``megatron_muon.matrices``): NS FLOPs per rank, and every piece the all-to-alls move
  (holder -> owner and back, bf16), classified intra- or inter-node by rank placement
  (Megatron's order: TP fastest, then EP, then DP; PP outermost);
* **Megatron's Muon** (layer-wise layout, whole params per DP rank): blockwise (NS of the
  local TP shard, no extra communication), duplicated (all-gather of each TP-sharded
  matrix, fp32, then NS of the full matrix on every TP rank), distributed (NS with one
  bf16 all-reduce of the Gram matrix per step);
* **AdamW** (Megatron DistOpt): no optimizer communication beyond DDP's.

DDP's reduce-scatter and all-gather, and its grad + param buffers, depend only on the
buffer layout (byte-level for AdamW and ours, layer-wise for Megatron's Muon, whose shards
are padded to the largest whole parameter) and are reported apart. Predicted optimizer-step time (slowest rank): elementwise work at HBM bandwidth +
NS at ``ns_efficiency`` of the peak + communication at ``link_efficiency`` of the link
bandwidth; ours pipelines gather / NS / scatter over its chunks, Megatron's Muon does
them one after the other. It excludes DDP's parameter all-gather (overlapped with the
forward pass under ``--overlap-param-gather``). Model FLOPs are 6 x active params x tokens.

``--validate`` compares the model's bytes for the CPU benchmark's tiny model with the
bytes ``optimizer_step.py`` counted. What one rank builds at start-up at these scales (the
layout, shard map, process-group coordinates, plan and messages; time and memory):
``startup.py``, on this module's ``Cluster`` and the same shapes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench import common, exposed_step
from tools.bench import model_shapes as S

SCHEMES = (
    "adamw",
    "megatron_blockwise",
    "megatron_duplicated",
    "megatron_distributed",
    "ours_exact",
    "ours_blockwise",
    "ours_duplicated",
    "ours_exact_megatron_layout",
    "adamw_fsdp",
    "ours_exact_fsdp",
)
LABELS = {
    "adamw": "AdamW (Megatron DistOpt)",
    "megatron_blockwise": "Megatron Muon, blockwise",
    "megatron_duplicated": "Megatron Muon, duplicated",
    "megatron_distributed": "Megatron Muon, distributed",
    "ours_exact": "ours, exact",
    "ours_blockwise": "ours, blockwise",
    "ours_duplicated": "ours, duplicated",
    "ours_exact_megatron_layout": "ours, exact, Megatron's byte-level buffers",
    "adamw_fsdp": "AdamW on Megatron-FSDP",
    "ours_exact_fsdp": "ours, exact, on Megatron-FSDP",
}
# The peers of optimizer_step.py, by scheme.
PEER_OF = {
    "adamw": "megatron_adamw",
    "megatron_blockwise": "megatron_muon_blockwise",
    "megatron_duplicated": "megatron_muon_duplicated",
    "megatron_distributed": "megatron_muon_distributed",
    "ours_exact": "ours_exact",
    "ours_blockwise": "ours_blockwise",
    "ours_duplicated": "ours_duplicated",
    "ours_exact_megatron_layout": "ours_exact_megatron_layout",
    "adamw_fsdp": "megatron_adamw_fsdp",
    "ours_exact_fsdp": "ours_exact_fsdp",
}
NS_STEPS = 5
COMM_BYTES = 2  # our pieces travel in bf16 (muon_comm_dtype)
# Bytes of HBM traffic per optimizer-state element and step (reads + writes of grad,
# moments or momentum, fp32 master, bf16 param): AdamW 4+16+8+2, Muon 4+8+8+4+8+2.
ELEMENTWISE_BYTES = {"adamw": 30, "muon": 34}


@dataclass
class Cluster:
    """The machine and the parallel layout (bandwidths per GPU and direction)."""

    gpus: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: Optional[int] = None
    gpus_per_node: int = 8
    intra_gbps: float = 450.0  # NVLink 4 (H100 SXM): 900 GB/s both directions
    inter_gbps: float = 50.0  # one 400 Gb/s NIC per GPU
    link_efficiency: float = 0.8
    peak_tflops: float = 989.4  # H100 SXM dense bf16
    ns_efficiency: float = 0.5
    hbm_gbps: float = 3350.0
    mfu: float = 0.4
    grad_reduce_in_fp32: bool = True
    overlap_grad_reduce: bool = True
    microbatches: int = 1
    """Micro-batches per step: Megatron-FSDP (``optim_grads_params``) reduce-scatters each one's gradients."""
    muon: Tuple[Tuple[str, Any], ...] = ()
    """``MuonConfig`` settings of the run beyond its defaults, as (name, value) pairs."""

    def __post_init__(self) -> None:
        self.etp = self.etp or self.tp
        if self.gpus % (self.tp * self.pp) or self.gpus % (self.pp * self.ep * self.etp):
            raise ValueError(
                f"{self.gpus} GPUs do not divide into TP{self.tp} x PP{self.pp} / EP{self.ep} x ETP{self.etp}"
            )

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def edp(self) -> int:
        return self.gpus // (self.pp * self.ep * self.etp)

    def bucket_size(self, stage: int) -> Optional[int]:
        """Megatron DDP's bucket size: one bucket without --overlap-grad-reduce or after stage 0."""
        if not self.overlap_grad_reduce or stage > 0:
            return None
        return max(40_000_000, 1_000_000 * self.dp)

    def muon_config(self, model, **kwargs):
        """The run's ``MuonConfig``: defaults, then the recipe's (``model.split_glu``), then
        :attr:`muon`, then ``kwargs``."""
        from megatron_muon import MuonConfig

        return MuonConfig(lr=1e-3, **{"muon_split_glu": model.split_glu, **dict(self.muon), **kwargs})

    def node(self, index: int) -> int:
        return index // self.gpus_per_node

    def describe(self, model=None) -> str:
        """The cluster and layout, with the Muon settings that differ from MuonConfig's
        defaults (the recipe's, then this run's)."""
        settings = {**({"muon_split_glu": True} if model is not None and model.split_glu else {}), **dict(self.muon)}
        muon = "".join(f", {k}={v}" for k, v in settings.items())
        return (
            f"{self.gpus} GPUs ({self.gpus // self.gpus_per_node} nodes of {self.gpus_per_node}): TP{self.tp} x "
            f"PP{self.pp} x DP{self.dp}; experts EP{self.ep} x ETP{self.etp} x EDP{self.edp}{muon}"
        )


SCENARIOS: Dict[str, Tuple[str, Cluster, str]] = {
    "llama3_8b": (
        "llama3_8b",
        Cluster(gpus=64, tp=2),
        "TP2 with sequence parallelism (the recipe's), DP32 over 8 nodes",
    ),
    "moonlight_16b_a3b": (
        "moonlight_16b_a3b",
        Cluster(gpus=128, tp=1, ep=8),
        "TP1, EP8 (the recipe's) inside a node, DP128 / expert DP16 over 16 nodes",
    ),
    "deepseek_v3": (
        "deepseek_v3",
        Cluster(gpus=2048, tp=1, pp=16, ep=64),
        "DeepSeek-V3's own: PP16 x EP64, no TP, ZeRO-1 DP128 / expert DP2; the recipe's Muon (gate and up "
        "apart, muon_split_glu)",
    ),
    "deepseek_v3_fused_glu": (
        "deepseek_v3",
        Cluster(gpus=2048, tp=1, pp=16, ep=64, muon=(("muon_split_glu", False),)),
        "the same layout with gate and up as one matrix (MuonConfig's default, not the recipe's)",
    ),
}


# ---------------------------------------------------------------------------------------
# Per-rank accounting
# ---------------------------------------------------------------------------------------


class RankCosts:
    """FLOPs, bytes per link class and elements per rank of one stage, by scheme."""

    def __init__(self, ranks: int) -> None:
        self.flops = defaultdict(lambda: [0.0] * ranks)
        self.intra = defaultdict(lambda: [0.0] * ranks)
        self.inter = defaultdict(lambda: [0.0] * ranks)
        self.by_kind = defaultdict(lambda: defaultdict(float))  # scheme -> kind -> bytes summed over ranks
        self.elements = defaultdict(lambda: [0.0] * ranks)
        self.ddp = defaultdict(lambda: [0.0] * ranks)
        self.buffers = defaultdict(lambda: [0.0] * ranks)  # bytes of DDP's grad + param buffers
        self.chunks: Dict[str, int] = {}
        # Bytes of the multi-rank Newton–Schulz collectives (also in intra / inter): they sit
        # inside the compute stage, so the prediction adds their time to the NS time.
        self.sync_intra = defaultdict(lambda: [0.0] * ranks)
        self.sync_inter = defaultdict(lambda: [0.0] * ranks)

    def send(self, scheme: str, kind: str, src: int, dst_node_same: bool, nbytes: float, sync: bool = False) -> None:
        (self.intra if dst_node_same else self.inter)[scheme][src] += nbytes
        if sync:
            (self.sync_intra if dst_node_same else self.sync_inter)[scheme][src] += nbytes
        self.by_kind[scheme][kind] += nbytes


def rank_of(c: Cluster, expert: bool, t: int, d: int, e: int = 0) -> int:
    """Stage-local rank of TP (or expert-TP) rank ``t``, DP (or expert-DP) rank ``d`` and
    expert-parallel rank ``e``, in Megatron's order (TP fastest, then EP, then DP)."""
    return t + c.etp * (e + c.ep * d) if expert else t + c.tp * d


def coords_of(c: Cluster, expert: bool, i: int) -> Tuple[int, int, int]:
    """(t, d, e) of stage-local rank ``i`` in the dense or the expert decomposition."""
    if expert:
        return i % c.etp, i // (c.etp * c.ep), (i // c.etp) % c.ep
    return i % c.tp, i // c.tp, 0


def logical_param(sp: S.StageParam, m: S.ModelShape, cfg, tp_size: int):
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from megatron_muon.matrices import MuonParam, ParamContext, logical_matrices
    from megatron_muon.testing.synthetic import ShapeOnlyLinear

    # The layout rules recognise fused QKV / MLA weights by their parent module's class.
    parent_cls = {"attention": SelfAttention, "mla": MLASelfAttention}.get(sp.parent_kind)
    parent = parent_cls.__new__(parent_cls) if parent_cls else None
    ctx = ParamContext(
        name=sp.name,
        param=sp.param,
        module=ShapeOnlyLinear(),
        attr="weight",
        parent=parent,
        parent_attr=sp.parent_attr,
        model_config=m.model_config(),
        config=cfg,
        tp_size=tp_size,
    )
    return MuonParam(0, sp.name, sp.param, logical_matrices(ctx))


def _ddp_costs(costs: RankCosts, scheme: str, layouts, c: Cluster) -> None:
    """DDP's reduce-scatter + all-gather per rank (every rank is in one dense and one
    expert DP group), and each rank's optimizer shard size."""
    ranks = c.tp * c.dp
    for key, layout in layouts.layouts.items():
        n = c.edp if key.is_expert_parallel else c.dp
        for b_start, b_end in layout.bucket_indices:
            numel = b_end - b_start
            grad_bytes = 4 if c.grad_reduce_in_fp32 else 2
            rs = (n - 1) * numel * grad_bytes // n
            ag = (n - 1) * numel * 2 // n
            for i in range(ranks):
                costs.ddp[scheme][i] += rs + ag
                costs.elements[scheme][i] += numel / n
                costs.buffers[scheme][i] += numel * (grad_bytes + 2)
            costs.by_kind[scheme]["reduce_scatter"] += rs * ranks
            costs.by_kind[scheme]["all_gather"] += ag * ranks


def _fsdp_costs(costs: RankCosts, scheme: str, layouts, c: Cluster) -> None:
    """Megatron-FSDP's own traffic per rank with ``optim_grads_params``: each micro-batch's
    gradient reduce-scatter and the parameter all-gather at the end of the optimizer step
    (bf16), as DDP's are counted for the other schemes; the re-gathers of each FSDP unit
    in the forward and backward passes are left out like DDP's overlapped all-gather. Each
    rank's optimizer shard; its persistent buffers hold 1/DP of the parameters and gradients."""
    grad_bytes = 4 if c.grad_reduce_in_fp32 else 2
    ranks = c.tp * c.dp
    for key, layout in layouts.layouts.items():
        n = c.edp if key.is_expert_parallel else c.dp
        for b_start, b_end in layout.bucket_indices:
            numel = b_end - b_start
            rs = (n - 1) * numel * grad_bytes // n * c.microbatches
            ag = (n - 1) * numel * 2 // n
            for i in range(ranks):
                costs.ddp[scheme][i] += rs + ag
                costs.elements[scheme][i] += numel / n
                costs.buffers[scheme][i] += numel * (grad_bytes + 2) / n
            costs.by_kind[scheme]["reduce_scatter"] += rs * ranks
            costs.by_kind[scheme]["all_gather"] += ag * ranks


def _our_costs(
    costs: RankCosts, scheme: str, params: List[S.StageParam], layouts, m, c: Cluster, mode: str, owner_aligned: bool
) -> None:
    from megatron_muon.planner import plan_for_config
    from megatron_muon.process_groups import OrthoGroup
    from megatron_muon.shard_map import dp_ranges_in_layout

    # Multi-rank Newton–Schulz is priced at this cluster's rates.
    flop_rate = c.peak_tflops * 1e12 * c.ns_efficiency
    cfg = c.muon_config(
        m,
        muon_tp_mode=mode,
        muon_ns_intra_node_flops_per_byte=flop_rate / (c.intra_gbps * 1e9 * c.link_efficiency),
        muon_ns_inter_node_flops_per_byte=flop_rate / (c.inter_gbps * 1e9 * c.link_efficiency),
    )
    for expert in (False, True):
        size, n = (c.etp, c.edp) if expert else (c.tp, c.dp)
        chosen = [sp for sp in params if sp.is_matrix and sp.expert == expert and not sp.router]
        if not chosen:
            continue
        # The Muon matrices' buffer: the tagged one under our owner-aligned layout, else the only one.
        layout = next(
            lay
            for k, lay in layouts.layouts.items()
            if k.is_expert_parallel == expert and (k.is_managed_by_layer_wise_optimizer or not owner_aligned)
        )
        muon = [logical_param(sp, m, cfg, size) for sp in chosen]
        ranges = {i: dp_ranges_in_layout(layout, sp.param, n) for i, sp in enumerate(chosen)}
        # Group ranks in global-rank order, as build_ortho_group orders them; their nodes as
        # placed on this cluster (expert-parallel rank 0).
        coords = [(t, d) for d in range(n) for t in range(size)]
        nodes = tuple(c.node(rank_of(c, expert, t, d)) for t, d in coords)
        group = OrthoGroup(group=None, rank=0, size=len(coords), coords=coords, tp_size=size, dp_size=n, nodes=nodes)
        plan = plan_for_config(cfg, muon, ranges, group, owner_aligned=owner_aligned)
        for i in range(c.tp * c.dp):
            t, d, _ = coords_of(c, expert, i)
            costs.flops[scheme][i] += plan.loads[d * size + t]
        _multirank_costs(costs, scheme, plan, coords, c, expert)
        for job in plan.jobs:
            t_o, d_o = coords[job.owner]
            for direction, segs in (("gather", job.sources), ("scatter", job.dests)):
                for seg in segs:
                    if (seg.tp, seg.dp) == (t_o, d_o):
                        continue
                    for e in range(c.ep if expert else 1):
                        holder, owner = rank_of(c, expert, seg.tp, seg.dp, e), rank_of(c, expert, t_o, d_o, e)
                        src = holder if direction == "gather" else owner
                        costs.send(scheme, "all_to_all", src, c.node(holder) == c.node(owner), seg.numel * COMM_BYTES)
        if not expert:
            costs.chunks[scheme] = len(plan.chunks)


def owner_aligned_layout(params: List[S.StageParam], m, c: Cluster, bucket: Optional[int]):
    """Our owner-aligned layout (``megatron_muon.buffer_layout``) of the stage's params."""
    from megatron_muon.buffer_layout import compute_full_param_layout, muon_param_flops, tag_muon_params

    cfg = c.muon_config(m)
    flops = {}
    for sp in params:
        if hasattr(sp.param, "is_managed_by_layer_wise_optimizer"):
            del sp.param.is_managed_by_layer_wise_optimizer
        if sp.is_matrix and not sp.router:
            flops[sp.param] = muon_param_flops(
                logical_param(sp, m, cfg, c.etp if sp.expert else c.tp), NS_STEPS, cfg.muon_ns_method
            )
    tag_muon_params(list(flops))
    per_node = (max(1, c.gpus_per_node // c.tp), max(1, c.gpus_per_node // (c.etp * c.ep)))
    return compute_full_param_layout(
        [sp.param for sp in params],
        flops,
        bucket,
        c.dp,
        S.ddp_config(c.grad_reduce_in_fp32),
        c.edp,
        shards_per_node=per_node,
    )


def _multirank_costs(costs: RankCosts, scheme: str, plan, coords, c: Cluster, expert: bool) -> None:
    """Bytes of the multi-rank Newton–Schulz jobs (``megatron_muon.multirank_newton_schulz``):
    the leader's column blocks out (bf16) and back, and each member's ring all-reduce of the
    Gram matrix (fp32), classified intra- or inter-node by the members' placement."""
    from megatron_muon.multirank_newton_schulz import multirank_traffic

    for job in plan.jobs:
        if not job.ns_ranks:
            continue
        rows, cols = job.matrix.ns_shape
        nbytes = multirank_traffic(rows, cols, NS_STEPS, len(job.ns_ranks), COMM_BYTES, job.matrix.column_groups)
        for e in range(c.ep if expert else 1):
            ranks = [rank_of(c, expert, *coords[r], e) for r in job.ns_ranks]
            leader = ranks[0]
            one_node = len({c.node(r) for r in ranks}) == 1
            for r in ranks[1:]:
                same = c.node(r) == c.node(leader)
                costs.send(scheme, "multirank_scatter", leader, same, nbytes["scatter"] / (len(ranks) - 1), sync=True)
                costs.send(scheme, "multirank_gather", r, same, nbytes["gather"], sync=True)
            for r in ranks:
                costs.send(scheme, "all_reduce", r, one_node, nbytes["all_reduce"], sync=True)


def _megatron_parts(
    sp: S.StageParam, m: S.ModelShape, size: int
) -> List[Tuple[Tuple[int, int], Tuple[int, int], Optional[int]]]:
    """(local shape, full shape, partition dim) of each matrix Megatron's Muon orthogonalizes
    for one param: fused QKV split into Q, K, V (its ``split_qkv``), anything else whole."""
    from megatron_muon.matrices import qkv_parts

    rows, cols = sp.param.shape
    dim = getattr(sp.param, "partition_dim", None) if getattr(sp.param, "tensor_model_parallel", False) else None
    if sp.parent_attr == "linear_qkv" and sp.parent_kind == "attention":
        per_group = [part_rows for _, part_rows in qkv_parts(m.model_config())]
        local_groups = m.groups // size
        return [((local_groups * r, cols), (m.groups * r, cols), dim) for r in per_group]
    full = (rows * size, cols) if dim == 0 else (rows, cols * size) if dim == 1 else (rows, cols)
    return [((rows, cols), full, dim)]


def _megatron_costs(costs: RankCosts, params: List[S.StageParam], layouts, m, c: Cluster) -> None:
    from megatron_muon.newton_schulz import newton_schulz_flops
    from megatron_muon.shard_map import dp_ranges_in_layout

    for sp in params:
        if not getattr(sp.param, "is_managed_by_layer_wise_optimizer", False):
            continue
        key = next(k for k, l in layouts.layouts.items() if sp.param in l.param_index_map)
        size = c.etp if sp.expert else c.tp
        # The DP rank holding the matrix (Megatron's layer-wise layout keeps it whole in one shard).
        ranges = dp_ranges_in_layout(layouts.layouts[key], sp.param, layouts.layouts[key].num_optimizer_shards)
        d = next(r for r, (s, e) in enumerate(ranges) if e > s)
        for local, full, dim in _megatron_parts(sp, m, size):
            sharded = dim is not None and size > 1
            side = full[1] if dim == 0 else full[0]
            other = local[0] if dim == 0 else local[1]
            work = {
                "megatron_blockwise": (newton_schulz_flops(*local, NS_STEPS), 0, None),
                "megatron_duplicated": (
                    newton_schulz_flops(*full, NS_STEPS),
                    (size - 1) * local[0] * local[1] * 4 if sharded else 0,
                    "all_gather",
                ),
                "megatron_distributed": (
                    NS_STEPS * (4 * side * side * other + 2 * side**3)
                    if sharded
                    else newton_schulz_flops(*local, NS_STEPS),
                    (NS_STEPS * (2 * (size - 1) * side * side * 2 // size) + 2 * (size - 1) * 4 // size)
                    if sharded
                    else 0,
                    "all_reduce",
                ),
            }
            for t in range(size):
                for e in range(c.ep if sp.expert else 1):
                    j = rank_of(c, sp.expert, t, d, e)
                    for scheme, (flops, nbytes, kind) in work.items():
                        costs.flops[scheme][j] += flops
                        if nbytes:
                            # TP groups are consecutive ranks: inside a node when TP <= GPUs per node.
                            costs.send(scheme, kind, j, size <= c.gpus_per_node, nbytes)


def stage_costs(m: S.ModelShape, c: Cluster, stage: int) -> RankCosts:
    """Every scheme's per-rank costs on one pipeline stage (ranks indexed TP-fastest)."""
    params = S.stage_params(m, stage, c.pp, c.tp, c.ep, c.etp)
    costs = RankCosts(c.tp * c.dp)
    bucket = c.bucket_size(stage)
    byte_level = S.buffer_layouts(params, c.dp, c.edp, bucket, c.grad_reduce_in_fp32, layer_wise=False)
    for scheme in ("adamw", "ours_exact_megatron_layout"):
        _ddp_costs(costs, scheme, byte_level, c)
    _our_costs(costs, "ours_exact_megatron_layout", params, byte_level, m, c, "exact", owner_aligned=False)
    owner = owner_aligned_layout(params, m, c, bucket)
    for mode in ("exact", "blockwise", "duplicated"):
        _ddp_costs(costs, f"ours_{mode}", owner, c)
        _our_costs(costs, f"ours_{mode}", params, owner, m, c, mode, owner_aligned=True)
    layer_wise = S.buffer_layouts(params, c.dp, c.edp, bucket, c.grad_reduce_in_fp32, layer_wise=True)
    for scheme in ("megatron_blockwise", "megatron_duplicated", "megatron_distributed"):
        _ddp_costs(costs, scheme, layer_wise, c)
    _megatron_costs(costs, params, layer_wise, m, c)
    fsdp = S.fsdp_layouts(params, c.dp, c.edp)
    for scheme in ("adamw_fsdp", "ours_exact_fsdp"):
        _fsdp_costs(costs, scheme, fsdp, c)
    _our_costs(costs, "ours_exact_fsdp", params, fsdp, m, c, "exact", owner_aligned=False)
    return costs


# ---------------------------------------------------------------------------------------
# From costs to a prediction
# ---------------------------------------------------------------------------------------


def _pipelined(gather: float, compute: float, scatter: float, chunks: int) -> float:
    """Three-stage pipeline over ``chunks`` equal chunks."""
    n = max(chunks, 1)
    return (gather + compute + scatter) / n + (n - 1) / n * max(gather, compute, scatter)


def predict(m: S.ModelShape, c: Cluster) -> Dict[str, Any]:
    """Per scheme: NS FLOPs (total, share, per rank, imbalance), bytes per rank and link
    class, DDP bytes, and the predicted optimizer-step time of the slowest rank."""
    stages = [stage_costs(m, c, s) for s in range(c.pp)]
    intra_bw = c.intra_gbps * 1e9 * c.link_efficiency
    inter_bw = c.inter_gbps * 1e9 * c.link_efficiency
    flop_rate = c.peak_tflops * 1e12 * c.ns_efficiency
    hbm = c.hbm_gbps * 1e9 * 0.8
    train_step_s = m.model_flops / (c.gpus * c.peak_tflops * 1e12 * c.mfu)
    rows = {}
    # Per stage, the slowest rank's step and the part only its own kernels do (exposed_step).
    per_stage: Dict[str, List[Dict[str, float]]] = {}
    for scheme in SCHEMES:
        times, flops, intra, inter, ddp, buffers = [], [], [], [], [], []
        per_stage[scheme] = [dict(step_ms=0.0, own_ms=0.0) for _ in stages]
        # (max-rank NS FLOPs, max/mean, stage) of the busiest stage: the one whose busiest
        # rank has the most NS FLOPs, which differs between schemes (blockwise: the first
        # stages' unsplit dense fc1; ours, exact: an MoE stage).
        critical = (0.0, float("nan"), None)
        for s, st in enumerate(stages):
            stage_flops = st.flops[scheme]
            mean = sum(stage_flops) / len(stage_flops)
            if mean and max(stage_flops) > critical[0]:
                critical = (max(stage_flops), max(stage_flops) / mean, s)
            for i in range(c.tp * c.dp):
                f, a, b = stage_flops[i], st.intra[scheme][i], st.inter[scheme][i]
                elem = (
                    st.elements[scheme][i] * ELEMENTWISE_BYTES["adamw" if scheme.startswith("adamw") else "muon"] / hbm
                )
                sync = st.sync_intra[scheme][i] / intra_bw + st.sync_inter[scheme][i] / inter_bw
                comm = a / intra_bw + b / inter_bw - sync
                own = elem + f / flop_rate + sync
                if scheme.startswith("ours"):
                    # Multi-rank NS collectives run inside the compute stage, blocking.
                    t = elem + _pipelined(comm / 2, f / flop_rate + sync, comm / 2, st.chunks.get(scheme, 1))
                else:
                    t = elem + f / flop_rate + comm
                slowest = per_stage[scheme][s]
                slowest["step_ms"] = max(slowest["step_ms"], t * 1e3)
                slowest["own_ms"] = max(slowest["own_ms"], own * 1e3)
                times.append(t)
                flops.append(f)
                intra.append(a)
                inter.append(b)
                ddp.append(st.ddp[scheme][i])
                buffers.append(st.buffers[scheme][i])
        total = sum(flops)
        rows[scheme] = dict(
            label=LABELS[scheme],
            ns_flops_total=total,
            ns_share_of_model=total / m.model_flops,
            ns_flops_max_rank=max(flops),
            imbalance=critical[1],
            busiest_stage=critical[2],
            intra_bytes_max_rank=max(intra),
            inter_bytes_max_rank=max(inter),
            ddp_bytes_max_rank=max(ddp),
            ddp_buffer_bytes_max_rank=max(buffers),
            step_ms=max(times) * 1e3,
            step_share_of_train=max(times) / train_step_s,
        )
    for row in rows.values():
        row["ratio"] = row["step_ms"] / rows["adamw"]["step_ms"]
    microbatches = max(m.global_batch // (c.dp * m.micro_batch), 1)
    return dict(
        model=m.name,
        active_params=m.active_params,
        tokens_per_step=m.tokens_per_step,
        model_flops=m.model_flops,
        train_step_ms=train_step_s * 1e3,
        cluster=asdict(c),
        layout=c.describe(m),
        schemes=rows,
        exposed=dict(
            exposed_step.exposure(per_stage["ours_exact"], train_step_s * 1e3, microbatches, c.mfu, c.ns_efficiency),
            stages=per_stage["ours_exact"],
        ),
    )


# ---------------------------------------------------------------------------------------
# Validation against the counted bytes of optimizer_step.py
# ---------------------------------------------------------------------------------------

TOLERANCE = 0.01
"""Relative difference allowed between modelled and counted bytes per step and kind. The
model leaves out only the scalar all-reduces (grad norm, zero count) of a few bytes, so
all-reduces are checked only where the model has some (Megatron's distributed mode)."""
KINDS = ("all_gather", "all_to_all", "all_reduce")


def validate(measured: Dict[str, Any]) -> Dict[str, Any]:
    """Model the tiny model of an ``optimizer_step.py`` result and compare the bytes per
    collective kind (mean per rank and step) inside ``optimizer.step()``, and DDP's
    reduce-scatter of the train step, with what was counted."""
    from megatron_muon.newton_schulz import method_for_device

    lay = measured["layout"]
    m = S.from_tiny(measured["model_spec"], measured["gbs"])
    c = Cluster(
        gpus=lay["world"],
        tp=lay["tp"],
        gpus_per_node=max(lay["world"], 1),
        overlap_grad_reduce=False,
        microbatches=measured["gbs"] // (measured["mbs"] * lay["dp"]),
        # The plan's cost weights depend on the iteration the counted run resolved ('auto' is
        # standard on a CPU), and with them which rank orthogonalizes what.
        muon=(("muon_ns_method", method_for_device("auto", measured["env"]["device"])),),
    )
    costs = stage_costs(m, c, 0)
    rows, worst = [], 0.0
    for scheme, peer in PEER_OF.items():
        if peer not in measured["peers"]:
            continue
        counted = measured["peers"][peer]
        model = {k: v / c.gpus for k, v in costs.by_kind[scheme].items()}
        pairs = [(f"step() {k}", model.get(k, 0.0), counted["step_bytes"]["per_rank_mean"].get(k, 0.0)) for k in KINDS]
        pairs.append(
            (
                "train step reduce_scatter",
                model.get("reduce_scatter", 0.0),
                counted["train_bytes"]["per_rank_mean"].get("reduce_scatter", 0.0),
            )
        )
        for what, mod, cnt in pairs:
            if mod == 0 and cnt == 0:
                continue
            err = abs(mod - cnt) / max(cnt, 1.0)
            checked = mod > 0 or not what.endswith("all_reduce")
            if checked:
                worst = max(worst, err)
            rows.append(dict(scheme=scheme, what=what, model=mod, counted=cnt, rel_err=err, checked=checked))
    return dict(
        rows=rows, max_rel_err=worst, tolerance=TOLERANCE, ok=worst <= TOLERANCE, source=measured["env"]["command"]
    )


# ---------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------


def _imbalance(row: Dict[str, Any], pp: int) -> Any:
    """NS max/mean, with the busiest stage named when there are several."""
    if pp == 1 or row.get("busiest_stage") is None:
        return row["imbalance"]
    return f"{row['imbalance']:.3f} (stage {row['busiest_stage']})"


def markdown(data: Dict[str, Any]) -> str:
    parts = [common.provenance(data["env"]), ""]
    for name, p in data["predictions"].items():
        c = p["cluster"]
        parts.append(
            f"**{name}** on {p['layout']} ({data['notes'].get(name, 'custom layout')}). "
            f"{p['active_params'] / 1e9:.2f} B active parameters, {p['tokens_per_step'] / 1e6:.2f} M tokens per step, "
            f"model {p['model_flops']:.3g} FLOP per step = {p['train_step_ms']:.0f} ms per train step at "
            f"{c['mfu']:.0%} MFU. Assumed: {c['peak_tflops']:.0f} TFLOP/s bf16 peak, NS at {c['ns_efficiency']:.0%} "
            f"of it, links {c['intra_gbps']:.0f} / {c['inter_gbps']:.0f} GB/s intra / inter node at "
            f"{c['link_efficiency']:.0%}.\n"
        )
        rows = [
            [
                r["label"],
                r["ns_flops_total"] / 1e12,
                r["ns_share_of_model"] * 100,
                r["ns_flops_max_rank"] / 1e12,
                _imbalance(r, c["pp"]),
                common.human_bytes(r["intra_bytes_max_rank"]),
                common.human_bytes(r["inter_bytes_max_rank"]),
                common.human_bytes(r["ddp_bytes_max_rank"]),
                common.human_bytes(r["ddp_buffer_bytes_max_rank"]),
                r["step_ms"],
                r["ratio"],
                r["step_share_of_train"] * 100,
            ]
            for r in p["schemes"].values()
        ]
        parts.append(
            common.md_table(
                [
                    "scheme",
                    "NS TFLOP/step (all GPUs)",
                    "NS % of model FLOPs",
                    "NS TFLOP max GPU",
                    "NS max/mean (busiest stage)",
                    "extra intra-node bytes (max GPU)",
                    "extra inter-node bytes (max GPU)",
                    "DDP RS+AG bytes (max GPU)",
                    "DDP grad+param buffers (max GPU)",
                    "opt. step ms (model)",
                    "/ AdamW",
                    "% of train step",
                ],
                rows,
            )
        )
        parts.append("")
    if all("exposed" in p for p in data["predictions"].values()):
        parts.append(
            "**Exposed step** (ours, exact): how long an iteration waits for the optimizer step with "
            "`muon_step_overlap` `none` (the step whole between the backward and the next forward) and "
            "`forward` (each layer's update finished as the next forward reaches it); the model is "
            "`tools/bench/exposed_step.py`'s (Megatron's 1F1B schedule; communication hides behind a stage's "
            "first forward; Newton–Schulz either nowhere or in the share of that forward the GPU's matrix "
            "units idle, 1 - MFU / NS efficiency).\n"
        )
        parts.append(exposed_step.markdown(data["predictions"]))
        parts.append("")
    v = data.get("validation")
    if v:
        rows = [
            [
                r["scheme"],
                r["what"],
                int(r["model"]),
                int(r["counted"]),
                r["rel_err"] * 100 if r["checked"] else "(not modelled)",
            ]
            for r in v["rows"]
        ]
        parts.append(
            f"**Validation** against the bytes `optimizer_step.py` counted (`{v['source']}`), mean per rank per step; "
            f"largest difference {v['max_rel_err'] * 100:.3f} % (tolerance {v['tolerance'] * 100:.0f} %). Not modelled: "
            "the scalar all-reduces of the grad norm and zero count, a few bytes per step.\n"
        )
        parts.append(common.md_table(["scheme", "bytes", "model", "counted", "difference %"], rows))
    return "\n".join(parts) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="accepted for run_all (the model is fast)")
    p.add_argument("--scenario", action="append", choices=sorted(SCENARIOS), help="default: all of them")
    p.add_argument("--recipe", help="a custom run: recipe name or path (with --gpus and the layout flags)")
    p.add_argument("--gpus", type=int)
    for flag in ("tp", "pp", "ep", "etp", "gpus-per-node"):
        p.add_argument(f"--{flag}", type=int)
    for flag in ("intra-gbps", "inter-gbps", "link-efficiency", "peak-tflops", "ns-efficiency", "hbm-gbps", "mfu"):
        p.add_argument(f"--{flag}", type=float)
    p.add_argument(
        "--validate",
        type=Path,
        nargs="?",
        const=common.DEFAULT_OUT / "optimizer_step.json",
        help="optimizer_step.py's JSON to check the bytes against (default: runs/bench/optimizer_step.json)",
    )
    p.add_argument("--out", type=Path, default=common.DEFAULT_OUT)
    p.add_argument("--name", default="scale_model")
    return p.parse_args(argv)


def _cluster_overrides(args: argparse.Namespace) -> Dict[str, Any]:
    names = (
        "gpus",
        "tp",
        "pp",
        "ep",
        "etp",
        "gpus_per_node",
        "intra_gbps",
        "inter_gbps",
        "link_efficiency",
        "peak_tflops",
        "ns_efficiency",
        "hbm_gbps",
        "mfu",
    )
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    overrides = _cluster_overrides(args)
    runs: Dict[str, Tuple[str, Cluster]] = {}
    notes = {}
    if args.recipe:
        if "gpus" not in overrides:
            raise SystemExit("--recipe needs --gpus (and the layout: --tp, --pp, --ep)")
        runs[Path(args.recipe).stem] = (args.recipe, Cluster(**overrides))
    else:
        for name in args.scenario or SCENARIOS:
            recipe, cluster, note = SCENARIOS[name]
            runs[name] = (recipe, replace(cluster, **overrides))
            notes[name] = note
    predictions = {}
    for name, (recipe, c) in runs.items():
        m = S.from_recipe(recipe, c.gpus, c.tp, c.pp, c.ep, c.etp)
        predictions[name] = predict(m, c)
    data: Dict[str, Any] = dict(env=common.environment("cpu"), notes=notes, predictions=predictions)
    if args.validate is not None:
        if args.validate.exists():
            data["validation"] = validate(json.loads(args.validate.read_text()))
        else:
            print(f"no {args.validate}: run optimizer_step.py first; skipping the validation")
    paths = common.write_outputs(args.out, args.name, data, markdown(data))
    for name, p in predictions.items():
        print(f"\n{name}: {p['layout']}")
        rows = [
            [
                r["label"],
                r["ns_share_of_model"] * 100,
                r["imbalance"],
                common.human_bytes(r["inter_bytes_max_rank"]),
                r["step_ms"],
                r["ratio"],
            ]
            for r in p["schemes"].values()
        ]
        print(common.text_table(["scheme", "NS % model", "NS max/mean", "inter-node B", "opt ms", "/ AdamW"], rows))
    if "validation" in data:
        v = data["validation"]
        print(
            f"\nvalidation: largest difference model vs counted {v['max_rel_err'] * 100:.3f} % "
            f"(tolerance {v['tolerance'] * 100:.0f} %): {'ok' if v['ok'] else 'OFF'}"
        )
    print(f"wrote {paths['json']} and {paths['markdown']}")
    return data


if __name__ == "__main__":
    from tools.bench.scale_model import main as _main

    _main()
