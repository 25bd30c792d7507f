"""Owner-aligned DDP buffers (``megatron_muon.buffer_layout``): the packing's guarantees on
shapes alone (the traffic on a real model is in ``tests/dist/test_buffer_layout_traffic.py``)."""

from __future__ import annotations

import pytest
import torch


def _meta_params(shapes):
    return [torch.nn.Parameter(torch.empty(s, device="meta")) for s in shapes]


def _layouts(shapes, dp, bucket_size=None, shards_per_node=1):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_muon.buffer_layout import owner_aligned_buffer_layout

    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    params = _meta_params(shapes)
    cost = lambda p: p.shape[0] * p.shape[1] * min(p.shape)  # noqa: E731 - NS FLOPs up to a constant
    ours = owner_aligned_buffer_layout(params, cost, bucket_size, dp, ddp, shards_per_node=shards_per_node)
    megatron = DistributedOptimizer._compute_per_buffer_param_layout(params, bucket_size, dp, ddp)
    return params, ours, megatron


def _holders(layout, param, dp):
    start, end, bucket = layout.param_index_map[param]
    b_start, b_end = layout.bucket_indices[bucket]
    shard = (b_end - b_start) // dp
    return sorted({(i - b_start) // shard for i in (start, end - 1)}), shard


# Transformer-like stacks: many similar matrices, a few large ones.
STACKS = {
    "llama-like": [(1536, 512), (512, 512), (2048, 512), (512, 1024)] * 8,
    "moe-experts": [(704, 256), (256, 352)] * 40,
    "one-large": [(4096, 1024)] + [(256, 256), (512, 256)] * 20,
}


@pytest.mark.parametrize("stack", sorted(STACKS))
@pytest.mark.parametrize("dp", [2, 8])
def test_params_whole_in_a_shard_and_padding_bounded(stack, dp):
    params, ours, megatron = _layouts(STACKS[stack], dp)
    for b_start, b_end in ours.bucket_indices:
        assert (b_end - b_start) % dp == 0
    for p in params:
        holders, shard = _holders(ours, p, dp)
        if p.numel() <= shard:
            assert len(holders) == 1, f"{tuple(p.shape)} straddles shards {holders} (shard {shard})"
    # Offsets never overlap.
    spans = sorted(ours.param_index_map[p][:2] for p in params)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert ours.bucket_indices[-1][1] <= 1.05 * megatron.bucket_indices[-1][1]


def test_a_param_larger_than_a_shard_straddles_inside_one_node():
    params, ours, _ = _layouts([(256, 256)] * 40 + [(3072, 1024)] + [(256, 256)] * 40, dp=8, shards_per_node=4)
    big = params[40]
    holders, shard = _holders(ours, big, 8)
    assert big.numel() > shard
    assert holders[0] // 4 == holders[-1] // 4, holders
