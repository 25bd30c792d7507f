"""A rank's flat range of a parameter as boxes in model coordinates (checkpoint/ranges.py),
checked against the flat indices themselves."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from megatron_muon.checkpoint.ranges import flat_range_boxes, range_pieces


def _indices(shape):
    return torch.arange(torch.Size(shape).numel()).view(shape)


@pytest.mark.parametrize("shape", [(7,), (3, 5), (4, 3, 5), (2, 1, 3, 4)])
def test_the_boxes_of_a_range_are_the_range_in_flat_order(shape):
    full = _indices(shape)
    numel = full.numel()
    for start, end in itertools.combinations(range(numel + 1), 2):
        boxes = flat_range_boxes(shape, start, end)
        assert len(boxes) <= 2 * len(shape) - 1
        got = []
        for run_start, (offset, size) in boxes:
            values = full[tuple(slice(o, o + n) for o, n in zip(offset, size))].reshape(-1)
            assert values[0].item() == run_start  # each box is a contiguous run
            got.append(values)
        assert torch.equal(torch.cat(got), torch.arange(start, end)), (shape, start, end)
    assert flat_range_boxes(shape, 3, 3) == []


def _transposed_experts(key, data, replica_id, flattened_range):
    """A fused (6, 5) weight of 2 experts read as GroupedMLP reads its own: each expert a
    transposed view, (5, 3), at its place on a prepended expert axis."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    views = data.view(2, 3, 5).transpose(1, 2)
    return [ShardedTensor.from_rank_offsets(key, views[e], (0, e, 2), replica_id=replica_id, prepend_axis_num=1)
            for e in range(2)]  # fmt: skip


def _model_entry(shape, kind):
    """The model's ShardedTensor for a parameter of ``shape`` at TP rank 1 of 2 along axis 0,
    Megatron's SwiGLU factory over it, or a factory of transposed expert views."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    data = torch.zeros(shape)
    if kind == "experts":
        return ShardedTensorFactory("w", data, _transposed_experts, None, (0, 0, 1))
    sh = ShardedTensor.from_rank_offsets("w", data, (0, 1, 2), replica_id=(0, 0, 1))
    return apply_swiglu_sharded_factory(sh, ()) if kind == "swiglu" else sh


@pytest.mark.parametrize("kind", ["plain", "swiglu", "experts"])
def test_the_pieces_of_a_range_land_where_the_model_puts_the_parameter(kind):
    """Every element of every range lands once, where Megatron's own (whole-tensor) pieces
    put it in the global tensor; the data-parallel replica coordinate becomes 0."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    shape = (6, 5)
    entry = _model_entry(shape, kind)
    values = torch.arange(30, dtype=torch.float32).view(shape) + 100
    global_shape = (2, 5, 3) if kind == "experts" else (12, 5)
    reference = torch.full(global_shape, float("nan"))
    whole = [entry] if kind == "plain" else entry.build_fn(entry.key, values, entry.replica_id, None)
    for t in nested_values(whole):
        data = values if kind == "plain" else t.data
        reference[t.global_slice()] = data.reshape(reference[t.global_slice()].shape)
    assert int((~torch.isnan(reference)).sum()) == 30
    rng = random.Random(0)
    for _ in range(50):
        start = rng.randrange(30)
        end = rng.randrange(start + 1, 31)
        got = torch.full(global_shape, float("nan"))
        flat = values.reshape(-1)[start:end]
        back = torch.full((end - start,), float("nan"))
        for piece in range_pieces(entry, shape, start, end):
            st = piece.sharded_tensor("optimizer.state.param.w", piece.take(flat))
            assert st.replica_id == (0, 0, 0) and st.axis_fragmentations is None
            assert torch.isnan(got[st.global_slice()]).all()
            got[st.global_slice()] = st.data
            piece.put(back, st.data)
        placed = ~torch.isnan(got)
        assert int(placed.sum()) == end - start
        assert torch.equal(got[placed], reference[placed])
        assert set(got[placed].tolist()) == set(flat.tolist())
        assert torch.equal(back, flat)  # a load puts each piece back where the save took it


@pytest.mark.parametrize("kind", ["plain", "swiglu", "experts"])
def test_a_saved_box_is_its_own_storage_so_megatrons_writer_copies_nothing(kind):
    """Megatron-core's CPU writer clones a tensor whose storage is larger than it
    (``filesystem_async._clone_or_dequantize_if_needed``): every box a save hands it owns
    exactly its elements, in the rank's own memory where the box is a contiguous run of it,
    and ``torch.save`` writes those elements alone."""
    import io

    shape = (6, 5)
    entry = _model_entry(shape, kind)
    values = torch.arange(30, dtype=torch.float32) + 100
    rng = random.Random(1)
    ranges = [(0, 30), (0, 15), (15, 30), (4, 27)] + [tuple(sorted(rng.sample(range(31), 2))) for _ in range(20)]
    for start, end in ranges:
        flat = values[start:end]
        for piece in range_pieces(entry, shape, start, end):
            box = piece.take(flat)
            assert box.untyped_storage().nbytes() == box.numel() * box.element_size()
            if piece._view(flat).is_contiguous():
                assert box.data_ptr() == piece._view(flat).data_ptr()  # not a copy
            written = io.BytesIO()
            torch.save(box, written)
            assert len(written.getvalue()) < 2048 + box.numel() * 4
            assert torch.equal(torch.load(io.BytesIO(written.getvalue())), box)
