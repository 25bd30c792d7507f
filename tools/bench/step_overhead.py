"""What an optimizer step runs besides Newton–Schulz: ops, bytes copied or cast, host syncs.

Newton–Schulz is the work Muon must do; everything else in ``optimizer.step()`` (the
gradient copy and checks, the grad norm, momentum, packing and casting, the update, the
master -> model copy, AdamW on the other parameters) is overhead to cut. Two views of it:

* :func:`count_ops` runs one step under a ``TorchDispatchMode`` that sees every aten op
  with its real tensors (the same ops on the CPU as on a GPU) and sorts them into
  Newton–Schulz (inside the implementation's NS entry point) and the rest, by kind:
  copies and casts (their bytes read and written), other arithmetic, views, and host
  synchronisations (``item()``-like ops, which stall a GPU's launch queue).
* :func:`profile_kernels` (CUDA) runs one step under ``torch.profiler`` and splits the
  device time into GEMM kernels (Newton–Schulz's matrix products; AdamW has none) and
  the rest, with the step's wall time, the kernel launches and the host-device syncs.

Both divide by the number of logical matrices Newton–Schulz saw (a stacked call counts
each matrix of the stack), so Megatron-core's Muon (one call per matrix) and ours (one
call per shape and chunk) compare per matrix.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

KINDS = ("copy/cast", "arithmetic", "sync", "communication", "view")

_COPIES = {
    "copy_", "_to_copy", "cat", "stack", "clone", "index_put_", "index_put", "slice_scatter",
    "index_copy_", "index_copy", "as_strided_copy", "_copy_from", "_copy_from_and_resize", "split_with_sizes_copy",
}  # fmt: skip
_SYNCS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "masked_select"}
_VIEWS = {
    "view", "_unsafe_view", "reshape", "slice", "t", "transpose", "permute", "expand", "as_strided", "select",
    "split", "split_with_sizes", "chunk", "unbind", "unsqueeze", "squeeze", "alias", "detach", "diagonal",
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "_reshape_alias",
    "view_as", "unflatten", "flatten", "narrow", "mT", "_has_compatible_shallow_copy_type", "set_",
    "resize_", "record_stream",
}  # fmt: skip
NS_ENTRY_POINTS = (
    ("megatron_muon.rule", "newton_schulz"),
    ("megatron_muon.rule", "MuonRule.orthogonalize"),
    ("megatron_muon.rule", "MuonRule.orthogonalize_across"),
    ("emerging_optimizers.orthogonalized_optimizers.muon_utils", "newton_schulz"),
)
"""(module, function or ``Class.method``) of every implementation's Newton–Schulz call:
ours (the public kernel, and the rule's orthogonalization stage, single- and multi-rank, as
the step calls it) and emerging-optimizers' (Megatron-core's Muon)."""


def op_kind(name: str) -> str:
    """The kind of an aten op (by its base name, without overload)."""
    base = name.split(".")[0]
    if base in _SYNCS:
        return "sync"
    if base in _COPIES:
        return "copy/cast"
    if base in _VIEWS:
        return "view"
    return "arithmetic"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensors(tree) -> List[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


class _Counter(TorchDispatchMode):
    """Counts ops and bytes by (where, kind); ``where`` is 'newton_schulz' inside an NS call."""

    def __init__(self) -> None:
        super().__init__()
        self.in_ns = 0
        self.ranges: List[str] = []
        self.ops: Counter = Counter()
        self.bytes: Counter = Counter()
        self.names: Counter = Counter()
        self.phases: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name
        namespace, _, base = name.partition("::")
        if namespace == "profiler":  # a record_function range opens or closes
            if base.startswith("_record_function_enter"):
                self.ranges.append(str(args[0]))
            elif self.ranges:
                self.ranges.pop()
            return out
        kind = "communication" if namespace == "c10d" else op_kind(base)
        where = "newton_schulz" if self.in_ns else "outside"
        self.ops[where, kind] += 1
        self.names[where, f"{base}"] += 1
        if kind != "view":
            self.phases[self.ranges[-1] if self.ranges else "-"] += 1
        if kind in ("copy/cast", "arithmetic"):
            written = _tensors(out)
            if base == "copy_":  # copy_(dst, src): reads src, writes dst
                moved = _nbytes(args[1]) + _nbytes(args[0])
            else:
                moved = sum(_nbytes(t) for t in _tensors((args, kwargs))) + sum(_nbytes(t) for t in written)
            self.bytes[where, kind] += moved
        return out


@contextlib.contextmanager
def _ns_marked(counter: _Counter, matrices: List[int]) -> Iterator[None]:
    """Wrap every Newton–Schulz entry point so that the ops inside it count as NS, and
    count the matrices each call orthogonalizes."""
    import importlib

    saved: List[Tuple[Any, str, Callable]] = []
    for module_name, attr in NS_ENTRY_POINTS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        *owners, attr = attr.split(".")
        for owner in owners:  # a method: patched on its class
            module = getattr(module, owner)
        original = module.__dict__.get(attr)
        if original is None:
            continue

        def marked(*args, __original=original, **kwargs):
            G = next((a for a in args if isinstance(a, torch.Tensor) or a is None), None)  # the matrix (None: not here)
            if isinstance(G, torch.Tensor) and counter.in_ns == 0:
                matrices[0] += G.shape[0] if G.ndim == 3 else 1
            counter.in_ns += 1
            try:
                return __original(*args, **kwargs)
            finally:
                counter.in_ns -= 1

        setattr(module, attr, marked)
        saved.append((module, attr, original))
    try:
        yield
    finally:
        for module, attr, original in saved:
            setattr(module, attr, original)


def count_ops(step: Callable[[], Any]) -> Dict[str, Any]:
    """Run ``step()`` once under the op counter: per (where, kind) the op count and the bytes
    read plus written by copies/casts and arithmetic, the matrices NS saw, and the most
    frequent ops outside NS."""
    counter = _Counter()
    matrices = [0]
    with _ns_marked(counter, matrices), counter:
        step()
    rows = {}
    for where in ("outside", "newton_schulz"):
        rows[where] = {kind: dict(ops=counter.ops[where, kind], bytes=counter.bytes[where, kind]) for kind in KINDS}
    top = [(name, n) for (where, name), n in counter.names.most_common() if where == "outside"][:12]
    return dict(matrices=matrices[0], by_kind=rows, top_outside=top, ops_by_range=dict(counter.phases.most_common()))


def merge_counts(counts: List[Dict[str, Any]]) -> Dict[str, Any]:
    """:func:`count_ops` results of several ranks summed (the top ops: the first rank's)."""
    out = dict(counts[0], matrices=sum(c["matrices"] for c in counts), ranks=len(counts))
    out["by_kind"] = {
        where: {
            kind: {k: sum(c["by_kind"][where][kind][k] for c in counts) for k in ("ops", "bytes")} for kind in KINDS
        }
        for where in counts[0]["by_kind"]
    }
    ranges: Counter = Counter()
    for c in counts:
        ranges.update(c["ops_by_range"])
    out["ops_by_range"] = dict(ranges.most_common())
    return out


def _is_gemm(kernel: str) -> bool:
    k = kernel.lower()
    return any(s in k for s in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma", "matmul"))


def profile_kernels(step: Callable[[], Any]) -> Dict[str, Any]:
    """CUDA: one ``step()`` under ``torch.profiler``: its wall time, device time in GEMM
    kernels and in the others, the time the device did nothing (the wall time less the
    union of the kernels' intervals: the host did not keep it busy), kernel launches,
    host-device syncs, the top kernels."""
    import time

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    gemm = other = 0.0
    kernels: Counter = Counter()
    intervals: List[Tuple[float, float]] = []
    launches = syncs = 0
    for evt in prof.events():
        name = evt.name
        if evt.device_type == torch.autograd.DeviceType.CUDA and not getattr(evt, "is_user_annotation", False):
            us = evt.time_range.end - evt.time_range.start
            intervals.append((evt.time_range.start, evt.time_range.end))
            kernels[name] += us
            if _is_gemm(name):
                gemm += us
            else:
                other += us
        elif name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"):
            launches += 1
        elif name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize") or (
            name.startswith("cudaMemcpy") and "Async" not in name
        ):
            syncs += 1
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):  # the union: kernels on several streams overlap
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return dict(
        wall_ms=wall * 1e3,
        gemm_ms=gemm / 1e3,
        other_kernels_ms=other / 1e3,
        idle_ms=max(wall * 1e3 - busy / 1e3, 0.0),
        launches=launches,
        syncs=syncs,
        top_kernels=[(k[:120], us / 1e3) for k, us in kernels.most_common(15)],
        trace=prof,
    )


def overhead_rows(label: str, counts: Dict[str, Any]) -> List[List[Any]]:
    """Table rows (per step and per matrix) of :func:`count_ops`'s result (or
    :func:`merge_counts`': every rank's ops per step, summed)."""
    n = max(counts["matrices"], 1)
    out = counts["by_kind"]["outside"]
    ns = counts["by_kind"]["newton_schulz"]
    ops_out = sum(v["ops"] for k, v in out.items() if k != "view")
    return [
        [
            label,
            counts["matrices"],
            ops_out,
            ops_out / n,
            out["copy/cast"]["ops"],
            out["copy/cast"]["bytes"] / n,
            out["arithmetic"]["bytes"] / n,
            out["sync"]["ops"],
            sum(v["ops"] for k, v in ns.items() if k != "view") / n,
        ]
    ]


OVERHEAD_HEADERS = [
    "optimizer",
    "matrices",
    "ops outside NS / step",
    "/ matrix",
    "copies+casts / step",
    "copy+cast bytes / matrix",
    "other arithmetic bytes / matrix",
    "host syncs / step",
    "ops inside NS / matrix",
]
