"""The Muon step finished while the next forward runs (``muon_step_overlap='forward'``).

A parameter reaches the next forward only through its unit of the parameter sync (with
Megatron-DDP's ``overlap_param_gather``: its bucket group's all-gather). Every path to that
sync passes one place, the unit's ``start_param_sync``: DDP's forward pre-hook and its
prefetch of the next group, Megatron's pipeline schedules (``param_sync_func``), and the
forced syncs before evaluation, checkpointing and shutdown. So:

- ``optimizer.step()`` does what needs every rank at once (non-finite check, grad norm,
  clipping, AdamW on the scalar parameters, each Muon range's momentum, QK-Clip's max
  logits and row factors) and captures this step's learning rates; each Muon chunk's
  exchange (gather, Newton–Schulz, scatter, update) is left pending;
- before a unit syncs, :meth:`PendingStep.finish` runs the pending chunks holding any
  matrix of its parameters, in plan order, then QK-Clip on those parameters' masters, then
  their master -> model copy. Every rank of an orthogonalization group runs the same
  forward, so all of them finish the same chunks in the same order.

A chunk does here exactly what it does inside ``step()`` with 'none', on the same inputs:
the parameters come out the same bits. Where the chunks run:

- by default, and always on the CPU: inside ``finish``, on the forward's own stream, so
  what hides is their communication, the wait for it, and the host's time launching
  their kernels;
- on CUDA with ``muon_step_overlap_side_stream``: on a side stream. ``step()`` queues
  every unit's chunks, QK-Clip and copy there as it returns, unit by unit in the order the
  last forward synced them, each unit ending in an event; ``finish`` then only makes the
  forward's stream wait for that event. Newton–Schulz can then run beside the forward's
  kernels. Every rank queues the same chunks in the same order, so the
  all-to-alls pair up as they do in ``step()``.
"""

from __future__ import annotations

from typing import Any, Dict, FrozenSet, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch.profiler import record_function

from .pipeline import drive
from .qk_clip import scale_master_rows_


class PendingStep:
    """What a taken step of chained Muon optimizers (dense first) has not run yet, and the
    hooks before each parameter-sync unit that run it (or, with a side stream, wait for it)."""

    def __init__(self, optimizers: Sequence[Any], stream: Optional[Any] = None) -> None:
        self.optimizers = list(optimizers)
        self.stream = stream
        """The side stream the pending step is queued on as ``step()`` returns (CUDA), or None:
        run from the hooks."""
        self.chunk_params: List[List[FrozenSet[int]]] = [
            [frozenset(id(opt.plan.params[job.param_index].param) for job in chunk.jobs) for chunk in opt.plan.chunks]
            for opt in self.optimizers
        ]
        """Per optimizer, per chunk of its plan: the ids of the parameters its matrices are of."""
        self.units: List[Tuple[int, Any, FrozenSet[int]]] = []
        """(optimizer position, unit, its parameter ids), in the same order on every rank."""
        for position, opt in enumerate(self.optimizers):
            for unit, params in opt.storage.param_sync_units():
                index = len(self.units)
                self.units.append((position, unit, params))
                opt.storage.before_param_sync(unit, lambda index=index: self.finish(index))
        self.chunks: List[Dict[int, Iterator[None]]] = [{} for _ in self.optimizers]
        """Per optimizer: chunk index -> its pending exchange (a ``pipeline`` generator)."""
        self.clips: Dict[int, Tuple[torch.nn.Parameter, torch.Tensor]] = {}
        """Parameter id -> (parameter, row factors) of QK-Clip still to scale its master by."""
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

    def begin(
        self,
        chunks: Sequence[Sequence[Iterator[None]]],
        clips: Sequence[Tuple[torch.nn.Parameter, torch.Tensor]],
        inputs: Sequence[torch.Tensor] = (),
    ) -> None:
        """Leave a step pending: every optimizer's chunk exchanges (in plan order), QK-Clip's
        row factors, and ``inputs``, the tensors ``step()`` made that the exchanges read.
        With a side stream, queue all of it there now."""
        if self.active:
            raise RuntimeError("PendingStep.begin: the previous step is still pending; finish_all() it first.")
        self.chunks = [dict(enumerate(c)) for c in chunks]
        self.clips = {id(param): (param, factors) for param, factors in clips}
        self.unsynced = set(range(len(self.units)))
        if self.synced:
            self.order = self.synced + [i for i in range(len(self.units)) if i not in self.synced]
        self.synced = []
        if self.stream is not None:
            self._queue_on_side_stream([*inputs, *(factors for _, factors in clips)])

    @torch.no_grad()
    def _queue_on_side_stream(self, made_on_main: Sequence[torch.Tensor]) -> None:
        """Every unit's work on the side stream, after everything ``step()`` queued so far,
        one event per unit. The tensors the main stream made are marked as used by the side
        stream, so their memory is not handed out again before the side stream is done."""
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
    def finish(self, index: int) -> None:
        """Unit ``index`` is about to sync: run what its parameters still wait for (with a
        side stream: wait for it)."""
        if index not in self.unsynced:
            return
        self.synced.append(index)
        self._wait_or_run(index)

    @torch.no_grad()
    def finish_all(self) -> None:
        """Run everything still pending, in the order ``step()`` runs it with 'none' (every
        chunk of each optimizer in plan order), then each unit's QK-Clip and copy; with a
        side stream, wait for every unit still unwaited."""
        if self.stream is None:
            for opt, pending in zip(self.optimizers, self.chunks):
                if pending:
                    chunks = list(pending.values())
                    pending.clear()
                    drive(chunks, opt.config.muon_max_inflight_chunks)
                    opt.end_muon_step()
        for index in sorted(self.unsynced):
            self._wait_or_run(index)

    def _wait_or_run(self, index: int) -> None:
        if self.stream is not None:
            _device_module(self.stream).current_stream().wait_event(self.events.pop(index))
        else:
            self._run(index)
        self.unsynced.discard(index)

    def _run(self, index: int) -> None:
        """The unit's pending chunks (plan order), QK-Clip on its masters, their copy into
        the model's parameters."""
        position, _, params = self.units[index]
        opt = self.optimizers[position]
        pending = self.chunks[position]
        ready = [i for i in pending if self.chunk_params[position][i] & params]
        if ready:
            drive([pending.pop(i) for i in ready], opt.config.muon_max_inflight_chunks)
            if not pending:
                opt.end_muon_step()
        clipped = [self.clips.pop(p) for p in params if p in self.clips]
        if clipped:
            with record_function("muon/qk_clip"):
                for param, factors in clipped:
                    scale_master_rows_(opt.shard_map, param, factors)
        with record_function("muon/copy_to_model"):
            opt.storage.copy_masters_to_model(params)


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
        raise ValueError(
            f"get_muon_optimizer: muon_step_overlap='forward' cannot run here: {refusal}. Set "
            "muon_step_overlap='none' (--muon-step-overlap none), or 'auto' to overlap wherever it can."
        )
    return config.muon_step_overlap
