"""``state.ChunkStaging``, the CPU offload's staging of pool ranges chunk by chunk, on the
CPU (where the copies run in place, in order): every chunk sees its own ranges' values,
what the step writes into them reaches the pool, a buffer is reused only after its chunk
went back, and a chunk taken out of order is refused (its buffer holds another chunk's
values). The CUDA streams and events are checked by tests/cuda."""

from __future__ import annotations

import pytest
import torch

from megatron_muon.state import ChunkStaging

POOL = torch.arange(20, dtype=torch.float32)
RANGES = [[(0, 0, 5), (2, 6, 8)], [(0, 5, 12)], [(2, 0, 6)]]
"""Three chunks' ranges (disjoint, as the plan's update pieces are): 7, 7 and 6 elements."""


def _views():
    """A pool and its views: param 0's values are its first 12 elements, param 2's the last
    8; param 1 is not staged."""
    pool = POOL.clone()
    return pool, {"x": [pool[0:12], None, pool[12:20]]}


@pytest.mark.parametrize("buffers", [1, 2])
def test_each_chunk_sees_its_ranges_and_its_writes_reach_the_pool(buffers):
    pool, views = _views()
    staging = ChunkStaging(views, RANGES, torch.device("cpu"), buffers=buffers)
    staging.begin()
    assert staging.device_bytes == buffers * 7 * 4  # each buffer sized for the largest chunk
    for index, ranges in enumerate(RANGES):
        staged = staging.fetch(index)["x"]
        want = [views["x"][p][s:e] for p, s, e in ranges]
        assert [t.tolist() for t in staged] == [t.tolist() for t in want], index
        assert all(t.data_ptr() != w.data_ptr() for t, w in zip(staged, want))  # copies, not the pool
        for t in staged:
            t.mul_(-1.0)
        staging.release(index)
    staging.finish()
    assert staging.device_bytes == 0 and staging.peak_device_bytes == buffers * 7 * 4
    assert pool.tolist() == [-v for v in POOL.tolist()]  # every element staged once, written back


def test_a_chunk_taken_out_of_order_is_refused():
    _, views = _views()
    staging = ChunkStaging(views, RANGES, torch.device("cpu"), buffers=2)
    staging.begin()
    with pytest.raises(RuntimeError, match="chunk 2 taken out of order"):
        staging.fetch(2)  # not fetched yet: chunk 0's buffer
