"""Where split Newton–Schulz puts a matrix that straddles many DP shards
(``megatron_muon.split_newton_schulz.place_split_jobs``), on shapes alone."""

from __future__ import annotations

from types import SimpleNamespace


def _job(index, shape, holders, shard):
    """A job whose matrix lies in equal ``shard``-element ranges of the DP ranks ``holders``
    (TP1: group rank = DP rank), as owner-aligned buffers lay out a matrix larger than a shard."""
    from megatron_muon.newton_schulz import newton_schulz_flops
    from megatron_muon.planner import Job, Segment

    segs = [Segment(0, d, i * shard, (i + 1) * shard, i * shard) for i, d in enumerate(holders)]
    matrix = SimpleNamespace(shape=shape, ns_shape=shape, column_groups=1, name=f"m{index}")
    return Job(index=index, param_index=index, matrix=matrix, sources=segs, dests=segs, owner_tp=None,
               flops=newton_schulz_flops(*shape, 5))


def test_split_block_is_the_one_holding_most_of_the_matrix():
    # 16 DP ranks in two nodes of 8 (aligned blocks 0-7 and 8-15). The big matrix lies on
    # ranks 5..15: 3 shards in the first block, 8 in the second. Both blocks are idle, so
    # the split goes to the second: its 8 shards never leave the block (the node), only 3
    # cross, where the first block would have pulled 8 in and sent 8 back.
    from megatron_muon.planner import OrthoGroup
    from megatron_muon.split_newton_schulz import place_split_jobs

    group = OrthoGroup(group=None, rank=0, size=16, coords=[(0, d) for d in range(16)], tp_size=1, dp_size=16)
    big = _job(0, (4096, 11 * 64), list(range(5, 16)), 4096 * 64)
    small = [_job(i, (64, 64), [i % 16], 64 * 64) for i in range(1, 9)]
    place_split_jobs([big] + small, group, 8, 5, True)
    assert sorted(big.split) == list(range(8, 16)), big.split
    assert big.owner == big.split[0] and big.owner in range(8, 16)
    assert all(not j.split for j in small)
