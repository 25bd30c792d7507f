"""CPU offload of the Muon optimizer state (``MuonConfig.muon_cpu_offload``): the momentum
(:class:`OffloadedMomentum`) and, with Megatron's ``optimizer_cpu_offload``, the fp32
master weights (:class:`OffloadedMasters`).

Between steps, the momentum of this rank's Muon master shards lives in one flat CPU pool
(pinned where CUDA is available); ``optimizer.state[main]["momentum_buffer"]`` is a view
of it, so checkpoints and ``state_dict`` see ordinary tensors. During the step, each
pipeline chunk brings the momentum of exactly the shard ranges it gathers into one
device staging buffer (sized for the largest chunk), updates it there, hands the
Nesterov pieces to the gather, and writes the momentum back:

    side stream:    H2D(0) | D2H(0) H2D(1) | D2H(1) H2D(2) | ...
    compute stream:        update(0) ......| update(1) ....| ...   (Newton–Schulz between)

The write-back of chunk ``i`` and the fetch of chunk ``i + 1`` run on a side stream
while the compute stream orthogonalizes, ordered by events; so the staging buffer is the
only Muon optimizer state on the device, and only while the step runs. Without CUDA the
same code runs synchronously (the "device" is the CPU and the copies are plain copies);
``device_bytes`` then still counts what would live on the accelerator: the staging
buffer, as opposed to the pool.

Each shard element is updated once per step even where the plan sends it to several
owners (``duplicated`` TP mode): a range is updated by the first chunk that sends it,
later sends reuse that chunk's piece.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

Range = Tuple[int, int, int]
"""(param index, local start, local end) in this rank's master shard of a Muon param."""


@dataclass
class _ChunkMomentum:
    """The shard ranges whose momentum one chunk updates, and where they sit in staging."""

    ranges: List[Range] = field(default_factory=list)
    offsets: List[int] = field(default_factory=list)
    numel: int = 0


class OffloadedMomentum:
    """The Muon momentum of one pipeline, held on the CPU and streamed per chunk."""

    def __init__(self, pipeline, shards: Sequence[Optional[torch.Tensor]], device: Optional[torch.device]) -> None:
        self.pipeline = pipeline
        self.device = device if device is not None else torch.device("cpu")
        self.chunks = self._chunk_ranges(pipeline.comms)
        sends = Counter(rng for comm in pipeline.comms for rng in comm.gather_send)
        self.resent = {rng for rng, count in sends.items() if count > 1}
        """Ranges sent more than once (``duplicated`` TP mode): their pieces are kept for
        the step after the chunk that updated them."""
        self._kept: Dict[Range, torch.Tensor] = {}
        self._check_coverage(shards)
        sizes = [s.numel() if s is not None else 0 for s in shards]
        pin = torch.cuda.is_available()
        self.pool = torch.zeros(sum(sizes), dtype=torch.float32, pin_memory=pin)
        """Every Muon shard's momentum, param after param (CPU)."""
        self.views: List[Optional[torch.Tensor]] = []
        offset = 0
        for shard, size in zip(shards, sizes):
            self.views.append(self.pool[offset : offset + size] if shard is not None else None)
            offset += size
        self.staging_numel = max((c.numel for c in self.chunks), default=0)
        self.staging: Optional[torch.Tensor] = None
        self.peak_device_bytes = 0
        """Largest momentum bytes on the device during the last step (the staging buffer)."""
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if cuda else None
        self._fetched: Dict[int, Optional[torch.cuda.Event]] = {}

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _chunk_ranges(comms) -> List[_ChunkMomentum]:
        seen = set()
        out = []
        for comm in comms:
            chunk = _ChunkMomentum()
            for rng in comm.gather_send:
                if rng in seen:
                    continue
                seen.add(rng)
                chunk.ranges.append(rng)
                chunk.offsets.append(chunk.numel)
                chunk.numel += rng[2] - rng[1]
            out.append(chunk)
        return out

    def _check_coverage(self, shards: Sequence[Optional[torch.Tensor]]) -> None:
        """Every element of every held shard is in exactly one range (else the momentum of
        some element would be updated twice or never)."""
        by_param: Dict[int, List[Tuple[int, int]]] = {}
        for chunk in self.chunks:
            for p, s, e in chunk.ranges:
                by_param.setdefault(p, []).append((s, e))
        for p, shard in enumerate(shards):
            end = 0
            for s, e in sorted(by_param.get(p, [])):
                if s != end:
                    break
                end = e
            if shard is not None and end != shard.numel():
                raise NotImplementedError(
                    "muon_cpu_offload: the plan's gather pieces of a Muon shard overlap or leave gaps; "
                    "run without --muon-cpu-offload for this layout."
                )

    # ------------------------------------------------------------------ state
    def adopt(self, state: Dict[torch.Tensor, dict], shards: Sequence[Optional[torch.Tensor]]) -> None:
        """Make ``state[main]["momentum_buffer"]`` the pool view of every held shard, copying
        in whatever was put there meanwhile (a loaded checkpoint, ``load_state_dict``)."""
        for main, view in zip(shards, self.views):
            if main is None:
                continue
            st = state[main]
            current = st.get("momentum_buffer")
            if current is not None and current.data_ptr() != view.data_ptr():
                view.copy_(current.reshape(-1))
            st["momentum_buffer"] = view
            st.setdefault("step", torch.tensor(0.0))

    @property
    def pool_bytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    @property
    def device_bytes(self) -> int:
        """Muon momentum bytes on the compute device now (0 between steps): the staging
        buffer, plus the kept pieces of ranges sent twice (``duplicated`` mode only)."""
        staging = self.staging.numel() * self.staging.element_size() if self.staging is not None else 0
        return staging + sum(t.numel() * t.element_size() for t in self._kept.values())

    # ------------------------------------------------------------------ the step
    def _side(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def _record(self) -> Optional[torch.cuda.Event]:
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _fetch(self, index: int) -> None:
        """Enqueue chunk ``index``'s momentum into staging (on the side stream)."""
        if index >= len(self.chunks):
            return
        chunk = self.chunks[index]
        with self._side():
            for (p, s, e), o in zip(chunk.ranges, chunk.offsets):
                self.staging[o : o + e - s].copy_(self.views[p][s:e], non_blocking=True)
            self._fetched[index] = self._record()

    def _write_back_and_fetch_next(self, index: int) -> None:
        """After chunk ``index``'s update: its momentum back to the pool, then the next
        chunk's into the same staging buffer (stream order keeps the two apart)."""
        updated = self._record()
        chunk = self.chunks[index]
        with self._side():
            if updated is not None:
                self.stream.wait_event(updated)
            for (p, s, e), o in zip(chunk.ranges, chunk.offsets):
                self.views[p][s:e].copy_(self.staging[o : o + e - s], non_blocking=True)
        self._fetch(index + 1)

    def begin(self, grads: Sequence[Optional[torch.Tensor]], momentum: float, nesterov: bool):
        """Start a step: allocate staging, fetch chunk 0; returns the pipeline's
        ``PiecesFn``, which updates each chunk's momentum as the chunk is launched."""
        self.staging = torch.empty(self.staging_numel, dtype=torch.float32, device=self.device)
        self._kept = {}
        self.peak_device_bytes = self.device_bytes
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self._fetch(0)
        by_comm = {id(comm): i for i, comm in enumerate(self.pipeline.comms)}

        def pieces(comm) -> List[torch.Tensor]:
            index = by_comm[id(comm)]
            chunk = self.chunks[index]
            event = self._fetched.pop(index, None)
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
            made: Dict[Range, torch.Tensor] = {}
            for (p, s, e), o in zip(chunk.ranges, chunk.offsets):
                buf, grad = self.staging[o : o + e - s], grads[p][s:e]
                buf.mul_(momentum).add_(grad)
                made[(p, s, e)] = grad + momentum * buf if nesterov else buf.clone()
            self._write_back_and_fetch_next(index)
            self._kept.update({rng: made[rng] for rng in made if rng in self.resent})
            self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)
            return [made[rng] if rng in made else self._kept[rng] for rng in comm.gather_send]

        return pieces

    def finish(self) -> None:
        """End the step: wait for the last write-back, free staging (nothing on the device)."""
        if self.stream is not None:
            self.stream.synchronize()
        self.staging = None
        self._fetched.clear()
        self._kept = {}


class OffloadedMasters:
    """The fp32 master shards of the Muon matrices, held in one CPU pool (pinned where
    CUDA is available).

    Megatron's code knows a master by its ``torch.nn.Parameter`` object (optimizer
    groups, state keys, grad norm, clipping), so each master stays that object and only
    its ``.data`` moves: it is the pool view, and every read and write of master values
    (weight decay, the update, QK-Clip, the master -> model copy, checkpoints) happens on
    the CPU. The one exception is Megatron's ``_copy_model_grads_to_main_grads``: torch
    lets a parameter take a ``.grad`` only on its own device, so for that call (see
    :meth:`grads_assignable`) ``.data`` becomes a zero-stride device placeholder (one
    element shared by all masters; a write to it raises). The gradients themselves stay
    on the device, where Megatron's norm, clipping and zero counting read them.

    Only masters of bf16/fp16 parameters are offloaded: an fp32 parameter's master is a
    view of the parameter itself."""

    def __init__(self, mains: Sequence[torch.Tensor], device: Optional[torch.device]) -> None:
        self.mains = list(mains)
        self.pool = torch.empty(sum(m.numel() for m in self.mains), dtype=torch.float32,
                                pin_memory=torch.cuda.is_available())
        self.views: List[torch.Tensor] = []
        offset = 0
        for main in self.mains:
            view = self.pool[offset : offset + main.numel()]
            view.copy_(main.detach().reshape(-1))
            main.data = view  # the device copy Megatron allocated is freed here
            self.views.append(view)
            offset += main.numel()
        self._placeholder = torch.zeros(1, dtype=torch.float32, device=device)

    @property
    def pool_bytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def in_pool(self) -> bool:
        """Whether every master's values are its pool view now (between and during steps)."""
        return all(m.data_ptr() == v.data_ptr() for m, v in zip(self.mains, self.views))

    @contextmanager
    def grads_assignable(self) -> Iterator[None]:
        """Masters on the device placeholder, so that Megatron can set device ``.grad``s."""
        for main in self.mains:
            main.data = self._placeholder.expand(main.numel())
        try:
            yield
        finally:
            for main, view in zip(self.mains, self.views):
                main.data = view
