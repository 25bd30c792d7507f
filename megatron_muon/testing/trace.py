"""Watch the Muon step from outside: which stage of which chunk ran when, and when each
all-to-all was in flight. For tests and the overlap benchmark; the step itself records
nothing.

:func:`trace_step` wraps, while active, the functions the optimizer's step looks up at
call time (``pipeline.StepWork.chunk``, ``pipeline.exchange``, ``pipeline.StepWork.orthogonalize``)
and records, for each chunk generator of each optimizer (``dense``, ``expert``):

* ``launch_gather`` (momentum, pack and the gather's launch: the generator's first part),
* ``complete_gather`` (the wait for the gather's pieces) and ``compute`` (Newton–Schulz
  and the rest of orthogonalization), then ``launch_scatter``,
* ``complete_scatter`` and ``update`` (decay and update of the master ranges).

``Trace.events`` is the order in which they start, ``(optimizer, stage, chunk)``;
``Trace.spans`` has their start and end times (``time.perf_counter``; ``complete_gather``
spans the whole middle part, ``compute`` inside it); ``Trace.flights`` holds each
all-to-all's kind (``gather`` or ``scatter``), launch and completion time (watched from a
helper thread) and its bytes.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Tuple

import megatron_muon.pipeline as pipeline


@dataclass
class Trace:
    events: List[Tuple[str, str, int]] = field(default_factory=list)
    spans: List[Dict[str, Any]] = field(default_factory=list)
    flights: List[Dict[str, Any]] = field(default_factory=list)

    def start(self, name: str, stage: str, chunk: int) -> float:
        """Record that a stage starts now; returns the time."""
        self.events.append((name, stage, chunk))
        return time.perf_counter()

    def end(self, name: str, stage: str, chunk: int, start: float) -> None:
        self.spans.append(dict(pipeline=name, stage=stage, chunk=chunk, start=start, end=time.perf_counter()))


@contextlib.contextmanager
def trace_step(optimizer) -> Iterator[Trace]:
    """Record the stages and all-to-alls of ``optimizer``'s (a ``MuonChainedOptimizer``)
    steps taken inside the block."""
    names = {id(o.muon): o.name for o in optimizer.muon_optimizers}
    trace = Trace()
    chunk, exchange, orthogonalize = pipeline.StepWork.chunk, pipeline.exchange, pipeline.StepWork.orthogonalize
    current: List[Tuple[str, int, str]] = []  # (optimizer, chunk, exchange kind) of the running generator

    def traced_chunk(work, position, msg) -> Iterator[None]:
        name = names[id(work.pipelines[position])]
        stages = chunk(work, position, msg)
        start = trace.start(name, "launch_gather", msg.index)  # from the momentum on, as before
        next(stages)
        yield
        for first, then, kind in (
            ("launch_gather", None, "gather"),
            ("complete_gather", "launch_scatter", "scatter"),
            ("complete_scatter", "update", None),
        ):
            if first != "launch_gather":
                start = trace.start(name, first, msg.index)
            current.append((name, msg.index, kind))
            try:
                done = next(stages, StopIteration) is StopIteration
            finally:
                current.pop()
            trace.end(name, first, msg.index, start)
            if then is not None:
                trace.events.append((name, then, msg.index))
            if done:
                return
            yield

    def traced_orthogonalize(work, muon, msg, recv):
        start = trace.start(names[id(muon)], "compute", msg.index)
        try:
            return orthogonalize(work, muon, msg, recv)
        finally:
            trace.end(names[id(muon)], "compute", msg.index, start)

    def traced_exchange(group, send, send_splits, recv_splits, remote, *packing):
        launched = time.perf_counter()
        recv, work = exchange(group, send, send_splits, recv_splits, remote, *packing)
        name, chunk, kind = current[-1] if current else ("", -1, None)
        flight = dict(
            pipeline=name,
            chunk=chunk,
            kind=kind,
            launched=launched,
            completed=None,
            bytes=(sum(send_splits) - send_splits[group.rank]) * recv.element_size(),
        )
        trace.flights.append(flight)
        if work is not None:

            def watch(work=work, record=flight):  # wait() would only say when someone waited
                while not work.is_completed():
                    time.sleep(20e-6)
                record["completed"] = time.perf_counter()

            threading.Thread(target=watch, daemon=True).start()
        else:
            flight["completed"] = launched
        return recv, work

    pipeline.StepWork.chunk, pipeline.StepWork.orthogonalize = traced_chunk, traced_orthogonalize
    pipeline.exchange = traced_exchange
    try:
        yield trace
    finally:
        pipeline.StepWork.chunk, pipeline.StepWork.orthogonalize = chunk, orthogonalize
        pipeline.exchange = exchange
