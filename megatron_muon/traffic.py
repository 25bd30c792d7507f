"""Count the bytes each rank sends in ``torch.distributed`` collectives, by kind.

Used to compare optimizers side by side on the same model (ours, Megatron's
DistributedOptimizer + AdamW, Megatron's own Muon): everything a training step sends
through ``torch.distributed`` is counted, including Megatron DDP's gradient
reduce-scatter and parameter all-gather (which Megatron calls through module-level
aliases, patched here too).

Bytes are what one rank puts on the wire under the usual ring algorithms: all-reduce
``2 (n-1)/n * size``, reduce-scatter ``(n-1)/n * input``, all-gather ``(n-1)/n * output``,
all-to-all the input minus the part addressed to itself (tensor and list forms alike),
broadcast ``size`` on the root.
Collectives on single-rank groups count zero.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Callable, Dict, Iterator

import torch
import torch.distributed as dist


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else dist.get_world_size()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _all_reduce(tensor, *a, group=None, **k) -> int:
    n = _group_size(group if group is not None else (a[1] if len(a) > 1 else None))
    return 2 * (n - 1) * _nbytes(tensor) // n


def _reduce_scatter(output, input, *a, group=None, **k) -> int:
    n = _group_size(group if group is not None else (a[1] if len(a) > 1 else None))
    return (n - 1) * _nbytes(input) // n


def _all_gather(output, input, *a, group=None, **k) -> int:
    n = _group_size(group if group is not None else (a[0] if a else None))
    return (n - 1) * _nbytes(output) // n


def _all_gather_list(tensor_list, tensor, *a, group=None, **k) -> int:
    n = _group_size(group if group is not None else (a[0] if a else None))
    return (n - 1) * _nbytes(tensor)


def _all_to_all_list(output_list, input_list, *a, group=None, **k) -> int:
    if _group_size(group if group is not None else (a[0] if a else None)) == 1:
        return 0
    me = dist.get_rank(group if group is not None else (a[0] if a else None))
    return sum(_nbytes(t) for i, t in enumerate(input_list) if i != me)


def _all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **k) -> int:
    n = _group_size(group)
    if n == 1:
        return 0
    me = dist.get_rank(group)
    if input_split_sizes:
        per = input.numel() // max(input.shape[0], 1) if input.dim() > 1 else 1
        return (sum(input_split_sizes) - input_split_sizes[me]) * per * input.element_size()
    return (n - 1) * _nbytes(input) // n


def _broadcast(tensor, src=None, group=None, **k) -> int:
    if _group_size(group) == 1:
        return 0
    return _nbytes(tensor) if dist.get_rank() == src else 0


_COUNTERS: Dict[str, Callable[..., int]] = {
    "all_reduce": _all_reduce,
    "reduce_scatter_tensor": _reduce_scatter,
    "_reduce_scatter_base": _reduce_scatter,
    "all_gather_into_tensor": _all_gather,
    "_all_gather_base": _all_gather,
    "all_gather": _all_gather_list,
    "all_to_all_single": _all_to_all_single,
    "all_to_all": _all_to_all_list,
    "broadcast": _broadcast,
}
_KIND = {
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "all_gather_into_tensor": "all_gather",
    "_all_gather_base": "all_gather",
    "all_to_all_single": "all_to_all",
}


class CollectiveTraffic:
    """Bytes sent per collective kind while the counter was active."""

    def __init__(self) -> None:
        self.bytes: Dict[str, int] = defaultdict(int)
        self.calls: Dict[str, int] = defaultdict(int)

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveTraffic]:
    """Count every ``torch.distributed`` collective issued inside the block."""
    import megatron.core.distributed.param_and_grad_buffer as pgb

    traffic = CollectiveTraffic()
    originals = {}

    def wrap(name: str, fn: Callable) -> Callable:
        kind = _KIND.get(name, name)

        def counted(*args, **kwargs):
            try:
                traffic.bytes[kind] += _COUNTERS[name](*args, **kwargs)
            except Exception:  # noqa: BLE001 - counting must never break communication
                pass
            traffic.calls[kind] += 1
            return fn(*args, **kwargs)

        return counted

    for name in _COUNTERS:
        if hasattr(dist, name):
            originals[(dist, name)] = getattr(dist, name)
            setattr(dist, name, wrap(name, originals[(dist, name)]))
    for alias in ("dist_all_gather_func", "dist_reduce_scatter_func"):
        fn = getattr(pgb, alias, None)
        name = getattr(fn, "__name__", "")
        if fn is not None and name in _COUNTERS:
            originals[(pgb, alias)] = fn
            setattr(pgb, alias, wrap(name, fn))
    try:
        yield traffic
    finally:
        for (obj, name), fn in originals.items():
            setattr(obj, name, fn)
