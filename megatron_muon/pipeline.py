"""The Muon step: one object per ``step()`` (:class:`StepWork`), its chunks, and the two
schedules that run them.

Each optimizer's plan cuts its matrices into chunks (``planner.py``). A chunk is one
generator (:meth:`StepWork.chunk`) that runs the stages of the rule (``rule.py``) where the
data is, on every rank of the orthogonalization group:

1. **before** on this rank's master ranges: the momentum and the orthogonalization inputs;
2. **gather**: pack this rank's pieces, ordered by owner, and start one
   ``all_to_all_single`` that delivers each piece to the rank that orthogonalizes its
   matrix; *yield* while it travels;
3. **orthogonalize** and **after** on the owner: the owned matrices of one shape as one
   batched Newton–Schulz (``planner.Stack``; a matrix planned over several ranks with them:
   ``multirank_newton_schulz``), then variance reduction if on and the update scale. Where a
   stack arrives whole and in order it is read in place from the receive buffer and its
   update written in place into the send buffer; otherwise each matrix is assembled from
   its TP x DP pieces and its update cut back into them;
4. **scatter**: the reverse ``all_to_all_single``; *yield* while it travels;
5. **apply** on each arriving piece's fp32 master range. CPU-offloaded masters
   (``state.OffloadedMasters``) are staged on the device for it, chunk by chunk on side
   streams like the offloaded momentum; there each range is also scaled by QK-Clip's
   factors and written into the model's parameter before it goes back to the pool.

:meth:`StepWork.run` drives chunks: it launches the gathers of up to
``muon_max_inflight_chunks`` chunks ahead of the one it completes, so one chunk's
communication travels while another computes, and runs another optimizer's chunks (the
expert ones) while the first gathers are in flight. Everything a chunk sends and receives
was computed once from the plan (``planner.rank_messages``).

The step is begun once, when a :class:`StepWork` is made (the shard states' step, this
step's learning rates), and each optimizer's part ends when its last chunk has run, by
whichever schedule ran it. Two schedules run it (``muon_step_overlap``):

- :class:`RunNow` ('none'): every chunk inside ``optimizer.step()``, then QK-Clip's scaling,
  the master -> model copy and the parameter sync;
- :class:`PendingStep` ('forward'): inside ``step()`` only every chunk's first stage (after
  it no chunk reads a gradient, so the next backward may reuse the buffers); the rest of
  each chunk, QK-Clip's scaling and the copy run before the next forward syncs the
  parameters they touch, unit by unit of the parameter sync (DDP: bucket group). The
  storage backend calls :meth:`PendingStep.before_sync` there (``storage.hook_param_sync``).
  A chunk computes the same bits whenever it runs: it reads only its orthogonalization
  inputs, the masters it updates and the captured learning rates; every rank of a group
  runs the same forward and so finishes the same chunks in the same order.

Each stage is a ``torch.profiler`` range, ``muon/momentum``, ``muon/gather`` (launch and
wait), ``muon/newton_schulz``, ``muon/scatter`` (launch and wait), ``muon/update``.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Collection, Dict, FrozenSet, Iterable, Iterator, List, Optional, Sequence, Set, Tuple, Union

import torch
import torch.distributed as dist
from torch.profiler import record_function

from .planner import ChunkMessages, Piece
from .process_groups import OrthoGroup
from .qk_clip import scale_master_rows_
from .rule import AppliedChunk, MuonRule
from .shard_map import ShardMap
from .state import OffloadedMasters, OwnerStates, ShardStates
from .support import step_overlap_cannot_run
from .timers import megatron_timer


@dataclass
class MuonPipeline:
    """What one optimizer's Muon step reads, built once with the optimizer."""

    group: OrthoGroup
    messages: List[ChunkMessages]
    masters: List[Optional[torch.Tensor]]
    """This rank's fp32 master of every Muon param (None where it holds none)."""
    shard_states: ShardStates
    owner_states: OwnerStates
    rule: MuonRule
    device: Optional[torch.device]
    max_inflight: int
    """How many chunks' gathers may be in flight while one computes (``muon_max_inflight_chunks``)."""
    subgroups: Dict[Tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)
    """The process groups of the multi-rank jobs this rank takes part in."""
    offloaded_masters: Optional[OffloadedMasters] = None
    """The fp32 masters in a CPU pool (``optimizer_cpu_offload``), staged on the device for
    each chunk's update, or None."""

    # Owner-kept states in parameter coordinates, for checkpoints (outside the step).

    def owner_state_to_holders(self, name: str) -> Iterator[Tuple[Piece, torch.Tensor]]:
        """Collective over the orthogonalization group: the owner-kept state ``name`` of
        every owned matrix, expanded to the matrix (``OwnerStates.expanded``), cut to the
        holders of its pieces as the step's scatter cuts an update (one exchange per chunk,
        fp32); yields this rank's pieces ``((param index, start, end), values)``."""
        for msg in self.messages:
            outputs = [self.owner_states.expanded(name, job, self.device) for job in msg.owned]
            send = torch.empty(sum(msg.scatter_send_splits), dtype=torch.float32, device=self.device)
            cut_pieces(msg, outputs, send)
            recv, work = exchange(
                self.group, send, msg.scatter_send_splits, msg.scatter_recv_splits, msg.scatter_remote
            )
            if work is not None:
                work.wait()
            for p, s, e, offset in msg.scatter_apply:
                yield (p, s, e), recv[offset : offset + e - s]

    def owner_state_from_holders(self, name: str, inputs: Sequence[Optional[torch.Tensor]]) -> None:
        """Collective, the reverse of :meth:`owner_state_to_holders`: every holder's pieces
        of ``inputs`` (the state in parameter coordinates, shaped like the masters) travel
        to the owners as in the step's gather (one exchange per chunk, fp32), and each owner
        keeps its matrices' state (``OwnerStates.set_from_expanded``)."""
        for msg in self.messages:
            pieces = [inputs[p][s:e] for p, s, e in msg.gather_send]
            recv, work = exchange(
                self.group, pieces, msg.gather_send_splits, msg.gather_recv_splits, msg.gather_remote,
                torch.float32, self.device,
            )  # fmt: skip
            if work is not None:
                work.wait()
            for job, matrices in zip(msg.owned, assemble(msg, recv)):
                self.owner_states.set_from_expanded(name, job, matrices)


Clip = Tuple[ShardMap, torch.nn.Parameter, torch.Tensor]
"""QK-Clip's row factors of one parameter, with the shard map of the optimizer holding it."""


class StepWork:
    """One ``step()`` of chained Muon optimizers (dense first): one generator per chunk of
    every optimizer's plan (:meth:`chunk`), and what the chunks share in this step: the
    learning rates captured at its start, the orthogonalization inputs a later chunk sends
    again, the update sizes it measured, and which chunks have not run yet."""

    def __init__(
        self, pipelines: Sequence[MuonPipeline], lr_wd: Sequence[Sequence[Tuple[float, float]]], measure: bool
    ) -> None:
        """``lr_wd[o][p]``: this step's (learning rate, weight decay) of optimizer ``o``'s
        Muon param ``p``; ``measure``: sum the squares of the updates (the update RMS)."""
        self.pipelines = list(pipelines)
        self.lr_wd = [list(x) for x in lr_wd]
        self.measure = measure
        self.square_sum: Optional[torch.Tensor] = None
        self.numel = 0
        """Sum of squares and count of the elements of the updates this rank computed (the
        owners' matrices): the update RMS a run logs."""
        self.kept: List[Dict[Piece, torch.Tensor]] = [{} for _ in self.pipelines]
        """Per optimizer: inputs of ranges a later chunk sends again (duplicated TP mode)."""
        self.remaining: List[Dict[int, Iterator[None]]] = [
            {msg.index: self.chunk(position, msg) for msg in p.messages} for position, p in enumerate(self.pipelines)
        ]
        """Per optimizer: chunk index -> its generator, for the chunks not run yet (plan order)."""
        self.advanced: Set[Tuple[int, int]] = set()
        """(optimizer, chunk) whose first stage ran ahead (:meth:`run` with ``momentum_only``)."""
        self.made: List[torch.Tensor] = []
        """The orthogonalization inputs the first stages ran ahead made (the rest reads them)."""
        self.ended: Set[int] = set()
        self.staged_clips: List[Dict[int, Clip]] = [{} for _ in self.pipelines]
        """Per optimizer: Muon param index -> QK-Clip's factors of its master, scaled on the
        device range by range after the update (masters staged there: the CPU offload)."""
        for position, pipeline in enumerate(self.pipelines):
            pipeline.shard_states.begin()
            if pipeline.offloaded_masters is not None:
                pipeline.offloaded_masters.begin()
            if not pipeline.messages:
                self.end(position)

    def clip_staged(self, clips: Sequence[Clip]) -> List[Clip]:
        """Hand QK-Clip's factors of the CPU-offloaded masters to the chunks that update them
        (each range is scaled on the device after its update, before it is written into the
        model's parameters: the same bits as scaling the whole master afterwards, since
        each element is scaled once, after its update); returns the other clips."""
        staged: Dict[int, Tuple[int, int]] = {}
        for position, pipeline in enumerate(self.pipelines):
            if pipeline.offloaded_masters is not None:
                staged.update(
                    {id(pipeline.masters[p]): (position, p) for p in pipeline.offloaded_masters.staged_params}
                )
        rest = []
        for clip in clips:
            shard_map, param, _ = clip
            where = staged.get(id(shard_map[param].master))
            if where is None:
                rest.append(clip)
            else:
                self.staged_clips[where[0]][where[1]] = clip
        return rest

    def measured(self) -> Optional[Tuple[Optional[torch.Tensor], int]]:
        """``(square_sum, numel)`` of this step's updates, if it measured them."""
        return (self.square_sum, self.numel) if self.measure else None

    def end(self, position: int) -> None:
        """End optimizer ``position``'s part of the step (its shard states' and masters'
        staging written back and freed)."""
        if position not in self.ended:
            self.ended.add(position)
            pipeline = self.pipelines[position]
            pipeline.shard_states.finish()
            if pipeline.offloaded_masters is not None:
                pipeline.offloaded_masters.finish()

    def run(
        self,
        position: int,
        indices: Optional[Iterable[int]] = None,
        overlapped: Optional[int] = None,
        momentum_only: bool = False,
    ) -> None:
        """Run optimizer ``position``'s chunks not run yet (only ``indices`` if given), in
        plan order, overlapped: each chunk is advanced to its gather in flight, to its
        scatter in flight, to the end; up to ``max_inflight`` gathers are launched ahead of
        the chunk being completed, and each scatter travels while the next chunk computes.
        Optimizer ``overlapped``'s chunks run whole once the first gathers are in flight.
        An optimizer's part of the step ends with its last chunk. ``momentum_only``: only
        every chunk's first stage, now (afterwards no chunk reads a gradient)."""
        remaining = self.remaining[position]
        chosen = sorted(remaining) if indices is None else list(indices)
        if momentum_only:
            for i in chosen:
                self.advanced.add((position, i))
                next(remaining[i])
            return
        todo = deque((i, remaining.pop(i)) for i in chosen)
        gathers: deque = deque()
        scatters: deque = deque()
        chunk = None
        while True:
            while todo and len(gathers) < self.pipelines[position].max_inflight:
                i, launched = todo.popleft()
                if (position, i) not in self.advanced:
                    next(launched)  # the first stage
                next(launched)  # its gather in flight
                gathers.append(launched)
            if overlapped is not None:  # while the first gathers travel
                self.run(overlapped)
                overlapped = None
            if chunk is not None:  # its pieces arrived: Newton–Schulz, its scatter in flight
                next(chunk)
                scatters.append(chunk)
            if len(scatters) > 1 or (scatters and not gathers):
                for _ in scatters.popleft():  # the last stage runs to the generator's end
                    raise RuntimeError("a chunk generator yielded more than three times")
            if not gathers and not scatters:
                break
            chunk = gathers.popleft() if gathers else None
        if not remaining:
            self.end(position)

    def chunk(self, position: int, msg: ChunkMessages) -> Iterator[None]:
        """One chunk's update (module docstring); yields after its first stage and while
        each all-to-all travels."""
        pipeline = self.pipelines[position]
        rule, kept = pipeline.rule, self.kept[position]
        with record_function("muon/momentum"):
            states = pipeline.shard_states.fetch(msg)
            grads = [pipeline.masters[p].grad[s:e] for p, s, e in msg.momentum]
            current = dict(zip(msg.momentum, rule.before(grads, states)))
            kept.update({piece: current[piece].clone() for piece in msg.kept})
            if (position, msg.index) in self.advanced:
                self.made += current.values()
        yield
        with record_function("muon/gather"):
            pieces = [current[piece] if piece in current else kept[piece] for piece in msg.gather_send]
            del current
            pipeline.shard_states.release(msg)
            recv, work = exchange(
                pipeline.group, pieces, msg.gather_send_splits, msg.gather_recv_splits, msg.gather_remote,
                rule.comm_dtype, pipeline.device,
            )  # fmt: skip
        yield
        with record_function("muon/gather"):
            if work is not None:
                work.wait()
        with record_function("muon/newton_schulz"):
            send = self.orthogonalize(pipeline, msg, recv)
        with record_function("muon/scatter"):
            recv, work = exchange(
                pipeline.group, send, msg.scatter_send_splits, msg.scatter_recv_splits, msg.scatter_remote
            )
        yield
        with record_function("muon/scatter"):
            if work is not None:
                work.wait()
        with record_function("muon/update"):
            offload = pipeline.offloaded_masters
            staged = offload.fetch(msg) if offload is not None else {}  # CPU-offloaded: staged on the device
            masters, updates, lr_wd = [], [], []
            for p, s, e, offset in msg.scatter_apply:
                masters.append(staged[(p, s, e)] if (p, s, e) in staged else pipeline.masters[p][s:e])
                updates.append(recv[offset : offset + e - s])
                lr_wd.append(self.lr_wd[position][p])
            applied = AppliedChunk(
                masters,
                updates,
                lr_wd,
                msg.scatter_matrices,
                msg,
                pipeline.group,
                pipeline.owner_states,
                pipeline.device,
            )
            rule.apply(applied)
            if offload is not None:
                clips = self.staged_clips[position]
                for (p, s, e), master in staged.items():
                    if p in clips:
                        with record_function("muon/qk_clip"):
                            scale_master_rows_(*clips[p], piece=(master, s, e))
                offload.release(msg, staged)

    def orthogonalize(self, pipeline: MuonPipeline, msg: ChunkMessages, recv: torch.Tensor) -> torch.Tensor:
        """The owner's stages: the scatter's send buffer of a chunk, every owned job's update
        (the rule's ``orthogonalize`` and ``after``) cut into the holders' pieces.

        Multi-rank jobs go first, with their ranks, in job order on every member. The others
        are stacked by shape (``msg.stacks``), one batched Newton–Schulz per stack; a stack the
        plan lays out contiguously is read in place from ``recv`` and its update written in
        place into the send buffer (no copy beyond Newton–Schulz's own), the others are
        assembled from their pieces and cut back into them."""
        rule, states = pipeline.rule, pipeline.owner_states
        send = torch.empty(sum(msg.scatter_send_splits), dtype=rule.comm_dtype, device=recv.device)
        in_place = frozenset().union(*(stack.positions for stack in msg.stacks if stack.received))
        matrices = assemble(msg, recv, skip=in_place)
        outputs: List[List[Optional[torch.Tensor]]] = [[None] * job.matrix.column_groups for job in msg.owned]
        position = {job.index: i for i, job in enumerate(msg.owned)}
        me = pipeline.group.rank
        updates: List[torch.Tensor] = []
        for job in msg.jobs:
            if me not in job.ns_ranks:
                continue
            members = tuple(sorted(job.ns_ranks))
            i = position.get(job.index)
            for k in range(job.matrix.column_groups):
                G = matrices[i][k] if i is not None else None
                group = pipeline.subgroups[members]
                ortho = rule.orthogonalize_across(
                    G, job.matrix.ns_shape, group, members, job.ns_ranks[0], pipeline.device
                )
                if i is not None:
                    updates.append(rule.after(ortho.unsqueeze(0), [(job, k)], states))
                    outputs[i][k] = updates[-1][0]
        written = set()
        for stack in msg.stacks:
            if stack.received:
                start, end = stack.received
                G = recv[start:end].view(len(stack.members), *stack.shape)
            else:
                G = torch.stack([matrices[i][k] for i, k in stack.members])
            ortho = rule.orthogonalize(G)
            members = [(msg.owned[i], k) for i, k in stack.members]
            if stack.sent:
                start, end = stack.sent
                updates.append(
                    rule.after(ortho, members, states, send[start:end].view(len(stack.members), *stack.shape))
                )
                written |= stack.positions
            else:
                updates.append(rule.after(ortho, members, states))
                for row, (i, k) in enumerate(stack.members):
                    outputs[i][k] = updates[-1][row]
        if len(written) < len(msg.owned):
            cut_pieces(msg, outputs, send, written)
        if self.measure:
            for update in updates:
                square_sum = torch.linalg.vector_norm(update, dim=(-2, -1), dtype=torch.float32).square().sum()
                self.square_sum = square_sum if self.square_sum is None else self.square_sum + square_sum
                self.numel += update.numel()
        return send


# ---------------------------------------------------------------------------------------
# The two schedules
# ---------------------------------------------------------------------------------------


class RunNow:
    """``muon_step_overlap='none'``: the whole step inside ``optimizer.step()``."""

    def __init__(self, optimizers: Sequence[Any]) -> None:
        self.optimizers = list(optimizers)
        self.overlap_expert = bool(optimizers[0].config.muon_overlap_expert_ns)

    def run(self, work: StepWork, clips: Sequence[Clip]) -> None:
        """Every chunk (the expert ones while the first dense gathers travel), QK-Clip's
        scaling of the updated masters (the CPU-offloaded ones: in their chunks,
        :meth:`StepWork.clip_staged`), the master -> model copy, the parameter sync."""
        clips = work.clip_staged(clips)
        if self.overlap_expert and len(work.pipelines) > 1:
            work.run(0, overlapped=1)
        else:
            for position in range(len(work.pipelines)):
                work.run(position)
        if clips:
            with record_function("muon/qk_clip"):
                for shard_map, param, factors in clips:
                    scale_master_rows_(shard_map, param, factors)
        with megatron_timer(self.optimizers[0].config, "optimizer-copy-main-to-model-params"):
            with record_function("muon/copy_to_model"):
                for opt in self.optimizers:
                    opt.storage.copy_masters_to_model()
        for opt in self.optimizers:
            opt.storage.start_param_sync()


class PendingStep:
    """``muon_step_overlap='forward'``: what a taken step has not run yet, finished before
    each unit of the parameter sync (module docstring).

    Where the chunks run: by default (and always on the CPU) before the unit's sync, on the
    forward's own stream, so what hides is their communication, the wait for it and the
    host's time launching their kernels. On CUDA with ``muon_step_overlap_side_stream``, on
    a side stream: :meth:`run` queues every unit's chunks, QK-Clip and copy there as
    ``step()`` returns, unit by unit in the order the last forward synced them, each unit
    ending in an event, and :meth:`before_sync` only makes the forward's stream wait for it.
    The side stream first waits for everything ``step()`` queued, and the tensors ``step()``
    made that it reads are marked with ``record_stream``."""

    def __init__(self, optimizers: Sequence[Any], stream: Optional[Any] = None) -> None:
        self.optimizers = list(optimizers)
        self.stream = stream
        """The side stream the pending step is queued on as ``step()`` returns (CUDA), or None."""
        self.chunk_params: List[List[FrozenSet[int]]] = [
            [frozenset(id(opt.plan.params[job.param_index].param) for job in chunk.jobs) for chunk in opt.plan.chunks]
            for opt in self.optimizers
        ]
        """Per optimizer, per chunk of its plan: the ids of the parameters its matrices are of."""
        self.units: List[Tuple[int, Any, FrozenSet[int]]] = []
        """(optimizer position, unit, its parameter ids), in the same order on every rank."""
        for position, opt in enumerate(self.optimizers):
            for unit, params in opt.storage.param_sync_units():
                opt.storage.hook_param_sync(unit, self, len(self.units))
                self.units.append((position, unit, params))
        self.work: Optional[StepWork] = None
        """The pending step."""
        self.clips: Dict[int, Clip] = {}
        """Parameter id -> QK-Clip's factors still to scale its master by."""
        self.unsynced: Set[int] = set()
        """Units the parameter sync has not reached since the step."""
        self.events: Dict[int, Any] = {}
        """With a side stream: unit -> the event after its queued work."""
        self.order: List[int] = list(range(len(self.units)))
        """The order the side stream runs the units in: the last forward's (the same on every
        rank, since every rank runs the same forward); the units' own order before one."""
        self.synced: List[int] = []
        """Units in the order the parameter sync reached them since the step."""

    @property
    def active(self) -> bool:
        return bool(self.unsynced)

    @property
    def chunks_left(self) -> int:
        """Chunks of the pending step not run yet."""
        return sum(len(r) for r in self.work.remaining) if self.work is not None else 0

    def run(self, work: StepWork, clips: Sequence[Clip]) -> None:
        """In ``step()``: every chunk's first stage (afterwards no chunk reads a gradient);
        the rest is left pending (with a side stream: queued there now)."""
        if self.active:
            raise RuntimeError("PendingStep: the previous step is still pending; finish_all() it first.")
        clips = work.clip_staged(clips)
        for position in range(len(work.pipelines)):
            work.run(position, momentum_only=True)
        self.work = work
        self.clips = {id(param): (shard_map, param, factors) for shard_map, param, factors in clips}
        self.unsynced = set(range(len(self.units)))
        if self.synced:
            self.order = self.synced + [i for i in range(len(self.units)) if i not in self.synced]
        self.synced = []
        if self.stream is not None:
            made = [*work.made, *(t for kept in work.kept for t in kept.values()), *(f for _, _, f in clips)]
            self._queue_on_side_stream(made)

    @torch.no_grad()
    def _queue_on_side_stream(self, made_on_main: Sequence[torch.Tensor]) -> None:
        device = _device_module(self.stream)
        self.stream.wait_stream(device.current_stream())
        if isinstance(self.stream, torch.cuda.Stream):
            for tensor in made_on_main:
                tensor.record_stream(self.stream)
        with device.stream(self.stream):
            for index in self.order:
                self._run(index)
                self.events[index] = self.stream.record_event()

    @torch.no_grad()
    def before_sync(self, index: int) -> None:
        """Unit ``index`` is about to sync (the storage backend's hook): run what its
        parameters still wait for (with a side stream: wait for it)."""
        if index not in self.unsynced:
            return
        self.unsynced.discard(index)
        self.synced.append(index)
        if self.stream is not None:
            _device_module(self.stream).current_stream().wait_event(self.events.pop(index))
        else:
            self._run(index)

    @torch.no_grad()
    def finish_all(self) -> None:
        """Run everything still pending, in the order :class:`RunNow` runs it (every chunk
        of each optimizer in plan order), then each unit's QK-Clip and copy; with a side
        stream, wait for every unit still unwaited."""
        if self.stream is None and self.work is not None:
            for position, remaining in enumerate(self.work.remaining):
                if remaining:
                    self.work.run(position)
        for index in sorted(self.unsynced):  # not the forward's order: not learned
            self.unsynced.discard(index)
            if self.stream is not None:
                _device_module(self.stream).current_stream().wait_event(self.events.pop(index))
            else:
                self._run(index)

    def _run(self, index: int) -> None:
        """The unit's pending chunks (plan order), QK-Clip on its masters, their copy into
        the model's parameters."""
        position, _, params = self.units[index]
        ready = [i for i in self.work.remaining[position] if self.chunk_params[position][i] & params]
        if ready:
            self.work.run(position, ready)
        clipped = [self.clips.pop(p) for p in params if p in self.clips]
        if clipped:
            with record_function("muon/qk_clip"):
                for shard_map, param, factors in clipped:
                    scale_master_rows_(shard_map, param, factors)
        with record_function("muon/copy_to_model"):
            self.optimizers[position].storage.copy_masters_to_model(params)


def side_stream(config: Any, device: Optional[torch.device]) -> Optional[torch.cuda.Stream]:
    """The stream a pending step is queued on: a new CUDA stream on ``device`` with
    ``muon_step_overlap_side_stream``, else None (the hooks run it)."""
    if config.muon_step_overlap_side_stream and device is not None and device.type == "cuda":
        return torch.cuda.Stream(device=device)
    return None


def _device_module(stream: Any) -> Any:
    """``torch.cuda`` for a CUDA stream, ``torch.cpu`` (whose streams order nothing) else."""
    return torch.cuda if isinstance(stream, torch.cuda.Stream) else torch.cpu


def step_overlap_mode(config: Any, model_chunks: Sequence[torch.nn.Module], storage: Any) -> str:
    """``config.muon_step_overlap`` resolved for these chunks ('none' or 'forward'); 'forward'
    asked where it cannot run raises, naming the reason and the fix."""
    return step_overlap_for(config, [chunk.ddp_config for chunk in model_chunks], storage)


def step_overlap_for(config: Any, ddp_settings: Sequence[Any], storage: Any) -> str:
    """:func:`step_overlap_mode` from DDP settings alone (each chunk's ``ddp_config``, or
    Megatron-LM's arguments, which carry the same names): what a run will choose, known
    before its model is built."""
    refusal: Optional[str] = storage.step_overlap_refusal(ddp_settings)
    if config.muon_step_overlap == "auto":
        return "none" if refusal is not None or config.muon_cpu_offload else "forward"
    if config.muon_step_overlap == "forward" and refusal is not None:
        raise ValueError(f"get_muon_optimizer: {step_overlap_cannot_run(refusal)}.")
    return config.muon_step_overlap


# ---------------------------------------------------------------------------------------
# Moving pieces by the plan's messages
# ---------------------------------------------------------------------------------------


def exchange(
    group: OrthoGroup,
    send: Union[torch.Tensor, Sequence[torch.Tensor]],
    send_splits: List[int],
    recv_splits: List[int],
    remote: bool,
    dtype: Optional[torch.dtype] = None,
    device: Optional[torch.device] = None,
) -> Tuple[torch.Tensor, Optional[dist.Work]]:
    """Start one ``all_to_all_single`` over the group; returns the receive buffer and the
    handle to wait on (None where nothing crosses ranks: the pieces stay, in the order they
    would arrive in). ``send``: the packed buffer, or the pieces to pack, flat and
    concatenated, in ``dtype`` (converted as they are copied: one pass, not a concatenation
    and then a cast; ``device``: where an empty one goes)."""
    if not torch.is_tensor(send):
        pieces = send
        send = torch.empty(sum(p.numel() for p in pieces), dtype=dtype, device=pieces[0].device if pieces else device)
        if pieces:
            torch.cat([p.reshape(-1) for p in pieces], out=send)
    if group.size == 1 or not remote:
        return send, None
    recv = torch.empty(sum(recv_splits), dtype=send.dtype, device=send.device)
    return recv, dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group.group, async_op=True)


def assemble(msg: ChunkMessages, recv: torch.Tensor, skip: frozenset = frozenset()) -> List[List[torch.Tensor]]:
    """Per owned job, its matrices (fp32, one per column group) from the received pieces:
    each TP rank's piece from its DP segments, then the TP pieces joined along the
    partition dim. The pieces are cast to fp32 as they are placed. Jobs at the owned
    positions in ``skip`` (read in place from ``recv``) get an empty list."""
    pieces: List[Dict[int, torch.Tensor]] = []
    for i, job in enumerate(msg.owned):
        tps = sorted({s.tp for s in job.sources}) if i not in skip else []
        pieces.append(
            {
                t: torch.empty(math.prod(job.matrix.piece_shape_on(t)), dtype=torch.float32, device=recv.device)
                for t in tps
            }
        )
    for job_pos, tp, piece_offset, recv_offset, numel in msg.gather_place:
        if job_pos not in skip:
            pieces[job_pos][tp][piece_offset : piece_offset + numel] = recv[recv_offset : recv_offset + numel]
    out = []
    for job, held in zip(msg.owned, pieces):
        m = job.matrix
        groups = [held[t].view(m.piece_shape_on(t)).chunk(m.column_groups, dim=1) for t in sorted(held)]
        out.append(
            []
            if not groups
            else list(groups[0])
            if len(groups) == 1
            else [torch.cat([g[k] for g in groups], dim=m.tp_dim) for k in range(m.column_groups)]
        )
    return out


def cut_pieces(
    msg: ChunkMessages, updates: List[List[Optional[torch.Tensor]]], send: torch.Tensor, written: Collection[int] = ()
) -> None:
    """The owned jobs' updates cut into the pieces ``msg.scatter_send`` lists and packed
    (cast to the wire dtype) into their places in ``send``, each run of consecutive pieces
    as one copy; the jobs at the owned positions in ``written`` are there already."""
    flat: List[Optional[Dict[int, torch.Tensor]]] = []  # per owned job: each destination TP rank's flat piece
    for i, (job, outs) in enumerate(zip(msg.owned, updates)):
        m = job.matrix
        dest_tps = sorted({s.tp for s in job.dests})
        if i in written:
            flat.append(None)
        elif m.replicated or len(m.pieces) == 1:
            whole = torch.cat(outs, dim=1).reshape(-1) if len(outs) > 1 else outs[0].reshape(-1)
            flat.append({t: whole for t in dest_tps})
        else:
            order = [t for t, _ in m.pieces]
            per_group = [out.split(m.piece_extents(), dim=m.tp_dim) for out in outs]
            flat.append(
                {
                    t: torch.cat([g[order.index(t)] for g in per_group], dim=1).reshape(-1)
                    if len(outs) > 1
                    else per_group[0][order.index(t)].contiguous().view(-1)
                    for t in dest_tps
                }
            )
    run: List[torch.Tensor] = []
    start = offset = 0
    for j, tp, o, n in msg.scatter_send:
        if j in written:
            if run:
                torch.cat(run, out=send[start:offset])
            run, start = [], offset + n
        else:
            run.append(flat[j][tp][o : o + n])
        offset += n
    if run:
        torch.cat(run, out=send[start:offset])


__all__ = [
    "MuonPipeline",
    "PendingStep",
    "RunNow",
    "StepWork",
    "step_overlap_mode",
]
