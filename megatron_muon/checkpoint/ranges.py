"""A rank's range of a parameter as boxes in model coordinates, for torch_dist.

The distributed optimizer gives each data-parallel rank one contiguous range of every
TP-local parameter (in its flattened, row-major order), often the whole parameter or none
of it. Megatron-core's ``dist_checkpointing`` (0.19) no longer takes a flattened range
(``ShardedTensor.flattened_range`` is refused), but it takes uneven shards: any box of the
global tensor, several per rank (``axis_fragmentations=None``), handed to torch DCP as they
are. A flat range ``[start, end)`` of an n-d tensor is at most ``2n - 1`` boxes, each a
contiguous run of the flat order (a partial row, whole rows, a partial row, recursively).
Each box is then placed in the global tensor as the model's own ``ShardedTensor`` places
the parameter: its offsets, its TP / PP / EP position, and, where Megatron builds the
pieces with a ``ShardedTensorFactory`` (SwiGLU's gate and up halves), each piece the
factory cuts, found by running the factory on a ``meta`` tensor (no memory) and reading
where each view it returns starts.

So a save needs no communication: every rank writes the boxes of its own range, and the
checkpoint holds the same global tensors under the same keys as one written whole (DCP
reassembles any tiling, so a load at another TP / PP / EP / DP layout reads its own boxes
from whatever chunks were written, including a checkpoint of the first format, whose
chunks were whole TP-local tensors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Sequence, Tuple

import torch

from .errors import CheckpointError

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]
"""(offset, shape) of a box in a tensor's coordinates."""


def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> List[Tuple[int, Box]]:
    """``[start, end)`` of a row-major tensor of ``shape`` as boxes, each a contiguous run
    of the flat order: ``[(flat start, (offset, box shape)), ...]`` in flat order."""
    shape = tuple(shape)
    if start >= end:
        return []
    if not shape:
        return [(start, ((), ()))]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    first, last = start // inner, (end - 1) // inner
    if first == last:  # within one row of the first axis: recurse into it
        return [
            (first * inner + s, ((first, *o), (1, *b)))
            for s, (o, b) in flat_range_boxes(shape[1:], start - first * inner, end - first * inner)
        ]
    out: List[Tuple[int, Box]] = []
    whole_from, whole_to = -(-start // inner), end // inner
    if start % inner:
        out += flat_range_boxes(shape, start, whole_from * inner)
    if whole_to > whole_from:
        out.append((whole_from * inner, ((whole_from, *(0,) * (len(shape) - 1)), (whole_to - whole_from, *shape[1:]))))
    if end % inner:
        out += flat_range_boxes(shape, whole_to * inner, end)
    return out


@dataclass(frozen=True)
class Placement:
    """One piece of a parameter in a checkpoint tensor: the model's ``ShardedTensor`` for it,
    without data, and the piece as a strided view of the parameter's flat storage."""

    key: str
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    """The piece's first element, in the checkpoint tensor (prepended axes included)."""
    prepend: int
    offset: int
    """The piece's first element in the parameter's flat order."""
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]
    replica_id: Any
    allow_shape_mismatch: bool

    def _order(self) -> List[int]:
        """The piece's axes (those longer than 1) by decreasing stride: in that order its
        elements run through the parameter's flat order increasingly (checked)."""
        order = sorted((d for d, n in enumerate(self.shape) if n > 1), key=lambda d: -self.strides[d])
        for outer, inner in zip(order, order[1:]):
            if self.strides[outer] < self.strides[inner] * self.shape[inner]:
                raise CheckpointError(
                    f"{self.key}: Megatron's piece of this parameter overlaps itself; its optimizer "
                    "state cannot be saved by range"
                )
        return order

    def before(self, flat: int) -> int:
        """How many of the piece's elements come before ``flat`` in the parameter's flat order."""
        rem, count = flat - self.offset, 0
        order = self._order()
        for i, d in enumerate(order):
            if rem <= 0:
                return count
            inner = math.prod(self.shape[e] for e in order[i + 1 :])
            q = rem // self.strides[d] if i < len(order) - 1 else -(-rem // self.strides[d])
            if q >= self.shape[d]:
                return count + self.shape[d] * inner
            count += q * inner
            rem -= q * self.strides[d]
        return count + (1 if not order and rem > 0 else 0)


def _pieces(model_entry: Any, shape: Tuple[int, ...]) -> List[Placement]:
    """The pieces the model's ``ShardedTensor`` or ``ShardedTensorFactory`` cuts a
    parameter of ``shape`` into (one, unless a factory splits or reorders it)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    whole = torch.empty(shape, dtype=torch.float32, device="meta")
    if isinstance(model_entry, ShardedTensorFactory):
        built = list(nested_values(model_entry.build_fn(model_entry.key, whole, model_entry.replica_id, None)))
    else:
        built = [model_entry]
    out = []
    for t in built:
        if not isinstance(t, ShardedTensor):
            raise CheckpointError(f"{model_entry.key}: Megatron builds a {type(t).__name__} for this parameter")
        view = t.data if t is not model_entry else whole
        out.append(
            Placement(
                key=t.key,
                global_shape=tuple(t.global_shape),
                global_offset=tuple(t.global_offset),
                prepend=t.prepend_axis_num,
                offset=view.storage_offset(),
                shape=tuple(view.shape),
                strides=tuple(view.stride()),
                replica_id=t.replica_id,
                allow_shape_mismatch=t.allow_shape_mismatch,
            )
        )
    return out


@dataclass(frozen=True)
class RangePiece:
    """One box of a rank's range of a parameter, in one checkpoint tensor: the piece's
    elements ``[first, last)`` in its own row-major order (axes by decreasing stride),
    which lie in the range."""

    placement: Placement
    start: int
    """The box's first element, counted from the range's start."""
    sizes: Tuple[int, ...]
    strides: Tuple[int, ...]
    """The box in the range's flat values (axes by decreasing stride)."""
    axes: Tuple[int, ...]
    """The piece's axis of each of them."""
    global_offset: Tuple[int, ...]
    shape: Tuple[int, ...]
    """The box's shape in the checkpoint tensor (prepended axes as 1)."""

    def _view(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.dim() != 1 or flat.stride(0) != 1:
            raise ValueError("a range's values are one contiguous 1-D tensor")
        box = flat.as_strided(self.sizes, self.strides, flat.storage_offset() + self.start)
        return box.permute(sorted(range(len(self.axes)), key=lambda i: self.axes[i]))

    def take(self, flat: torch.Tensor) -> torch.Tensor:
        """The box's values out of the range's values ``flat``, for a save: a box that is a
        contiguous run of them is the same memory, as a tensor of its own storage
        (:func:`own_storage`)."""
        return own_storage(self._view(flat).contiguous().view(self.shape))

    def put(self, flat: torch.Tensor, value: torch.Tensor) -> None:
        """Write the box's values ``value`` into the range's values ``flat`` (nothing to do
        where ``value`` is the box itself: a load read it in place)."""
        view = self._view(flat)
        if value.data_ptr() != view.data_ptr():
            view.copy_(value.reshape(view.shape))

    def sharded_tensor(self, key: str, data: torch.Tensor) -> Any:
        """This box of the state tensor ``key`` (``data``: its values, :meth:`take`), an
        uneven shard; the data-parallel coordinate of the replica id is 0, since the
        data-parallel ranks hold different ranges and each writes its own."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        replica = self.placement.replica_id
        replica = (*replica[:-1], 0) if isinstance(replica, tuple) and replica else 0
        return ShardedTensor(
            key,
            data,
            data.dtype,
            self.shape,
            self.placement.global_shape,
            self.global_offset,
            axis_fragmentations=None,
            replica_id=replica,
            allow_shape_mismatch=self.placement.allow_shape_mismatch,
        )


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous) as a tensor whose storage is exactly its elements, aliasing its
    memory (the storage slice keeps the larger one alive).

    Megatron-core's CPU writer (``filesystem_async._clone_or_dequantize_if_needed``) clones
    every tensor whose storage is larger than it before writing, so that ``torch.save``
    does not write the whole storage. A box of a rank's range is such a view unless it is
    the whole range (SwiGLU's gate and up halves always are): as its own storage it is
    written from where it lies, as the writer writes a tensor that owns its memory, and a
    save copies nothing on any data-parallel size. Off the CPU the writer copies every
    tensor to the host (only its elements), so ``t`` is returned as it is."""
    storage = t.untyped_storage()
    if t.device.type != "cpu" or t.numel() == 0 or storage.nbytes() == t.numel() * t.element_size():
        return t
    first = t.storage_offset() * t.element_size()
    exact = storage[first : first + t.numel() * t.element_size()]
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(exact, 0, t.shape, t.stride())


def range_pieces(model_entry: Any, shape: Sequence[int], start: int, end: int) -> List[RangePiece]:
    """The boxes of the range ``[start, end)`` of a parameter of ``shape`` in the checkpoint
    tensors the model's entry for it (``ShardedTensor`` or factory) says, in a fixed order."""
    shape = tuple(shape)
    out = []
    for placement in _pieces(model_entry, shape) if end > start else []:
        order = placement._order()
        sizes = tuple(placement.shape[d] for d in order)
        strides = tuple(placement.strides[d] for d in order)
        first, last = placement.before(start), placement.before(end)
        for _, (offset, size) in flat_range_boxes(sizes, first, last):
            local = [0] * len(placement.shape)
            box_shape = [1] * len(placement.shape)
            for d, o, n in zip(order, offset, size):
                local[d], box_shape[d] = o, n
            p = placement.prepend
            out.append(
                RangePiece(
                    placement=placement,
                    start=placement.offset + sum(o * st for o, st in zip(offset, strides)) - start,
                    sizes=tuple(size),
                    strides=strides,
                    axes=tuple(order),
                    global_offset=placement.global_offset[:p]
                    + tuple(g + o for g, o in zip(placement.global_offset[p:], local)),
                    shape=(1,) * p + tuple(box_shape),
                )
            )
    if sum(math.prod(piece.shape) for piece in out) != end - start:
        raise CheckpointError(
            f"{model_entry.key}: the pieces Megatron cuts this parameter into do not cover it once "
            f"(range [{start}, {end}) of {shape}); its optimizer state cannot be saved by range"
        )
    return out
