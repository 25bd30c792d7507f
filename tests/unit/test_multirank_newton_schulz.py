"""Multi-rank Newton–Schulz (``megatron_muon.multirank_newton_schulz``) on shapes alone: the
Gram matrix's packed upper triangle, the block step and its FLOPs, where a matrix goes
(``place_multirank_jobs``) and when spreading it pays (``MultirankCost`` weighs the blocking
bytes, priced per link class, against the FLOPs saved)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_muon import MuonConfig
from megatron_muon.multirank_newton_schulz import (
    GRAM_ROW_BLOCKS,
    MultirankCost,
    _gram_row_blocks,
    _pack_upper,
    _unpack_symmetric,
    block_step,
    gram_upper_numel,
    member_flops,
    multirank_traffic,
    place_multirank_jobs,
)
from megatron_muon.planner import plan_statistics
from megatron_muon.testing.synthetic import ParamShape, synthetic_plan

FREE = dict(muon_ns_intra_node_flops_per_byte=0.0, muon_ns_inter_node_flops_per_byte=0.0)


def _plan(shapes, hidden, dp, gpus_per_node=None, **cfg):
    """The plan with standard Newton–Schulz on one rank (what these cases were priced
    against; Gram NS by aspect ratio, the default on a GPU, makes the wide ones cheaper)."""
    model = SimpleNamespace(gated_linear_unit=False, hidden_size=hidden)
    return synthetic_plan(
        shapes, model, MuonConfig(lr=1e-3, **{"muon_ns_method": "standard", **cfg}), 1, dp, gpus_per_node
    )


def _bound(plan, cost: MultirankCost) -> float:
    return max(cost.rank_flops(plan.jobs, plan.loads, 5, plan.group))


def test_small_matrices_stay_on_one_rank_at_real_link_speeds():
    # fc1 / fc2 exceed a rank's mean load, but their all-reduces take longer than the FLOPs
    # saved. (Twice as wide, 4096 x 256 now pays: only the Gram matrix's upper triangle is
    # all-reduced, 5.03 GFLOP-equivalent over 8 ranks against 5.54 whole.)
    shapes = [
        ParamShape("fc1", (2048, 256), parent_attr="linear_fc1"),
        ParamShape("fc2", (256, 1024), parent_attr="linear_fc2"),
    ]
    shapes += [ParamShape(f"proj{i}", (256, 256), parent_attr="linear_proj") for i in range(8)]
    assert plan_statistics(_plan(shapes, 256, 16, **FREE))["multirank_jobs"] == {"fc1": 8, "fc2": 4}
    assert plan_statistics(_plan(shapes, 256, 16))["multirank_jobs"] == {}


def test_large_matrix_spread_where_it_shortens_the_step():
    # DeepSeek-V3's dense fc1 (36864 x 7168, ~42 TFLOP) among small matrices on 16 ranks.
    shapes = [ParamShape("fc1", (36864, 7168), parent_attr="linear_fc1")]
    shapes += [ParamShape(f"proj{i}", (7168, 1024), parent_attr="linear_proj") for i in range(12)]
    cfg = MuonConfig(lr=1e-3)
    priced = MultirankCost(cfg.muon_ns_intra_node_flops_per_byte, cfg.muon_ns_inter_node_flops_per_byte)
    one_node = _plan(shapes, 7168, 16, gpus_per_node=8)
    unsplit = _plan(shapes, 7168, 16, gpus_per_node=8, muon_ns_max_ranks=1)
    flops_only = _plan(shapes, 7168, 16, gpus_per_node=8, **FREE)
    assert plan_statistics(one_node)["multirank_jobs"] == {"fc1": 8}
    # The chosen plan's busiest rank (FLOPs + FLOP-equivalent bytes) is the lowest.
    assert _bound(one_node, priced) < _bound(unsplit, priced)
    assert _bound(one_node, priced) <= _bound(flops_only, priced)
    # Every rank on its own node: the all-reduces cross the NIC, ~9x slower; the rule
    # still never does worse than leaving the matrix whole.
    spread = _plan(shapes, 7168, 16, gpus_per_node=1)
    assert _bound(spread, priced) <= _bound(_plan(shapes, 7168, 16, gpus_per_node=1, muon_ns_max_ranks=1), priced)
    assert _bound(spread, priced) > _bound(one_node, priced)


def test_link_prices_are_validated():
    with pytest.raises(ValueError, match="muon_ns_inter_node_flops_per_byte"):
        MuonConfig(lr=1e-3, muon_ns_inter_node_flops_per_byte=-1.0)


def _job(index, shape, holders, shard):
    """A job whose matrix lies in equal ``shard``-element ranges of the DP ranks ``holders``
    (TP1: group rank = DP rank), as owner-aligned buffers lay out a matrix larger than a shard."""
    from megatron_muon.newton_schulz import newton_schulz_flops
    from megatron_muon.planner import Job, Segment

    segs = [Segment(0, d, i * shard, (i + 1) * shard, i * shard) for i, d in enumerate(holders)]
    matrix = SimpleNamespace(shape=shape, ns_shape=shape, column_groups=1, name=f"m{index}")
    return Job(
        index=index,
        param_index=index,
        matrix=matrix,
        sources=segs,
        dests=segs,
        owner_tp=None,
        flops=newton_schulz_flops(*shape, 5),
    )


def test_multirank_block_is_the_one_holding_most_of_the_matrix():
    # 16 DP ranks in two nodes of 8 (aligned blocks 0-7 and 8-15). The big matrix lies on
    # ranks 5..15: 3 shards in the first block, 8 in the second. Both blocks are idle, so
    # the matrix goes to the second: its 8 shards never leave the block (the node), only 3
    # cross, where the first block would have pulled 8 in and sent 8 back.
    from megatron_muon.process_groups import OrthoGroup

    group = OrthoGroup(group=None, rank=0, size=16, coords=[(0, d) for d in range(16)], tp_size=1, dp_size=16)
    big = _job(0, (4096, 11 * 64), list(range(5, 16)), 4096 * 64)
    small = [_job(i, (64, 64), [i % 16], 64 * 64) for i in range(1, 9)]
    place_multirank_jobs([big] + small, group, 8, 5, True)
    assert sorted(big.ns_ranks) == list(range(8, 16)), big.ns_ranks
    assert big.owner == big.ns_ranks[0] and big.owner in range(8, 16)
    assert all(not j.ns_ranks for j in small)


@pytest.mark.parametrize("k", [1, 3, 16, 17, 64, 130])
def test_packed_upper_triangle_rebuilds_the_gram_matrix(k):
    X = torch.randn(k, 3 * k + 1, generator=torch.Generator().manual_seed(k), dtype=torch.float64)
    A = X @ X.mT
    packed = _pack_upper(A)
    assert packed.numel() == gram_upper_numel(k)
    rebuilt = _unpack_symmetric(packed, k)
    for start, end in _gram_row_blocks(k):  # sent as computed: the diagonal block and right of it
        assert torch.equal(rebuilt[start:end, start:], A[start:end, start:])
        assert torch.equal(rebuilt[start:end, :start], A[:start, start:end].mT)  # mirrored
    assert torch.allclose(rebuilt, A, rtol=1e-12, atol=1e-12)
    # The sum of packed partials is the packed sum: what the all-reduce relies on.
    Y = torch.randn(k, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    both = _unpack_symmetric(_pack_upper(A) + _pack_upper(Y @ Y.mT), k)
    assert torch.allclose(both, A + Y @ Y.mT, rtol=1e-12, atol=1e-12)


def test_upper_triangle_is_about_half_of_the_matrix():
    k = 7168  # DeepSeek-V3's hidden size: the attention out-projection's short side
    n = GRAM_ROW_BLOCKS
    assert gram_upper_numel(k) == k * k * (n + 1) // (2 * n)
    full = 5 * 2 * 7 * k * k * 4 // 8  # five steps of a ring all-reduce of the whole fp32 A over 8 ranks
    assert multirank_traffic(7168, 16384, 5, 8, 2)["all_reduce"] / full == pytest.approx((n + 1) / (2 * n), rel=1e-6)


@pytest.mark.parametrize("k,width", [(48, 12), (48, 48), (12, 48)])
def test_block_step_is_the_polynomial_and_member_flops_counts_it(k, width):
    # A narrow block (width < k) takes b (A X) + c A (A X), a wide one forms A A first: the
    # same polynomial, and member_flops counts the matmuls each one runs.
    from torch.utils.flop_counter import FlopCounterMode

    gen = torch.Generator().manual_seed(k + width)
    X = torch.randn(k, width, generator=gen, dtype=torch.float64) / 10
    A = torch.randn(k, k, generator=gen, dtype=torch.float64) / 10
    A = A + A.mT
    a, b, c = 3.4445, -4.7750, 2.0315
    expected = a * X + (b * A + c * A @ A) @ X
    assert torch.allclose(block_step(X, A, a, b, c), expected, rtol=1e-12, atol=1e-12)

    ranks, steps = 4, 3
    with FlopCounterMode(display=False) as counter:
        for _ in range(steps):
            A = X @ X.mT  # the member's Gram matrix (the all-reduce adds no FLOPs)
            X = block_step(X, A, a, b, c)
    assert counter.get_total_flops() == member_flops(k, width * ranks, steps, ranks)
