"""Muon's optimizer state: one registry of what it keeps, and where it is stored.

**The registry** (:data:`MUON_STATES`): every per-matrix state of a Muon parameter, declared
once. Checkpoints (``checkpoint.py``), the converter and tests iterate it; the step's maths
(``pipeline.py``) reads and writes the values. A state is kept either

* per **shard** (``kept="shard"``): each holder keeps the elements of its fp32 master's
  range, a tensor shaped like the master (the momentum), in the inner optimizer's
  ``state[master][name]``; or
* per **matrix** on its owner (``kept="owner"``): one tensor per logical matrix, of the
  registry's ``shape(rows, cols)`` in logical ``(out, in)`` orientation, broadcastable to
  the matrix (variance reduction's factored second moment: a column or a row). A checkpoint
  stores it expanded to the parameter's shape, so it reshards with everything else.

AdamW's states (:data:`ADAM_STATES`) are Megatron's torch AdamW's.

**Storage.** :class:`ShardStates` holds the shard-kept states on the compute device, or,
with ``muon_cpu_offload``, in flat CPU pools (pinned with CUDA) of which
``state[master][name]`` is a view. The step asks for each chunk's ranges (:meth:`fetch`) and
hands them back (:meth:`release`): on the device that is a view and nothing; offloaded it
is a device staging buffer, written back to the pool and refilled with the next chunk's
ranges on side streams (one per direction) while the compute stream orthogonalizes::

    side streams:   H2D(0) | D2H(0) H2D(1) | D2H(1) H2D(2) | ...
    compute stream:        update(0) ......| update(1) ....| ...

so the maths is the same code whatever the storage (:class:`ChunkStaging` does the
staging). :class:`OwnerStates` holds the owner-kept states (on the CPU with offload).
:class:`OffloadedMasters` moves the fp32 masters of the Muon matrices to a CPU pool
(``muon_cpu_offload`` with Megatron's ``optimizer_cpu_offload``) and stages them on the
device for each chunk's update the same way, so that every operation of the step runs on
the device.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, Iterator, List, Optional, Sequence, Tuple

import torch

from .planner import ChunkMessages, Job, Piece


@dataclass(frozen=True)
class MatrixState:
    """One per-matrix optimizer state of the Muon parameters."""

    name: str
    """Key in ``optimizer.state[master]`` and in checkpoints (``optimizer.state.<name>.<param key>``)."""
    kept: str
    """'shard' (each holder keeps its master's range) or 'owner' (one tensor per logical
    matrix, on the rank that orthogonalizes it)."""
    enabled: Callable[[object], bool]
    """Whether a ``MuonConfig`` uses this state."""
    shape: Optional[Callable[[int, int], Tuple[int, int]]] = None
    """'owner' states: the tensor's shape for an ``(out, in)`` logical matrix,
    broadcastable to it."""
    required: bool = False
    """Whether a checkpoint this run loads must hold it; one that need not (switched on
    since the checkpoint was saved, or absent from a converted AdamW checkpoint) starts at
    zero, as in a fresh run."""


def factored_shape(out_features: int, in_features: int) -> Tuple[int, int]:
    """One value per row of a tall or square matrix, per column of a wide one."""
    return (out_features, 1) if out_features >= in_features else (1, in_features)


MOMENTUM = "momentum_buffer"
SECOND_MOMENT = "second_moment"
HYPERBALL_RADIUS = "hyperball_radius"
MASTER = "param"
"""The checkpoint name of a parameter's fp32 master weight (Megatron's)."""

MUON_STATES: Tuple[MatrixState, ...] = (
    MatrixState(MOMENTUM, "shard", lambda config: True, required=True),
    MatrixState(SECOND_MOMENT, "owner", lambda config: config.muon_variance_reduction is not None, factored_shape),
    MatrixState(HYPERBALL_RADIUS, "owner", lambda config: config.muon_hyperball, lambda rows, cols: (1, 1)),
)
ADAM_STATES: Tuple[str, ...] = ("exp_avg", "exp_avg_sq")
"""AdamW's states of every other parameter (Megatron's torch AdamW's); a checkpoint must hold both."""


def muon_states(config, kept: Optional[str] = None) -> List[MatrixState]:
    """The registry's states ``config`` uses (only those ``kept`` so, if given)."""
    return [s for s in MUON_STATES if s.enabled(config) and (kept is None or s.kept == kept)]


def checkpoint_states(config, muon: bool) -> Tuple[str, ...]:
    """The states a checkpoint holds for a parameter: its fp32 master, then the registry's
    enabled states (a Muon matrix) or AdamW's."""
    return (MASTER,) + (tuple(s.name for s in muon_states(config)) if muon else ADAM_STATES)


def required_in_checkpoint(name: str) -> bool:
    """Whether a checkpoint must hold state ``name`` wherever this run uses it: the fp32
    master, AdamW's states, the registry's ``required`` ones (others start at zero)."""
    return name in (MASTER,) + ADAM_STATES + tuple(s.name for s in MUON_STATES if s.required)


def init_adam_states(optimizer: torch.optim.Optimizer) -> None:
    """Allocate AdamW's state of every non-Muon parameter that has none yet (Megatron calls
    this to load into a fresh optimizer; a checkpoint load needs every rank to hold them)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if len(state) == 0 and not group.get("muon", False):
                state["step"] = torch.tensor(0.0)
                for name in ADAM_STATES:
                    state[name] = torch.zeros_like(p)


# ---------------------------------------------------------------------------------------
# Shard-kept states: device tensors or CPU pools, chunk by chunk
# ---------------------------------------------------------------------------------------


class ChunkStaging:
    """Ranges of flat CPU pools staged on the compute device chunk by chunk, for the step.

    ``views[name][p]`` is the pool's view of Muon param ``p``'s values (None: not staged),
    ``ranges[i]`` the ranges ``(p, start, end)`` chunk ``i`` works on; the ranges of
    different chunks are disjoint (each element is updated by one chunk). Each chunk's
    ranges go to a device staging buffer (one per name, ``buffers`` of them used in turn,
    each sized for the largest chunk). The step takes them (:meth:`fetch`: waits for their
    copy) and hands them back (:meth:`release`: written back to the pool once the compute
    stream is done with them, and the buffer refilled with the chunk ``buffers`` further
    on). With CUDA the copies to the device run on one side stream and those back on
    another, so the two directions overlap each other and the compute; a refill waits
    only for the write-back of the same buffer. With two buffers the next chunk's ranges
    arrive while this one's are computed on::

        to the device:  H2D(0) H2D(1) ......... H2D(2) ......... H2D(3)
        to the host:                  D2H(0) ......... D2H(1) .........
        compute:              step(0) ........ step(1) ........ step(2)

    Chunks are fetched and released in order, each once. Elsewhere (the CPU) the same
    copies run in place, in order: the same arithmetic on the same staged copies, so the
    CPU tests exercise this path."""

    def __init__(
        self,
        views: Dict[str, List[Optional[torch.Tensor]]],
        ranges: Sequence[Sequence[Piece]],
        device: torch.device,
        buffers: int = 1,
    ) -> None:
        self.views = views
        self.ranges = [list(r) for r in ranges]
        self.device = device
        self.buffers = buffers
        self._offsets: List[List[int]] = []
        for pieces in self.ranges:
            offsets, numel = [], 0
            for _, s, e in pieces:
                offsets.append(numel)
                numel += e - s
            self._offsets.append(offsets + [numel])
        cuda = device.type == "cuda"
        self.to_device = torch.cuda.Stream(device=device) if cuda else None
        self.to_host = torch.cuda.Stream(device=device) if cuda else None
        self.staging: Dict[str, List[torch.Tensor]] = {}
        """name -> the staging buffers (during a step)."""
        self._fetched: Dict[int, Optional[torch.cuda.Event]] = {}
        self._written: Dict[int, Optional[torch.cuda.Event]] = {}
        """Buffer -> the event after the last write-back from it (a refill waits for it)."""
        self.peak_device_bytes = 0
        """Largest staged bytes on the device during the last step."""

    @property
    def device_bytes(self) -> int:
        """Staged bytes on the compute device now (0 between steps)."""
        return sum(t.numel() * t.element_size() for buffers in self.staging.values() for t in buffers)

    def begin(self) -> None:
        """Allocate the staging buffers and start fetching the first chunks."""
        numel = max((o[-1] for o in self._offsets), default=0)
        count = min(self.buffers, len(self.ranges))
        self.staging = {
            n: [torch.empty(numel, dtype=torch.float32, device=self.device) for _ in range(count)] for n in self.views
        }
        self.peak_device_bytes = self.device_bytes
        if self.to_device is not None:
            self.to_device.wait_stream(torch.cuda.current_stream(self.device))
        for index in range(count):
            self._fetch(index)

    def fetch(self, index: int) -> Dict[str, List[torch.Tensor]]:
        """name -> the device tensors of chunk ``index``'s ranges, in their order (views of
        a staging buffer, once its copy arrived)."""
        if index not in self._fetched:  # its buffer holds another chunk's ranges
            raise RuntimeError(f"ChunkStaging: chunk {index} taken out of order (chunks run in plan order)")
        event = self._fetched.pop(index)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        offsets = self._offsets[index]
        return {
            n: [buffers[index % self.buffers][offsets[i] : offsets[i + 1]] for i in range(len(self.ranges[index]))]
            for n, buffers in self.staging.items()
        }

    def release(self, index: int) -> None:
        """The step is done with chunk ``index``'s ranges: write them back to the pool and
        fetch chunk ``index + buffers`` into the same buffer once they are out."""
        updated = self._record()
        with _on(self.to_host):
            if updated is not None:
                self.to_host.wait_event(updated)
            self._copy(index, to_pool=True)
            self._written[index % self.buffers] = self._record()
        self._fetch(index + self.buffers)

    def finish(self) -> None:
        """Wait for the last write-back (the pool is current again) and free the buffers."""
        for stream in (self.to_device, self.to_host):
            if stream is not None:
                stream.synchronize()
        self.staging = {}
        self._fetched.clear()
        self._written.clear()

    def _fetch(self, index: int) -> None:
        if index >= len(self.ranges):
            return
        with _on(self.to_device):
            written = self._written.pop(index % self.buffers, None)
            if written is not None:
                self.to_device.wait_event(written)
            self._copy(index, to_pool=False)
            self._fetched[index] = self._record()

    def _copy(self, index: int, to_pool: bool) -> None:
        offsets = self._offsets[index]
        for name, buffers in self.staging.items():
            staging, views = buffers[index % self.buffers], self.views[name]
            for i, (p, s, e) in enumerate(self.ranges[index]):
                pool, dev = views[p][s:e], staging[offsets[i] : offsets[i + 1]]
                (pool if to_pool else dev).copy_(dev if to_pool else pool, non_blocking=True)

    def _record(self) -> Optional[torch.cuda.Event]:
        """An event after what the current stream queued so far (None off CUDA)."""
        if self.to_device is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event


def _on(stream: Optional[torch.cuda.Stream]):
    """Queue on ``stream`` (CUDA), or run in place (None)."""
    return torch.cuda.stream(stream) if stream is not None else nullcontext()


class ShardStates:
    """The shard-kept Muon states of one optimizer's fp32 masters."""

    def __init__(
        self,
        names: Sequence[str],
        masters: Sequence[Optional[torch.Tensor]],
        state: Dict[torch.Tensor, dict],
        messages: Sequence[ChunkMessages],
        offload: bool,
        device: Optional[torch.device],
    ) -> None:
        """``masters[p]``: this rank's fp32 master of Muon param ``p`` (None: holds none);
        ``state``: the inner optimizer's state dict; ``messages``: the plan's chunks for this
        rank (which ranges each chunk advances)."""
        self.names = list(names)
        self.masters = list(masters)
        self.state = state
        self.messages = list(messages)
        self.device = device if device is not None else torch.device("cpu")
        self.offload = offload
        self.pools: Dict[str, torch.Tensor] = {}
        """name -> every master's values, master after master (CPU; offload only)."""
        self.views: Dict[str, List[Optional[torch.Tensor]]] = {}
        self.staging: Optional[ChunkStaging] = None
        """Offloaded: the chunks' ranges of the pools on the device during a step."""
        if offload:
            sizes = [m.numel() if m is not None else 0 for m in self.masters]
            pin = torch.cuda.is_available()
            for name in self.names:
                self.pools[name] = torch.zeros(sum(sizes), dtype=torch.float32, pin_memory=pin)
                views, offset = [], 0
                for master, size in zip(self.masters, sizes):
                    views.append(self.pools[name][offset : offset + size] if master is not None else None)
                    offset += size
                self.views[name] = views
            self.staging = ChunkStaging(self.views, [msg.momentum for msg in self.messages], self.device)
        self.adopt()

    def adopt(self) -> None:
        """Every held master has its states (zeros at first, ``step`` 0); offloaded, each
        ``state[master][name]`` is the pool view, holding whatever was put there meanwhile
        (a loaded checkpoint)."""
        for p, master in enumerate(self.masters):
            if master is None:
                continue
            st = self.state[master]
            for name in self.names:
                current = st.get(name)
                if self.offload:
                    view = self.views[name][p]
                    if current is not None and current.data_ptr() != view.data_ptr():
                        view.copy_(current.reshape(-1))
                    st[name] = view
                elif current is None:
                    st[name] = torch.zeros_like(master, dtype=torch.float32)
            st.setdefault("step", torch.tensor(0.0))

    @property
    def pool_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.pools.values())

    @property
    def device_bytes(self) -> int:
        """Offloaded-state bytes on the compute device now (0 between steps)."""
        return self.staging.device_bytes if self.staging is not None else 0

    @property
    def peak_device_bytes(self) -> int:
        """Largest offloaded-state bytes on the device during the last step (the staging)."""
        return self.staging.peak_device_bytes if self.staging is not None else 0

    def begin(self) -> None:
        """Start a step: advance every held master's step count; offloaded, allocate the
        staging buffers and start fetching the first chunk."""
        if self.offload:
            self.adopt()  # a checkpoint loaded meanwhile put its tensors in the state
        steps = [self.state[m]["step"] for m in self.masters if m is not None]
        if steps:
            torch._foreach_add_(steps, 1.0)
        if self.staging is not None:
            self.staging.begin()

    def fetch(self, msg: ChunkMessages) -> Dict[str, List[torch.Tensor]]:
        """name -> the device tensors of ``msg.momentum``'s ranges, in that order (views of
        the state, or of the staging buffer once its fetch arrived)."""
        if self.staging is None:
            return {n: [self.state[self.masters[p]][n][s:e] for p, s, e in msg.momentum] for n in self.names}
        return self.staging.fetch(msg.index)

    def release(self, msg: ChunkMessages) -> None:
        """The step is done with ``msg``'s ranges: offloaded, write them back to the pool and
        fetch the next chunk's into the same staging buffer (stream order keeps them apart)."""
        if self.staging is not None:
            self.staging.release(msg.index)

    def finish(self) -> None:
        """End the step: wait for the last write-back and free the staging buffers."""
        if self.staging is not None:
            self.staging.finish()


# ---------------------------------------------------------------------------------------
# Owner-kept states: one tensor per logical matrix
# ---------------------------------------------------------------------------------------

MatrixKey = Tuple[int, int]
"""(job index, column group): one logical matrix of the plan."""


def logical(matrix: torch.Tensor, job: Job) -> torch.Tensor:
    """A storage-orientation matrix (or stack) seen in logical ``(out, in)`` orientation."""
    return matrix.mT if job.matrix.transposed else matrix


class OwnerStates:
    """The owner-kept Muon states of the logical matrices this rank orthogonalizes."""

    def __init__(self, states: Sequence[MatrixState], storage: Optional[torch.device]) -> None:
        """``storage``: where the states live between steps (the CPU with offload)."""
        self.states = {s.name: s for s in states}
        self.storage = storage
        self.values: Dict[str, Dict[MatrixKey, torch.Tensor]] = {name: {} for name in self.states}
        """name -> (job index, column group) -> fp32 tensor (logical orientation)."""

    def get(self, name: str, job: Job, group: int) -> torch.Tensor:
        """The state of one logical matrix (zeros at first)."""
        key = (job.index, group)
        values = self.values[name]
        if key not in values:
            values[key] = torch.zeros(
                self.states[name].shape(*job.matrix.scale_shape), dtype=torch.float32, device=self.storage
            )
        return values[key]

    def clear(self) -> None:
        for values in self.values.values():
            values.clear()

    def expanded(self, name: str, job: Job, device: Optional[torch.device]) -> List[torch.Tensor]:
        """Per column group of ``job``: its state broadcast to the whole matrix (storage
        orientation, fp32): what a checkpoint stores, in parameter coordinates."""
        rows, cols = job.matrix.ns_shape
        shape = (cols, rows) if job.matrix.transposed else (rows, cols)
        out = []
        for k in range(job.matrix.column_groups):
            full = self.get(name, job, k).to(device).expand(shape)
            out.append((full.mT if job.matrix.transposed else full).contiguous())
        return out

    def set_from_expanded(self, name: str, job: Job, matrices: List[torch.Tensor]) -> None:
        """Inverse of :meth:`expanded`: the state read off the first rows / columns it was
        broadcast along (exact: no averaging of the identical copies)."""
        for k, matrix in enumerate(matrices):
            rows, cols = self.states[name].shape(*job.matrix.scale_shape)
            self.get(name, job, k).copy_(logical(matrix, job)[:rows, :cols])


# ---------------------------------------------------------------------------------------
# fp32 masters of the Muon matrices in a CPU pool
# ---------------------------------------------------------------------------------------


class OffloadedMasters:
    """The fp32 master shards of the Muon matrices, held in one CPU pool (pinned where
    CUDA is available), and staged on the device chunk by chunk for the step.

    Megatron's code knows a master by its ``torch.nn.Parameter`` object (optimizer
    groups, state keys, grad norm, clipping), so each master stays that object and only
    its ``.data`` moves: it is the pool view between steps, where checkpoints read and
    write it. The step updates the masters on the device: each chunk's ranges are staged
    there (:meth:`fetch`, a :class:`ChunkStaging` of two buffers: the next chunk's ranges
    arrive while one chunk's are updated), decayed, updated and QK-Clipped there, written
    into the model's parameters there (:meth:`release`: the same fp32 -> bf16/fp16 rounding
    as Megatron's copy, on the device) and back to the pool on a side stream. Megatron's
    master -> model copy then has nothing left to do for them (:meth:`model_ranges_in_place`);
    where the storage cannot give the model's ranges (FP8 / FP4 parameter gathers, which
    quantize from the masters), it reads a pinned pool rounded on the CPU instead
    (:meth:`in_model_dtype`).

    ``.data`` moves once more, for Megatron's ``_copy_model_grads_to_main_grads``: torch lets a
    parameter take a ``.grad`` only on its own device, so for that call (see
    :meth:`grads_assignable`) ``.data`` becomes a zero-stride device placeholder (one
    element shared by all masters; a write to it raises). The gradients themselves stay
    on the device, where Megatron's norm, clipping and zero counting read them.

    Only masters of bf16/fp16 parameters are offloaded: an fp32 parameter's master is a
    view of the parameter itself."""

    def __init__(
        self,
        masters: Sequence[torch.Tensor],
        model_ranges: Sequence[Optional[torch.Tensor]],
        device: Optional[torch.device],
    ) -> None:
        """``model_ranges[i]``: the range of the model's parameter storage (its dtype, on the
        device) that ``masters[i]`` is copied into, or None where the storage's copy is not
        a plain one."""
        self.masters = list(masters)
        self.model_ranges = list(model_ranges)
        self.pool = torch.empty(
            sum(m.numel() for m in self.masters), dtype=torch.float32, pin_memory=torch.cuda.is_available()
        )
        self.views: List[torch.Tensor] = []
        offset = 0
        for master in self.masters:
            view = self.pool[offset : offset + master.numel()]
            view.copy_(master.detach().reshape(-1))
            master.data = view  # the device copy Megatron allocated is freed here
            self.views.append(view)
            offset += master.numel()
        self.device = device if device is not None else torch.device("cpu")
        self._placeholder = torch.zeros(1, dtype=torch.float32, device=device)
        self._pinned: Dict[Tuple[str, torch.dtype], torch.Tensor] = {}
        self.staging: Optional[ChunkStaging] = None
        """The chunks' ranges of the pool on the device during a step (:meth:`stage_for`)."""
        self.staged_params: FrozenSet[int] = frozenset()
        """The Muon params (their index in the step) whose masters are staged (:meth:`stage_for`)."""
        self._in_model: List[Optional[torch.Tensor]] = []
        """Per Muon param of the step: the model's range its master is written into."""
        self.model_written = False
        """The last step wrote every master's rounded values into the model's parameters,
        and nothing changed them since (the next master -> model copy uses this once)."""

    def stage_for(self, masters: Sequence[Optional[torch.Tensor]], messages: Sequence[ChunkMessages]) -> None:
        """Stage, for each chunk of ``messages``, the offloaded masters' ranges it updates
        (its ``scatter_apply``); ``masters[p]``: the step's master of Muon param ``p`` (None:
        this rank holds none; one not in the pool is updated where it is)."""
        pooled = {id(m): i for i, m in enumerate(self.masters)}
        index = [pooled.get(id(m)) if m is not None else None for m in masters]
        views = [self.views[i] if i is not None else None for i in index]
        self.staged_params = frozenset(p for p, view in enumerate(views) if view is not None)
        self._in_model = [self.model_ranges[i] if i is not None else None for i in index]
        ranges = [[(p, s, e) for p, s, e, _ in msg.scatter_apply if views[p] is not None] for msg in messages]
        self.staging = ChunkStaging({MASTER: views}, ranges, self.device, buffers=2)

    @property
    def pool_bytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def begin(self) -> None:
        """Start a step: the first chunks' masters on their way to the device."""
        self.model_written = False
        self.staging.begin()

    def fetch(self, msg: ChunkMessages) -> Dict[Piece, torch.Tensor]:
        """Range -> its staged master on the device, for ``msg``'s offloaded ranges."""
        return dict(zip(self.staging.ranges[msg.index], self.staging.fetch(msg.index)[MASTER]))

    def release(self, msg: ChunkMessages, staged: Dict[Piece, torch.Tensor]) -> None:
        """``msg``'s masters are updated: their values into the model's parameters (where the
        storage gave their ranges), then back to the pool (:meth:`ChunkStaging.release`)."""
        for (p, s, e), master in staged.items():
            if self._in_model[p] is not None:
                self._in_model[p][s:e].copy_(master)
        self.staging.release(msg.index)

    def finish(self) -> None:
        """End the step: the pool current again (the last write-back waited for)."""
        self.staging.finish()
        self.model_written = all(r is not None for r in self.model_ranges)

    @contextmanager
    def model_ranges_in_place(self) -> Iterator[None]:
        """Every master is its model's range while Megatron copies the masters into the
        model's parameters, after a step that wrote them there (:attr:`model_written`): the
        copy of a tensor onto the same memory returns at once (torch's ``copy_``), so
        Megatron's copy has nothing to do for them."""
        for master, model_range in zip(self.masters, self.model_ranges):
            master.data = model_range
        try:
            yield
        finally:
            self.model_written = False
            for master, view in zip(self.masters, self.views):
                master.data = view

    def _host_buffer(self, use: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A reused host buffer of at least ``numel`` elements (pinned with CUDA, so that
        copies to and from the device run at the link's rate and do not stage through a
        pageable temporary)."""
        buffer = self._pinned.get((use, dtype))
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, pin_memory=torch.cuda.is_available())
            self._pinned[(use, dtype)] = buffer
        return buffer[:numel]

    @contextmanager
    def in_model_dtype(self, dtype: torch.dtype) -> Iterator[None]:
        """Every master's values rounded to the model's ``dtype`` in a pinned host pool while
        Megatron copies the masters into the model's parameters: its copy is then one
        same-dtype copy from pinned memory per parameter (a cross-dtype copy from the host
        would round into a pageable temporary first). The rounding is the copy's own."""
        staging = self._host_buffer("model", self.pool.numel(), dtype)
        staging.copy_(self.pool)
        offset = 0
        for master in self.masters:
            master.data = staging[offset : offset + master.numel()]
            offset += master.numel()
        try:
            yield
        finally:
            for master, view in zip(self.masters, self.views):
                master.data = view

    def in_pool(self) -> bool:
        """Whether every master's values are its pool view now (between and during steps)."""
        return all(m.data_ptr() == v.data_ptr() for m, v in zip(self.masters, self.views))

    @contextmanager
    def grads_assignable(self) -> Iterator[None]:
        """Masters on the device placeholder, so that Megatron can set device ``.grad``s."""
        for master in self.masters:
            master.data = self._placeholder.expand(master.numel())
        try:
            yield
        finally:
            for master, view in zip(self.masters, self.views):
                master.data = view
