"""The Muon step of one optimizer: one generator per chunk of matrices, and the driver.

:func:`chunk_update` is the whole update of one chunk of the plan, in the order the
maths happens, on every rank of the orthogonalization group:

1. **momentum** of the master ranges this chunk sends, on the device (fp32):
   ``buf = mu * buf + g``, and the Nesterov input ``g + mu * buf``;
2. **gather**: pack this rank's pieces, ordered by owner, and start one
   ``all_to_all_single`` that delivers each piece to the rank that orthogonalizes its
   matrix; *yield* while it travels;
3. **Newton–Schulz** on the owner: the owned matrices of one shape as one batched call
   (``planner.Stack``; a matrix planned over several ranks with them:
   ``multirank_newton_schulz``), variance reduction if on, times the update scale. Where a
   stack arrives whole and in order it is read in place from the receive buffer and its
   update written in place into the send buffer; otherwise each matrix is assembled from
   its TP x DP pieces and its update cut back into them;
4. **scatter**: start the reverse ``all_to_all_single`` of the update pieces; *yield*
   while it travels;
5. **decay and update** of each arriving piece's fp32 master range:
   ``w -= lr * wd * w`` (cautious: only where ``update * w >= 0``), ``w -= lr * update``.

Stage 1 is :func:`advance_momentum`, stages 2-5 :func:`chunk_exchange`: a step left
pending for the next forward (``step_overlap.py``) runs the first for every chunk inside
``optimizer.step()`` and the second later, with the same arithmetic.

:func:`drive` interleaves the chunks: it launches the gathers of up to ``max_inflight``
chunks ahead of the one it completes, so one chunk's communication travels while another
computes, and runs other chunks (the expert optimizer's) while the first gathers are in
flight. Everything a chunk sends and receives was computed once from the plan
(``planner.rank_messages``); nothing is passed in as a callable.

Each stage is a ``torch.profiler`` range, ``muon/momentum``, ``muon/gather`` (the launch and
the wait), ``muon/newton_schulz``, ``muon/scatter`` (launch and wait), ``muon/update``: a
trace (Megatron-LM's ``--profile --use-pytorch-profiler``) shows where the step's time goes.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Collection, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.profiler import record_function

from .multirank_newton_schulz import multirank_newton_schulz
from .newton_schulz import newton_schulz
from .planner import ChunkMessages, Job, Piece
from .process_groups import OrthoGroup
from .state import MOMENTUM, SECOND_MOMENT, OffloadedMasters, OwnerStates, ShardStates


@dataclass
class MuonStep:
    """What one optimizer's Muon step reads; built once with the optimizer."""

    group: OrthoGroup
    messages: List[ChunkMessages]
    masters: List[Optional[torch.Tensor]]
    """This rank's fp32 master of every Muon param (None where it holds none)."""
    shard_states: ShardStates
    owner_states: OwnerStates
    scales: List[float]
    """The update scale of every job of the plan."""
    momentum: float
    nesterov: bool
    ns_steps: int
    coefficients: str
    ns_dtype: torch.dtype
    ns_method: str
    compiled: bool
    schedule: Tuple[Tuple[float, float, float], ...]
    """The coefficient triples of the ``ns_steps`` steps (multi-rank jobs)."""
    comm_dtype: torch.dtype
    variance_reduction: Optional[float]
    cautious: bool
    device: Optional[torch.device]
    subgroups: Dict[Tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)
    """The process groups of the multi-rank jobs this rank takes part in."""
    offloaded_masters: Optional[OffloadedMasters] = None
    """The fp32 masters in a CPU pool (``optimizer_cpu_offload``), or None."""
    measure_updates: bool = False
    """Whether this step sums the squares of its updates (``update_square_sum``): only when
    a logger asked for the update RMS."""
    update_square_sum: Optional[torch.Tensor] = None
    update_numel: int = 0
    """Sum of squares and count of the elements of the updates this rank computed in the
    last step (the owners' matrices, scaled): the update RMS a run logs."""
    previous_updates: Optional[Tuple[Optional[torch.Tensor], int]] = None
    """``(update_square_sum, update_numel)`` of the step before the last, if it measured them."""
    scale_tensors: Dict[Tuple[Tuple[float, ...], torch.device], torch.Tensor] = field(default_factory=dict)
    """The update scales of each stack as an fp32 ``[B, 1, 1]`` tensor on its device, made
    once: a host-to-device copy every step would wait for the device."""

    def measured_updates(self) -> Optional[Tuple[Optional[torch.Tensor], int]]:
        """``(update_square_sum, update_numel)`` of the last step, if it measured them."""
        return (self.update_square_sum, self.update_numel) if self.measure_updates else None

    def scale_tensor(self, scales: Tuple[float, ...], device: torch.device) -> torch.Tensor:
        key = (scales, device)
        if key not in self.scale_tensors:
            self.scale_tensors[key] = torch.tensor(scales, dtype=torch.float32, device=device).view(-1, 1, 1)
        return self.scale_tensors[key]


# ---------------------------------------------------------------------------------------
# One chunk
# ---------------------------------------------------------------------------------------


def chunk_update(
    step: MuonStep, msg: ChunkMessages, lr_wd: Sequence[Tuple[float, float]], kept: Dict[Piece, torch.Tensor]
) -> Iterator[None]:
    """One chunk's Muon update (module docstring). ``lr_wd[p]``: this step's learning rate
    and weight decay of Muon param ``p``; ``kept``: orthogonalization inputs of ranges a
    later chunk sends again (shared by the chunks of one step)."""
    inputs = advance_momentum(step, msg, kept)
    yield from chunk_exchange(step, msg, inputs, lr_wd, kept)


def advance_momentum(step: MuonStep, msg: ChunkMessages, kept: Dict[Piece, torch.Tensor]) -> Dict[Piece, torch.Tensor]:
    """Stage 1 of a chunk: the momentum of the master ranges it advances and their
    orthogonalization inputs (Nesterov: ``g + mu * buf``), keyed by range. The inputs of
    ranges a later chunk sends again go into ``kept``."""
    with record_function("muon/momentum"):
        states = step.shard_states.fetch(msg)
        bufs = states[MOMENTUM]
        grads = [step.masters[p].grad[s:e] for p, s, e in msg.momentum]
        if bufs:
            torch._foreach_mul_(bufs, step.momentum)
            torch._foreach_add_(bufs, grads)
        inputs = torch._foreach_add(grads, bufs, alpha=step.momentum) if step.nesterov and bufs else bufs
        current = dict(zip(msg.momentum, inputs))
        kept.update({piece: current[piece].clone() for piece in msg.kept})
    return current


def chunk_exchange(
    step: MuonStep,
    msg: ChunkMessages,
    current: Dict[Piece, torch.Tensor],
    lr_wd: Sequence[Tuple[float, float]],
    kept: Dict[Piece, torch.Tensor],
) -> Iterator[None]:
    """Stages 2-5 of a chunk, from its orthogonalization inputs (:func:`advance_momentum`)
    to the updated masters; yields while each all-to-all travels."""
    # 2. Gather: every piece to the owner of its matrix.
    with record_function("muon/gather"):
        send = pack(
            [current[piece] if piece in current else kept[piece] for piece in msg.gather_send],
            step.comm_dtype,
            step.device,
        )
        step.shard_states.release(msg)
        recv, work = exchange(step.group, send, msg.gather_send_splits, msg.gather_recv_splits, msg.gather_remote)
    yield

    # 3. Newton–Schulz of the owned matrices, times their update scales, written into the
    #    scatter's send buffer.
    with record_function("muon/gather"):
        if work is not None:
            work.wait()
    with record_function("muon/newton_schulz"):
        send = orthogonalize(step, msg, recv)

    # 4. Scatter: every piece of every update to the rank holding it.
    with record_function("muon/scatter"):
        recv, work = exchange(step.group, send, msg.scatter_send_splits, msg.scatter_recv_splits, msg.scatter_remote)
    yield

    # 5. Decoupled weight decay and the update, on the fp32 master ranges.
    with record_function("muon/scatter"):
        if work is not None:
            work.wait()
    with record_function("muon/update"):
        apply_updates(step, msg, recv, lr_wd)


def apply_updates(step: MuonStep, msg: ChunkMessages, recv: torch.Tensor, lr_wd: Sequence[Tuple[float, float]]) -> None:
    """:func:`decay_and_update_` of every received piece into its fp32 master range; the
    pieces of one (learning rate, weight decay) as one ``_foreach`` op each (cautious weight
    decay: piece by piece). CPU-offloaded masters get the chunk's updates in one copy to
    pinned host memory. The update stays in the wire dtype: the ops promote it to fp32
    (exactly) as they read it, which saves an fp32 copy."""
    groups: Dict[Tuple[float, float], Tuple[List[torch.Tensor], List[torch.Tensor]]] = defaultdict(lambda: ([], []))
    host = None
    for p, s, e, offset in msg.scatter_apply:
        master = step.masters[p][s:e]
        if master.device != recv.device and host is None:  # CPU-offloaded masters
            host = step.offloaded_masters.updates_to_host(recv) if step.offloaded_masters else recv.cpu()
        update = (recv if master.device == recv.device else host)[offset : offset + e - s]
        if step.cautious:
            decay_and_update_(master, update, *lr_wd[p], step.cautious)
        else:
            groups[lr_wd[p]][0].append(master)
            groups[lr_wd[p]][1].append(update)
    for (lr, wd), (masters, updates) in groups.items():
        if wd != 0.0:
            torch._foreach_mul_(masters, 1.0 - lr * wd)
        torch._foreach_add_(masters, updates, alpha=-lr)


def decay_and_update_(master: torch.Tensor, update: torch.Tensor, lr: float, wd: float, cautious: bool) -> None:
    """``w -= lr * wd * w`` (cautious: only where ``update * w >= 0``, ``w`` before the
    step), then ``w -= lr * update``, in place on a range of an fp32 master (``update`` on
    its device)."""
    if wd != 0.0:
        if cautious:
            master.sub_(master * ((update * master) >= 0), alpha=lr * wd)
        else:
            master.mul_(1.0 - lr * wd)
    master.add_(update, alpha=-lr)


def pack(pieces: Sequence[torch.Tensor], dtype: torch.dtype, device: Optional[torch.device]) -> torch.Tensor:
    """The pieces, flat and concatenated, in the wire dtype (converted as they are copied:
    one pass, not a concatenation and then a cast)."""
    if not pieces:
        return torch.empty(0, dtype=dtype, device=device)
    out = torch.empty(sum(p.numel() for p in pieces), dtype=dtype, device=pieces[0].device)
    return torch.cat([p.reshape(-1) for p in pieces], out=out)


def exchange(
    group: OrthoGroup, send: torch.Tensor, send_splits: List[int], recv_splits: List[int], remote: bool
) -> Tuple[torch.Tensor, Optional[dist.Work]]:
    """Start one ``all_to_all_single`` over the group; returns the receive buffer and the
    handle to wait on (None where nothing crosses ranks: the pieces stay, in the order they
    would arrive in)."""
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


def orthogonalize(step: MuonStep, msg: ChunkMessages, recv: torch.Tensor) -> torch.Tensor:
    """The scatter's send buffer of a chunk: every owned job's update (its matrices
    orthogonalized, then :func:`finish_update`), cut into the holders' pieces.

    Multi-rank jobs go first, with their ranks, in job order on every member. The others
    are stacked by shape (``msg.stacks``), one batched Newton–Schulz per stack; a stack the
    plan lays out contiguously is read in place from ``recv`` and its scaled update written
    in place into the send buffer (no copy beyond Newton–Schulz's own), the others are
    assembled from their pieces and cut back into them."""
    send = torch.empty(sum(msg.scatter_send_splits), dtype=step.comm_dtype, device=recv.device)
    in_place = frozenset().union(*(stack.positions for stack in msg.stacks if stack.received))
    matrices = assemble(msg, recv, skip=in_place)
    outputs: List[List[Optional[torch.Tensor]]] = [[None] * job.matrix.column_groups for job in msg.owned]
    position = {job.index: i for i, job in enumerate(msg.owned)}
    me = step.group.rank
    for job in msg.jobs:
        if me not in job.ns_ranks:
            continue
        members = tuple(sorted(job.ns_ranks))
        i = position.get(job.index)
        for k in range(job.matrix.column_groups):
            G = matrices[i][k] if i is not None else None
            ortho = multirank_newton_schulz(
                G,
                job.matrix.ns_shape,
                step.subgroups[members],
                members,
                job.ns_ranks[0],
                step.schedule,
                step.ns_dtype,
                step.device,
            )
            if i is not None:
                outputs[i][k] = finish_update(step, [(job, k)], ortho.unsqueeze(0))[0]
    written = set()
    for stack in msg.stacks:
        if stack.received:
            start, end = stack.received
            G = recv[start:end].view(len(stack.members), *stack.shape)
        else:
            G = torch.stack([matrices[i][k] for i, k in stack.members])
        ortho = newton_schulz(
            G,
            step.ns_steps,
            step.coefficients,
            step.ns_dtype,
            compiled=step.compiled,
            method=step.ns_method,
            keep_compute_dtype=True,
        )
        members = [(msg.owned[i], k) for i, k in stack.members]
        if stack.sent:
            start, end = stack.sent
            finish_update(step, members, ortho, out=send[start:end].view(len(stack.members), *stack.shape))
            written |= stack.positions
        else:
            update = finish_update(step, members, ortho)
            for row, (i, k) in enumerate(stack.members):
                outputs[i][k] = update[row]
    if len(written) < len(msg.owned):
        cut_pieces(msg, outputs, send, written)
    return send


def finish_update(
    step: MuonStep, members: Sequence[Tuple[Job, int]], ortho: torch.Tensor, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """A stack of orthogonalized matrices (``members[i]`` = (job, column group) of
    ``ortho[i]``, storage orientation, in Newton–Schulz's compute dtype): variance
    reduction if on, times each job's scale, computed in fp32 and stored into ``out`` (the
    wire dtype: one rounding, as if the fp32 result were packed) or a new fp32 stack."""
    if step.variance_reduction is not None:
        ortho = variance_reduce(step.owner_states, members, ortho, step.variance_reduction)
    scales = step.scale_tensor(tuple(step.scales[job.index] for job, _ in members), ortho.device)
    if out is None:
        out = torch.empty(ortho.shape, dtype=torch.float32, device=ortho.device)
    torch.mul(ortho, scales, out=out)
    if step.measure_updates:
        norms = torch.linalg.vector_norm(ortho, dim=(-2, -1), dtype=torch.float32)
        square_sum = (norms.square() * scales.view(-1).square()).sum()
        step.update_square_sum = square_sum if step.update_square_sum is None else step.update_square_sum + square_sum
        step.update_numel += ortho.numel()
    return out


def variance_reduce(
    states: OwnerStates, members: Sequence[Tuple[Job, int]], ortho: torch.Tensor, beta2: float
) -> torch.Tensor:
    """:func:`variance_reduction_` of every matrix of the stack in its logical orientation,
    each with its own second moment (``states``, updated); fp32."""
    out = torch.empty_like(ortho, dtype=torch.float32)
    for transposed in (False, True):
        rows = [i for i, (job, _) in enumerate(members) if job.matrix.transposed == transposed]
        if not rows:
            continue
        moments = torch.stack([states.get(SECOND_MOMENT, *members[i]) for i in rows]).to(ortho.device)
        stack = ortho[rows].mT if transposed else ortho[rows]
        reduced = variance_reduction_(stack, moments, beta2)
        out[rows] = reduced.mT if transposed else reduced
        for i, moment in zip(rows, moments):
            states.get(SECOND_MOMENT, *members[i]).copy_(moment)
    return out


def variance_reduction_(ortho: torch.Tensor, second_moment: torch.Tensor, beta2: float) -> torch.Tensor:
    """nanochat's variance reduction of a ``[B, out, in]`` stack of orthogonalized updates
    (logical orientation). ``second_moment`` (``[B, out, 1]`` or ``[B, 1, in]``, fp32) is
    updated in place; returns the rescaled updates (fp32).

    ``v`` = mean of squares over the reduced dim (the input dim of a tall or square matrix,
    the output dim of a wide one); ``s <- beta2 * s + (1 - beta2) * v``; the update
    ``O * rsqrt(max(s, 1e-10))`` is rescaled so that its Frobenius norm is ``O``'s."""
    o = ortho.float()
    dim = -1 if o.shape[-2] >= o.shape[-1] else -2
    n = o.shape[dim]
    v_mean = o.square().mean(dim=dim, keepdim=True)
    norm = (v_mean.sum(dim=(-2, -1), keepdim=True) * n).sqrt()
    second_moment.lerp_(v_mean, 1.0 - beta2)
    scale = second_moment.clamp_min(1e-10).rsqrt()
    new_norm = ((v_mean * n) * scale.square()).sum(dim=(-2, -1), keepdim=True).sqrt()
    return o * (scale * (norm / new_norm.clamp_min(1e-10)))


def cut_pieces(
    msg: ChunkMessages, updates: List[List[Optional[torch.Tensor]]], send: torch.Tensor, written: Collection[int] = ()
) -> None:
    """The owned jobs' updates cut into the pieces ``msg.scatter_send`` lists and packed
    (cast to the wire dtype) into their places in ``send``, each run of consecutive pieces
    as one copy; the jobs at the owned positions in ``written`` are there already."""
    flat = [_tp_pieces(job, out) if i not in written else None for i, (job, out) in enumerate(zip(msg.owned, updates))]
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


def _tp_pieces(job: Job, outs: List[torch.Tensor]) -> Dict[int, torch.Tensor]:
    """A job's results cut back into each destination TP rank's flat piece."""
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


# ---------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------


def drive(chunks: Sequence[Iterator[None]], max_inflight: int, overlapped: Sequence[Iterator[None]] = ()) -> None:
    """Run chunk generators to completion, overlapped.

    Each generator is advanced three times: to its gather in flight, to its scatter in
    flight, to the end. Up to ``max_inflight`` gathers are launched ahead of the chunk
    being completed, and each chunk's scatter travels while the next chunk computes. The
    ``overlapped`` chunks (another optimizer's) run whole, one ``drive`` of their own, once
    the first gathers are in flight and before any is waited for."""
    gathers: deque = deque()
    scatters: deque = deque()
    pending = iter(chunks)

    def launch_next() -> None:
        chunk = next(pending, None)
        if chunk is not None:
            next(chunk)
            gathers.append(chunk)

    for _ in range(max_inflight):
        launch_next()
    if overlapped:
        drive(overlapped, max_inflight)
    while gathers:
        chunk = gathers.popleft()
        launch_next()
        next(chunk)
        scatters.append(chunk)
        if len(scatters) > 1:
            _finish(scatters.popleft())
    while scatters:
        _finish(scatters.popleft())


def _finish(chunk: Iterator[None]) -> None:
    for _ in chunk:  # the last stage runs to the generator's end
        raise RuntimeError("a chunk generator yielded more than twice")


# ---------------------------------------------------------------------------------------
# Whole matrices outside the step (checkpoints of owner-kept states)
# ---------------------------------------------------------------------------------------


def gather_matrices(
    step: MuonStep, inputs: Sequence[Optional[torch.Tensor]]
) -> Iterator[Tuple[Job, List[torch.Tensor]]]:
    """Collective: every holder's pieces of ``inputs`` (shaped like the masters) travel to
    the owners as in the step's gather, in fp32, chunk by chunk; yields every owned
    ``(job, matrices)`` (storage orientation)."""
    for msg in step.messages:
        send = pack([inputs[p][s:e] for p, s, e in msg.gather_send], torch.float32, step.device)
        recv, work = exchange(step.group, send, msg.gather_send_splits, msg.gather_recv_splits, msg.gather_remote)
        if work is not None:
            work.wait()
        yield from zip(msg.owned, assemble(msg, recv))


def scatter_matrices(
    step: MuonStep, msg: ChunkMessages, outputs: List[List[torch.Tensor]]
) -> List[Tuple[Piece, torch.Tensor]]:
    """Collective, the reverse of :func:`gather_matrices` for one chunk: the owned jobs'
    ``outputs`` (fp32, storage orientation) cut to the holders; returns this rank's pieces."""
    send = torch.empty(sum(msg.scatter_send_splits), dtype=torch.float32, device=step.device)
    cut_pieces(msg, outputs, send)
    recv, work = exchange(step.group, send, msg.scatter_send_splits, msg.scatter_recv_splits, msg.scatter_remote)
    if work is not None:
        work.wait()
    return [((p, s, e), recv[offset : offset + e - s]) for p, s, e, offset in msg.scatter_apply]


__all__ = [
    "MuonStep",
    "advance_momentum",
    "chunk_exchange",
    "chunk_update",
    "decay_and_update_",
    "drive",
    "gather_matrices",
    "scatter_matrices",
    "variance_reduction_",
]
