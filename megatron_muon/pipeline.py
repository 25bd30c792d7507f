"""The Muon step as a pipeline of small stages, chunk by chunk, overlapped.

For every chunk of the plan, on every rank of the orthogonalization group:

1. **launch gather** – pack this rank's pieces of the chunk's matrices (the Nesterov
   momentum of its distributed-optimizer shard), ordered by owner, and start one
   ``all_to_all_single`` that delivers each piece to the rank that owns its matrix.
2. **complete gather** – wait, then assemble every owned matrix from its pieces: each
   TP rank's piece from the DP ranks' byte ranges, then the TP pieces along the
   partition dim.
3. **compute** – Newton–Schulz on the owned matrices, same shapes stacked into one
   batched call, times each matrix's update scale; a matrix the plan split over several
   ranks is orthogonalized by its split group first (``split_newton_schulz``: its owner
   scatters column blocks, the group all-reduces the Gram matrix each step).
4. **launch scatter** – cut every result back into the pieces the holders need, start
   the reverse ``all_to_all_single``.
5. **complete scatter** – wait for this rank's update pieces.
6. **update** – hand each piece to the caller (weight decay and learning rate are
   applied there, on the fp32 master shard).

The orchestrator keeps up to ``max_inflight`` gathers in flight, so chunk ``i+1``'s
gather travels while chunk ``i`` computes, and chunk ``i``'s scatter travels while
chunk ``i+1`` computes. A step is two calls, ``launch_first_gathers`` and ``run_chunks``,
so that the caller can do other work while the first gathers travel (the chained
optimizer runs the expert step there). Every stage appends an event to ``events`` so
tests can see the order. Bytes each rank sends are counted in ``traffic``.
"""

from __future__ import annotations

import math

from collections import defaultdict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .newton_schulz import newton_schulz
from .planner import Chunk, Job, Plan, Segment
from .split_newton_schulz import SplitNewtonSchulz

UpdateFn = Callable[[int, int, int, torch.Tensor], None]
"""``apply(param_index, local_start, local_end, update)`` for one received update piece."""

PiecesFn = Callable[["_ChunkComm"], List[torch.Tensor]]
"""``pieces(comm)``: this rank's gather inputs of one chunk, one tensor per entry of
``comm.gather_send`` (used by the CPU offload, which produces them chunk by chunk)."""

AfterNewtonSchulz = Callable[[Sequence[Tuple[Job, int]], torch.Tensor], torch.Tensor]
"""``hook(members, stack)``: transforms a stack of orthogonalized matrices (``members[i]`` =
(job, column group) of ``stack[i]``) before the update scale (variance reduction)."""


@dataclass
class _ChunkComm:
    """This rank's share of one chunk: what to send, what arrives, where it goes."""

    chunk: Chunk
    owned: List[Job]
    gather_send: List[Tuple[int, int, int]] = field(default_factory=list)
    gather_send_splits: List[int] = field(default_factory=list)
    gather_recv_splits: List[int] = field(default_factory=list)
    gather_place: List[Tuple[int, int, int, int, int]] = field(default_factory=list)
    """(owned job position, tp, piece_offset, recv_offset, numel)."""
    scatter_send: List[Tuple[int, int, int, int]] = field(default_factory=list)
    """(owned job position, tp, piece_offset, numel), in destination order."""
    scatter_send_splits: List[int] = field(default_factory=list)
    scatter_recv_splits: List[int] = field(default_factory=list)
    scatter_apply: List[Tuple[int, int, int, int]] = field(default_factory=list)
    """(param_index, local_start, local_end, recv_offset)."""
    gather_remote: bool = True
    scatter_remote: bool = True
    """Whether any rank of the group sends anything in this chunk's gather / scatter (the
    same answer on every rank: it comes from the shared plan). If not, no collective runs."""


@dataclass
class _Pending:
    recv: torch.Tensor
    work: Optional[dist.Work]


class MuonPipeline:
    """Runs one Muon orthogonalization step over a ``Plan`` on this rank."""

    def __init__(
        self,
        plan: Plan,
        local_starts: Sequence[int],
        scales: Sequence[float],
        ns_steps: int,
        coefficients: str,
        ns_dtype: torch.dtype,
        comm_dtype: torch.dtype,
        max_inflight: int = 2,
        device: Optional[torch.device] = None,
        name: str = "dense",
        events: Optional[List[Tuple[str, str, int]]] = None,
        ns_method: str = "standard",
        compiled: bool = False,
    ) -> None:
        """``local_starts[p]``: where this rank's shard of param ``p`` starts in the param's
        flat storage. ``scales[j]``: update scale of job ``j``. ``ns_method`` and
        ``compiled`` go to every :func:`newton_schulz` call."""
        self.plan = plan
        self.group = plan.group
        self.local_starts = list(local_starts)
        self.scales = list(scales)
        self.ns_steps = ns_steps
        self.coefficients = coefficients
        self.ns_dtype = ns_dtype
        self.ns_method = ns_method
        self.compiled = compiled
        self.comm_dtype = comm_dtype
        self.max_inflight = max_inflight
        self.device = device
        self.comms = [self._chunk_comm(chunk) for chunk in plan.chunks]
        self.name = name
        self.events: List[Tuple[str, str, int]] = events if events is not None else []
        """Stage events (pipeline name, stage, chunk index), appended in execution order;
        the owner clears the list at the start of each step."""
        self.traffic: Dict[str, int] = defaultdict(int)
        self.split = (
            SplitNewtonSchulz(plan, ns_steps, coefficients, ns_dtype, device, self.traffic)
            if any(j.split for j in plan.jobs)
            else None
        )
        """Runs the plan's split jobs (one matrix over several ranks); None if there are none."""
        self.computed: List[str] = []
        """Names of the matrices this rank orthogonalized in the last step."""
        self.after_newton_schulz: Optional[AfterNewtonSchulz] = None

    # ---------------------------------------------------------------- plan -> messages
    def _chunk_comm(self, chunk: Chunk) -> _ChunkComm:
        g = self.group
        me = g.rank
        owned = [job for job in chunk.jobs if job.owner == me]
        pos = {job.index: i for i, job in enumerate(owned)}
        comm = _ChunkComm(chunk=chunk, owned=owned, gather_remote=False, scatter_remote=False)
        send: List[list] = [[] for _ in range(g.size)]
        recv: List[list] = [[] for _ in range(g.size)]
        for job in chunk.jobs:
            for seg in job.sources:
                holder = g.rank_of(seg.tp, seg.dp)
                comm.gather_remote |= holder != job.owner
                if holder == me:
                    send[job.owner].append(self._local(job, seg))
                if job.owner == me:
                    recv[holder].append((pos[job.index], seg))
        comm.gather_send = [item for items in send for item in items]
        comm.gather_send_splits = [sum(e - s for _, s, e in items) for items in send]
        offset = 0
        for items in recv:
            for job_pos, seg in items:
                comm.gather_place.append((job_pos, seg.tp, seg.piece_offset, offset, seg.numel))
                offset += seg.numel
        comm.gather_recv_splits = [sum(seg.numel for _, seg in items) for items in recv]

        out: List[list] = [[] for _ in range(g.size)]
        back: List[list] = [[] for _ in range(g.size)]
        for job in chunk.jobs:
            for seg in job.dests:
                holder = g.rank_of(seg.tp, seg.dp)
                comm.scatter_remote |= holder != job.owner
                if job.owner == me:
                    out[holder].append((pos[job.index], seg.tp, seg.piece_offset, seg.numel))
                if holder == me:
                    back[job.owner].append(self._local(job, seg))
        comm.scatter_send = [item for items in out for item in items]
        comm.scatter_send_splits = [sum(item[3] for item in items) for items in out]
        offset = 0
        for items in back:
            for param_index, start, end in items:
                comm.scatter_apply.append((param_index, start, end, offset))
                offset += end - start
        comm.scatter_recv_splits = [sum(e - s for _, s, e in items) for items in back]
        return comm

    def _event(self, stage: str, comm: _ChunkComm) -> None:
        self.events.append((self.name, stage, comm.chunk.index))

    def _local(self, job: Job, seg: Segment) -> Tuple[int, int, int]:
        base = self.local_starts[job.param_index]
        return job.param_index, seg.start - base, seg.end - base

    # ---------------------------------------------------------------- stages
    def _exchange(
        self, kind: str, send: torch.Tensor, send_splits: List[int], recv_splits: List[int], remote: bool
    ) -> _Pending:
        g = self.group
        self.traffic[kind] += (sum(send_splits) - send_splits[g.rank]) * send.element_size()
        if g.size == 1 or not remote:
            # Everything stays on its rank, in the same order it would arrive in.
            return _Pending(send, None)
        recv = torch.empty(sum(recv_splits), dtype=send.dtype, device=send.device)
        work = dist.all_to_all_single(recv, send, recv_splits, send_splits, group=g.group, async_op=True)
        return _Pending(recv, work)

    def launch_gather(
        self,
        comm: _ChunkComm,
        inputs: Union[Sequence[Optional[torch.Tensor]], PiecesFn],
        dtype: Optional[torch.dtype] = None,
    ) -> _Pending:
        self._event("launch_gather", comm)
        dtype = dtype or self.comm_dtype
        parts = inputs(comm) if callable(inputs) else [inputs[p][s:e] for p, s, e in comm.gather_send]
        send = torch.cat(parts).to(dtype) if parts else self._empty(dtype)
        return self._exchange(
            "muon_gather", send, comm.gather_send_splits, comm.gather_recv_splits, comm.gather_remote
        )

    def complete_gather(self, comm: _ChunkComm, pending: _Pending) -> List[List[torch.Tensor]]:
        """Wait for the pieces; return, per owned job, its Newton–Schulz inputs (fp32)."""
        if pending.work is not None:
            pending.work.wait()
        self._event("complete_gather", comm)
        recv = pending.recv.float()
        pieces: List[Dict[int, torch.Tensor]] = []
        for job in comm.owned:
            tps = sorted({s.tp for s in job.sources})
            numels = {t: math.prod(job.matrix.piece_shape_on(t)) for t in tps}
            pieces.append({t: torch.empty(numels[t], dtype=torch.float32, device=recv.device) for t in tps})
        for job_pos, tp, piece_offset, recv_offset, numel in comm.gather_place:
            pieces[job_pos][tp][piece_offset : piece_offset + numel] = recv[recv_offset : recv_offset + numel]
        return [self._assemble(job, p) for job, p in zip(comm.owned, pieces)]

    @staticmethod
    def _assemble(job: Job, pieces: Dict[int, torch.Tensor]) -> List[torch.Tensor]:
        """Join the TP pieces along the partition dim, one matrix per column group."""
        m = job.matrix
        groups = [pieces[t].view(m.piece_shape_on(t)).chunk(m.column_groups, dim=1) for t in sorted(pieces)]
        if len(groups) == 1:
            return list(groups[0])
        return [torch.cat([g[k] for g in groups], dim=m.tp_dim) for k in range(m.column_groups)]

    def compute(self, comm: _ChunkComm, matrices: List[List[torch.Tensor]]) -> List[List[torch.Tensor]]:
        """Split jobs with their groups, then batched Newton–Schulz per shape; times each
        job's update scale."""
        self._event("compute", comm)
        self.computed.extend(job.matrix.name for job in comm.owned)
        outputs: List[List[Optional[torch.Tensor]]] = [[None] * len(g) for g in matrices]
        if self.split is not None:
            split = self.split.run(comm.chunk.jobs, {job.index: m for job, m in zip(comm.owned, matrices)})
            for i, job in enumerate(comm.owned):
                if job.index in split:
                    outs = split[job.index]
                    if self.after_newton_schulz is not None:
                        outs = [self.after_newton_schulz([(job, k)], o.unsqueeze(0))[0] for k, o in enumerate(outs)]
                    outputs[i] = [o * self.scales[job.index] for o in outs]
        by_shape: Dict[Tuple[int, int], List[Tuple[int, int]]] = defaultdict(list)
        for i, group in enumerate(matrices):
            if comm.owned[i].split:
                continue
            for k, m in enumerate(group):
                by_shape[tuple(m.shape)].append((i, k))
        for members in by_shape.values():
            stack = torch.stack([matrices[i][k] for i, k in members])
            ortho = newton_schulz(
                stack, self.ns_steps, self.coefficients, self.ns_dtype, compiled=self.compiled, method=self.ns_method
            )
            if self.after_newton_schulz is not None:
                ortho = self.after_newton_schulz([(comm.owned[i], k) for i, k in members], ortho)
            scales = [self.scales[comm.owned[i].index] for i, _ in members]
            ortho = ortho * torch.tensor(scales, dtype=ortho.dtype, device=ortho.device).view(-1, 1, 1)
            for row, (i, k) in enumerate(members):
                outputs[i][k] = ortho[row]
        return outputs

    def launch_scatter(
        self, comm: _ChunkComm, outputs: List[List[torch.Tensor]], dtype: Optional[torch.dtype] = None
    ) -> _Pending:
        self._event("launch_scatter", comm)
        dtype = dtype or self.comm_dtype
        flat_pieces = [self._split_pieces(job, out) for job, out in zip(comm.owned, outputs)]
        parts = [flat_pieces[j][tp][o : o + n] for j, tp, o, n in comm.scatter_send]
        send = torch.cat(parts).to(dtype) if parts else self._empty(dtype)
        return self._exchange(
            "muon_scatter", send, comm.scatter_send_splits, comm.scatter_recv_splits, comm.scatter_remote
        )

    @staticmethod
    def _split_pieces(job: Job, outs: List[torch.Tensor]) -> Dict[int, torch.Tensor]:
        """The results cut back into each destination TP rank's flat piece."""
        m = job.matrix
        dest_tps = sorted({s.tp for s in job.dests})
        if m.replicated or len(m.pieces) == 1:
            flat = torch.cat(outs, dim=1).reshape(-1) if len(outs) > 1 else outs[0].reshape(-1)
            return {t: flat for t in dest_tps}
        order = [t for t, _ in m.pieces]
        per_group = [out.split(m.piece_extents(), dim=m.tp_dim) for out in outs]
        return {
            t: torch.cat([g[order.index(t)] for g in per_group], dim=1).reshape(-1)
            if len(outs) > 1
            else per_group[0][order.index(t)].contiguous().view(-1)
            for t in dest_tps
        }

    def complete_scatter(self, comm: _ChunkComm, pending: _Pending) -> torch.Tensor:
        if pending.work is not None:
            pending.work.wait()
        self._event("complete_scatter", comm)
        return pending.recv

    def update(self, comm: _ChunkComm, recv: torch.Tensor, apply: UpdateFn) -> None:
        self._event("update", comm)
        for param_index, start, end, offset in comm.scatter_apply:
            apply(param_index, start, end, recv[offset : offset + end - start])

    def _empty(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        return torch.empty(0, dtype=dtype or self.comm_dtype, device=self.device)

    # ---------------------------------------------------------------- outside the step
    @contextmanager
    def _off_step(self) -> Iterator[None]:
        """State movement between steps is neither step traffic nor a step event."""
        traffic, events = dict(self.traffic), len(self.events)
        try:
            yield
        finally:
            self.traffic.clear()
            self.traffic.update(traffic)
            del self.events[events:]

    def gather_whole(
        self, inputs: Sequence[Optional[torch.Tensor]], dtype: torch.dtype = torch.float32
    ) -> Iterator[Tuple[Job, List[torch.Tensor]]]:
        """Collective, outside the step: each holder's flat shard pieces of ``inputs``
        (shaped like the parameter shards) travel to the owners as in the step's gather,
        but in ``dtype`` (fp32: optimizer state, not a step's momentum) and chunk by chunk
        without overlap; yields every owned ``(job, matrices)`` (storage orientation)."""
        with self._off_step():
            for comm in self.comms:
                recv = self.complete_gather(comm, self.launch_gather(comm, inputs, dtype))
                yield from zip(comm.owned, recv)

    def scatter_whole(
        self, outputs: Callable[[Job], List[torch.Tensor]], apply: UpdateFn, dtype: torch.dtype = torch.float32
    ) -> None:
        """Collective, outside the step: the reverse of :meth:`gather_whole`; ``outputs(job)``
        gives an owned job's matrices, ``apply`` receives every piece this rank holds."""
        with self._off_step():
            for comm in self.comms:
                pending = self.launch_scatter(comm, [outputs(job) for job in comm.owned], dtype)
                self.update(comm, self.complete_scatter(comm, pending), apply)

    # ---------------------------------------------------------------- orchestrator
    def launch_first_gathers(self, inputs: Union[Sequence[Optional[torch.Tensor]], PiecesFn]) -> "PipelineRun":
        """Start one orthogonalization step: launch the gathers of the first
        ``max_inflight`` chunks and return while they are in flight (nothing waits here).
        ``inputs[p]``: this rank's 1-D shard of the momentum (Nesterov) of param ``p``
        (None where this rank holds nothing); or a ``PiecesFn`` that produces each chunk's
        pieces when the chunk is launched. Finish the step with :meth:`run_chunks`."""
        self.computed = []
        run = PipelineRun(inputs)
        for _ in range(self.max_inflight):
            self._launch_next_gather(run)
        return run

    def _launch_next_gather(self, run: "PipelineRun") -> None:
        if run.launched < len(self.comms):
            run.gathers.append((run.launched, self.launch_gather(self.comms[run.launched], run.inputs)))
            run.launched += 1

    def run_chunks(self, run: "PipelineRun", apply: UpdateFn) -> None:
        """Finish a step started by :meth:`launch_first_gathers`: chunk after chunk, wait
        for its gather, launch the next chunk's gather, compute, launch its scatter, and
        apply the previous chunk's update pieces (``apply``), so one gather and one scatter
        travel while a chunk computes."""
        scatters: deque = deque()
        while run.gathers:
            i, pending = run.gathers.popleft()
            comm = self.comms[i]
            matrices = self.complete_gather(comm, pending)
            self._launch_next_gather(run)
            outputs = self.compute(comm, matrices)
            scatters.append((i, self.launch_scatter(comm, outputs)))
            if len(scatters) > 1:
                j, done = scatters.popleft()
                self.update(self.comms[j], self.complete_scatter(self.comms[j], done), apply)
        while scatters:
            j, done = scatters.popleft()
            self.update(self.comms[j], self.complete_scatter(self.comms[j], done), apply)

    def run(self, inputs: Union[Sequence[Optional[torch.Tensor]], PiecesFn], apply: UpdateFn) -> None:
        """One whole orthogonalization step (:meth:`launch_first_gathers`, then :meth:`run_chunks`)."""
        self.run_chunks(self.launch_first_gathers(inputs), apply)


@dataclass
class PipelineRun:
    """One step of a :class:`MuonPipeline` in progress: its inputs and the chunks whose
    gathers are in flight (chunk index, pending exchange), oldest first."""

    inputs: Union[Sequence[Optional[torch.Tensor]], PiecesFn]
    gathers: deque = field(default_factory=deque)
    launched: int = 0
    """Chunks whose gather has been launched."""
