"""Owner-aligned DDP buffers (``megatron_muon.buffer_layout``): the packing's guarantees on
shapes alone, and on a real DP2 x TP2 model that Muon then sends nothing over DP."""

from __future__ import annotations

import pytest
import torch

from megatron_muon.testing import run_distributed
from megatron_muon.testing import models as M


def _meta_params(shapes):
    return [torch.nn.Parameter(torch.empty(s, device="meta")) for s in shapes]


def _layouts(shapes, dp, bucket_size=None, shards_per_node=1):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_muon.buffer_layout import owner_aligned_layout

    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    params = _meta_params(shapes)
    cost = lambda p: p.shape[0] * p.shape[1] * min(p.shape)  # noqa: E731 - NS FLOPs up to a constant
    ours = owner_aligned_layout(params, cost, bucket_size, dp, ddp, shards_per_node=shards_per_node)
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


def _count_step(layout: str):
    """Bytes by process-group kind of one optimizer step of ours on DP2 x TP2."""
    from megatron_muon.traffic import count_collectives
    from tests.test_optimizer import MBS, GBS, build

    spec = M.TinyModelSpec(kind="gqa")
    _, model, opt, _ = build(spec, muon_buffer_layout=layout)
    tokens = M.synthetic_batches(spec, GBS, 1)[0]
    for chunk in model:
        chunk.zero_grad_buffer()
    opt.zero_grad()
    M.forward_backward(model, tokens, MBS, spec)
    with count_collectives() as traffic:
        opt.step()
    return dict(kinds=dict(traffic.bytes), groups=dict(traffic.by_group), owner=opt.muon_optimizers[0].owner_layout)


@pytest.mark.timeout(300)
def test_owner_layout_sends_muon_pieces_only_inside_the_tp_group():
    owner, megatron = (run_distributed(_count_step, 4, layout, tp=2, timeout_s=250) for layout in ("owner", "megatron"))
    for r in owner:
        assert r["owner"]
        # Over DP only Megatron's parameter all-gather; every Muon piece moves inside TP.
        assert r["groups"].get("dp", 0) == r["kinds"].get("all_gather", 0)
        assert r["groups"].get("tp", 0) == r["kinds"].get("all_to_all", 0) > 0
    assert not megatron[0]["owner"]
    assert sum(r["groups"].get("dp", 0) for r in megatron) > sum(r["groups"].get("dp", 0) for r in owner)
