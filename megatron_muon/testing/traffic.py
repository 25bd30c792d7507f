"""Count the bytes each rank sends in ``torch.distributed`` collectives, by kind.

Used to compare optimizers side by side on the same model (ours, Megatron's
DistributedOptimizer + AdamW, Megatron's own Muon): everything a training step sends
through ``torch.distributed`` is counted, including Megatron DDP's gradient
reduce-scatter and parameter all-gather (which Megatron calls through module-level
aliases, patched here too).

Bytes are what one rank puts on the wire under the usual ring algorithms: all-reduce
``2 (n-1)/n * size``, reduce-scatter ``(n-1)/n * input``, all-gather ``(n-1)/n * output``,
all-to-all the input minus the part addressed to itself (tensor and list forms alike),
broadcast ``size`` on the root, scatter every other member's part on the root, gather
each non-root member's tensor.
Collectives on single-rank groups count zero.

Bytes are also split by the kind of process group they travel in (``by_group``: ``dp``,
``expert_dp``, ``tp``, ``ep``, ``pp``, ``other``). A collective on one of Megatron's
``parallel_state`` groups counts for that group's kind; on any other group (ours: the
TP x DP orthogonalization group) each peer's bytes of an ``all_to_all_single`` count for the
smallest Megatron group holding both ranks (TP first; ``dp`` if none), so Muon's TP-only
exchanges show as ``tp`` and pieces crossing DP as ``dp``.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import defaultdict
from typing import Callable, Dict, Iterator, List, Optional, Tuple

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


def _all_gather(output=None, input=None, *a, group=None, output_tensor=None, **k) -> int:
    # all_gather_into_tensor names them output_tensor / input_tensor (Megatron-FSDP passes keywords).
    output = output if output is not None else output_tensor
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


def _scatter(tensor, scatter_list=None, *a, group=None, **k) -> int:
    """The root sends every other member its tensor (multi-rank Newton–Schulz's blocks)."""
    if _group_size(group) == 1 or not scatter_list:
        return 0
    return sum(_nbytes(t) for t in scatter_list) - _nbytes(tensor)


def _gather(tensor, gather_list=None, *a, group=None, **k) -> int:
    """Every member but the root sends its tensor."""
    if _group_size(group) == 1 or gather_list:
        return 0
    return _nbytes(tensor)


_COUNTERS: Dict[str, Callable[..., int]] = {
    "scatter": _scatter,
    "gather": _gather,
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


GROUP_KINDS = ("tp", "dp", "expert_dp", "ep", "pp")


def _megatron_groups() -> List[Tuple[str, object]]:
    """(kind, group) of this rank's Megatron process groups, most specific first."""
    from megatron.core import parallel_state as ps

    getters = [
        ("tp", ps.get_tensor_model_parallel_group),
        ("tp", ps.get_expert_tensor_parallel_group),
        ("dp", lambda: ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)),
        ("dp", lambda: ps.get_data_parallel_group(with_context_parallel=True)),
        ("dp", ps.get_data_parallel_group),
        ("expert_dp", lambda: ps.get_expert_data_parallel_group(partial_expert_data_parallel=True)),
        ("expert_dp", ps.get_expert_data_parallel_group),
        ("ep", ps.get_expert_model_parallel_group),
        ("pp", ps.get_pipeline_model_parallel_group),
    ]
    out = []
    for kind, get in getters:
        try:
            group = get()
        except Exception:  # noqa: BLE001 - a group this layout does not have
            continue
        if group is not None:
            out.append((kind, group))
    return out


class _GroupClassifier:
    """Maps a process group (or one peer in it) to the kind of Megatron group it is."""

    def __init__(self) -> None:
        self.groups = _megatron_groups()
        self.ranks = [(kind, set(dist.get_process_group_ranks(g))) for kind, g in self.groups]

    def of_group(self, group) -> str:
        if group is None:
            return "other"
        for kind, g in self.groups:
            if g is group:
                return kind
        members = set(dist.get_process_group_ranks(group))
        return next((kind for kind, ranks in self.ranks if members <= ranks), "other")

    def of_peer(self, peer_global_rank: int) -> str:
        """A peer sharing no Megatron group with this rank differs in TP and DP: its
        bytes cross DP, so they count as ``dp``."""
        pair = {dist.get_rank(), peer_global_rank}
        return next((kind for kind, ranks in self.ranks if pair <= ranks), "dp")


class CollectiveTraffic:
    """Bytes sent per collective kind (``bytes``) and per process-group kind (``by_group``)
    while the counter was active."""

    def __init__(self) -> None:
        self.bytes: Dict[str, int] = defaultdict(int)
        self.calls: Dict[str, int] = defaultdict(int)
        self.by_group: Dict[str, int] = defaultdict(int)

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.by_group.clear()


def _split_by_group(
    name: str, fn: Callable, nbytes: int, args, kwargs, classifier: "_GroupClassifier"
) -> Dict[str, int]:
    """``nbytes`` of one call split by group kind (per peer for ``all_to_all_single``)."""
    bound = inspect.signature(fn).bind_partial(*args, **kwargs).arguments
    group = bound.get("group")
    splits: Optional[List[int]] = bound.get("input_split_sizes")
    kind = classifier.of_group(group)
    if name != "all_to_all_single" or not splits or kind != "other" or not nbytes:
        return {kind: nbytes}
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    me = dist.get_rank()
    total = sum(n for r, n in zip(ranks, splits) if r != me)
    out: Dict[str, int] = defaultdict(int)
    for r, n in zip(ranks, splits):
        if r != me and n:
            out[classifier.of_peer(r)] += nbytes * n // max(total, 1)
    return out


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveTraffic]:
    """Count every ``torch.distributed`` collective issued inside the block."""
    import megatron.core.distributed.param_and_grad_buffer as pgb

    traffic = CollectiveTraffic()
    originals = {}
    classifier: List[_GroupClassifier] = []

    def wrap(name: str, fn: Callable) -> Callable:
        kind = _KIND.get(name, name)

        def counted(*args, **kwargs):
            try:
                nbytes = _COUNTERS[name](*args, **kwargs)
                traffic.bytes[kind] += nbytes
                if nbytes:
                    if not classifier:
                        classifier.append(_GroupClassifier())
                    for group_kind, n in _split_by_group(name, fn, nbytes, args, kwargs, classifier[0]).items():
                        traffic.by_group[group_kind] += n
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
