"""The planner's near-linear cutting and owner assignment (issue 51) give the plan the
straightforward algorithm gives: every block against every DP rank's range, every group
rank tried for every job, the jobs cut afresh for each candidate plan. That algorithm is
kept here, and only here, as the oracle; plans are compared by everything they hold
(fingerprint: owners, multi-rank members, every segment; chunk order; loads)."""

import random
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from megatron_muon import planner
from megatron_muon.config import MuonConfig
from megatron_muon.matrices import MuonParam, ParamContext, logical_matrices
from megatron_muon.multirank_newton_schulz import MultirankCost, place_multirank_jobs
from megatron_muon.planner import DpBounds, Segment, build_plan, cut_chunks
from megatron_muon.process_groups import OrthoGroup
from megatron_muon.testing.synthetic import ShapeOnlyLinear

# ---------------------------------------------------------------------------------------
# The oracle: the planner before issue 51 (quadratic in the ranks), restated.
# ---------------------------------------------------------------------------------------


def oracle_segments(matrix, dp_ranges, tps):
    out = []
    for tp, blocks in matrix.pieces:
        if tp not in tps:
            continue
        piece_offset = 0
        for block in blocks:
            b_start, b_end = block.offset, block.offset + block.numel
            for dp, (lo, hi) in enumerate(dp_ranges):
                start, end = max(b_start, lo), min(b_end, hi)
                if end > start:
                    out.append(Segment(tp, dp, start, end, piece_offset + start - b_start))
            piece_offset += block.numel
    return out


def oracle_assign(jobs, group, chunk_numel, owner_aligned, loads):
    chunks = cut_chunks(jobs, chunk_numel)
    loads = list(loads)

    def may_own(job, r):
        tp, dp = group.coords[r]
        if job.owner_tp is not None and tp != job.owner_tp:
            return False
        return not owner_aligned or any(seg.dp == dp for seg in job.sources + job.dests)

    allowed = {job.index: [r for r in range(group.size) if may_own(job, r)] for job in jobs}
    order = [job for chunk in chunks for job in sorted(chunk.jobs, key=lambda j: (-j.flops, j.index)) if job.owner < 0]
    mean = (sum(loads) + sum(job.flops for job in order)) / group.size
    for job in order:
        held = job.held_elements(group)
        holder = min(allowed[job.index], key=lambda r: (-held.get(r, 0), loads[r], r))
        if held.get(holder, 0) > 0 and loads[holder] + job.flops <= mean:
            job.owner = holder
            loads[holder] += job.flops
    for job in order:
        if job.owner < 0:
            job.owner = min(allowed[job.index], key=lambda r: (loads[r], r))
            loads[job.owner] += job.flops
    return chunks, loads


def oracle_plan(params, dp_ranges, group, tp_mode, ns_steps, chunk_numel, owner_aligned, ns_max_ranks, cost):
    """``build_plan`` with the jobs cut afresh (by :func:`oracle_segments`) for every candidate."""
    best = None
    for candidate in [None] if ns_max_ranks < 2 else [None, MultirankCost(0.0, 0.0), cost]:
        with mock.patch.object(planner, "segments", lambda m, ranges, tps, bounds: oracle_segments(m, ranges, tps)):
            jobs = planner.make_jobs(params, dp_ranges, group.tp_size, tp_mode, ns_steps)
        loads = place_multirank_jobs(
            jobs, group, 1 if candidate is None else ns_max_ranks, ns_steps, owner_aligned, candidate
        )
        chunks, loads = oracle_assign(jobs, group, chunk_numel, owner_aligned, loads)
        bound = max(cost.rank_flops(jobs, loads, ns_steps, group), default=0.0)
        if best is None or bound < best[0]:
            best = (bound, jobs, chunks, loads)
    return best[1:]


# ---------------------------------------------------------------------------------------
# Shapes and uneven ranges
# ---------------------------------------------------------------------------------------

MODEL = SimpleNamespace(gated_linear_unit=True, hidden_size=64)


def muon_params(tp_size, tp_mode, layers=3):
    """Per layer column- and row-parallel weights, a replicated one, a gated fc1 split into
    gate and up (two blocks per piece), of uneven sizes."""
    config = MuonConfig(lr=1e-3, muon_tp_mode=tp_mode, muon_split_glu=True)
    specs = [
        ("qkv", (48 // tp_size * 2, 64), 0, "linear_qkv_plain"),
        ("proj", (64, 96 // tp_size), 1, "linear_proj"),
        ("fc1", (2 * 80 // tp_size, 64), 0, "linear_fc1"),
        ("fc2", (64, 80 // tp_size), 1, "linear_fc2"),
        ("router", (24, 64), None, "router"),
        ("big", (256 // tp_size, 192), 0, "linear_big"),
    ]
    out = []
    for name, shape, dim, parent_attr in [(f"{i}.{n}", *rest) for i in range(layers) for n, *rest in specs]:
        param = torch.nn.Parameter(torch.empty(shape, device="meta"))
        if dim is not None and tp_size > 1:
            param.tensor_model_parallel, param.partition_dim = True, dim
        ctx = ParamContext(name, param, ShapeOnlyLinear(), "weight", None, parent_attr, MODEL, config, tp_size)
        out.append(MuonParam(0, name, param, logical_matrices(ctx)))
    return out


def uneven_ranges(params, dp_size, rng, gap_ranks=0):
    """The params one after another in one flat buffer cut at random points into ``dp_size``
    ranges (``gap_ranks`` of them empty): each param's part of each rank's range, (0, 0)
    where the rank holds none of it."""
    sizes = [mp.param.numel() for mp in params]
    total = sum(sizes)
    cuts = rng.sample(range(1, total), dp_size - 1 - gap_ranks)
    cuts = sorted(cuts + rng.sample(cuts, gap_ranks))  # repeated cuts: ranks holding nothing
    bounds = [0] + cuts + [total]
    ranges, start = {}, 0
    for p, size in enumerate(sizes):
        per_rank = []
        for r in range(dp_size):
            lo, hi = max(bounds[r], start), min(bounds[r + 1], start + size)
            per_rank.append((lo - start, hi - start) if hi > lo else (0, 0))
        ranges[p] = per_rank
        start += size
    return ranges


def group_of(tp_size, dp_size, per_node=4):
    coords = [(t, d) for d in range(dp_size) for t in range(tp_size)]
    nodes = tuple(r // per_node for r in range(len(coords)))
    return OrthoGroup(None, 0, len(coords), coords, tp_size, dp_size, nodes)


CASES = [
    # tp, dp, tp_mode, owner_aligned, ns_max_ranks, chunk_numel, ranks holding nothing
    (1, 7, "exact", False, 1, 10**9, 0),
    (1, 16, "exact", True, 4, 20_000, 3),
    (2, 5, "exact", False, 4, 9_000, 1),
    (2, 6, "blockwise", True, 1, 30_000, 0),
    (4, 3, "duplicated", False, 2, 10**9, 0),
    (4, 9, "exact", True, 8, 15_000, 2),
    (2, 4, "blockwise", False, 1, 10**9, 1),
    (4, 2, "duplicated", False, 1, 5_000, 0),
]


@pytest.mark.parametrize("tp,dp,tp_mode,aligned,max_ranks,chunk_numel,gaps", CASES)
def test_plan_equals_the_quadratic_oracle(tp, dp, tp_mode, aligned, max_ranks, chunk_numel, gaps):
    rng = random.Random(tp * 100 + dp)
    params = muon_params(tp, tp_mode)
    ranges = uneven_ranges(params, dp, rng, gaps)
    group = group_of(tp, dp)
    cost = MultirankCost(3.0, 40.0)
    plan = build_plan(params, ranges, group, tp_mode, 5, chunk_numel, aligned, "standard", max_ranks, cost)
    jobs, chunks, loads = oracle_plan(params, ranges, group, tp_mode, 5, chunk_numel, aligned, max_ranks, cost)
    expected = type(plan)(params=params, jobs=jobs, chunks=chunks, group=group, loads=loads)
    assert plan.fingerprint() == expected.fingerprint()
    assert [[j.index for j in c.jobs] for c in plan.chunks] == [[j.index for j in c.jobs] for c in chunks]
    assert plan.loads == loads
    assert [(j.owner, j.ns_ranks, j.flops) for j in plan.jobs] == [(j.owner, j.ns_ranks, j.flops) for j in jobs]
    # The cases mean something: segments cut at DP bounds, owners spread, multi-rank jobs made.
    assert any(len({s.dp for s in j.sources}) > 1 for j in plan.jobs)
    assert len({j.owner for j in plan.jobs}) > 1
    if max_ranks >= 4 and tp_mode == "exact":
        assert any(j.ns_ranks for j in plan.jobs)


def test_bounds_find_every_overlap_in_dp_order():
    rng = random.Random(7)
    for trial in range(300):
        dp = rng.randint(1, 12)
        if trial % 3 == 0:  # overlapping ranges (no layout makes them): the scan
            ranges = [tuple(sorted(rng.sample(range(0, 60), 2))) for _ in range(dp)]
        else:
            cuts = sorted(rng.choices(range(0, 60), k=dp + 1))
            ranges = [(a, b) if b > a else (0, 0) for a, b in zip(cuts, cuts[1:])]
            rng.shuffle(ranges)  # DP order need not follow the storage order
        bounds = DpBounds(ranges)
        for _ in range(10):
            start = rng.randint(0, 60)
            end = start + rng.randint(0, 20)
            expected = [(dp_, max(start, lo), min(end, hi)) for dp_, (lo, hi) in enumerate(ranges)]
            assert bounds.overlaps(start, end) == [c for c in expected if c[2] > c[1]]
