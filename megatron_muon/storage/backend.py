"""What a storage backend is: where one Muon optimizer's fp32 masters, their gradients and
the model's parameters live under one data-parallel engine.

The Muon step itself (the plan, ``pipeline.py``, the state registry) reads only a
:class:`~megatron_muon.shard_map.ShardMap`: which range of every parameter each DP rank
holds, and this rank's fp32 master of it. Everything around the step that depends on how
the engine stores the model is the backend's, chosen once when ``get_muon_optimizer``
builds the optimizer:

* before the optimizer: refusing the settings the engine cannot run (:meth:`requirements`,
  its part of the support matrix, ``support.py``: read from the config and the chunks by
  ``get_muon_optimizer`` and from Megatron-LM's arguments by its argument check) and chunks
  it did not wrap as it needs (:meth:`check`), preparing the chunks (:meth:`prepare`),
  whether the buffers are owner-aligned (:meth:`owner_aligned`);
* building what the engine keeps for the optimizer and the shard map (the constructor: under
  DDP a Megatron ``DistributedOptimizer`` that shards the parameter groups into fp32 masters);
* gradients -> fp32 masters (:meth:`copy_grads_to_masters`, :meth:`zero_grad`);
* masters -> model parameters (:meth:`copy_masters_to_model`; back, :meth:`copy_model_to_masters`)
  and the parameter sync
  (:meth:`start_param_sync`); with ``muon_step_overlap='forward'``, the units the sync
  brings up to date one at a time, and before each the pending step's work on its
  parameters (:meth:`param_sync_units`, :meth:`hook_param_sync`);
* the checkpoint format it writes (:attr:`checkpoint_format`, which :meth:`sharded_state_dict`
  and :meth:`load_state_dict` ask) and Megatron's parameter names in it (:meth:`param_name`).

A new engine is one new module with a subclass, added to ``storage.ENGINES``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Collection, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..checkpoint.format import CheckpointFormat
from ..shard_map import ShardMap
from ..support import Settings, step_overlap_cannot_run


class StorageBackend:
    """One data-parallel engine's storage, for one ``MuonDistributedOptimizer`` (``opt``, which
    holds this backend)."""

    checkpoint_format: ClassVar[CheckpointFormat]
    """The checkpoint format this engine's runs write (``checkpoint.formats``), which saves
    and loads the optimizer's state."""

    # ------------------------------------------------------------------ before the optimizer
    @classmethod
    def wraps(cls, chunk: torch.nn.Module) -> bool:
        """Whether this engine wrapped ``chunk``."""
        raise NotImplementedError

    @classmethod
    def requirements(cls, settings: Settings) -> List[str]:
        """What this engine needs of a run's settings (``support.Settings``), one refusal each,
        naming the setting, its flag and the fix; empty when it runs. Every engine: the
        distributed optimizer's sharding, one instance of it, and the step overlap where asked."""
        refusals = []
        if not all(d.use_distributed_optimizer for d in settings.ddp):
            refusals.append(
                "megatron_muon needs use_distributed_optimizer=True (DistributedDataParallelConfig, "
                "--use-distributed-optimizer): the Muon optimizer shards its state like Megatron's "
                "DistributedOptimizer; add it, or with Megatron-LM use --muon-impl megatron for Megatron-core's Muon"
            )
        if any(d.num_distributed_optimizer_instances != 1 for d in settings.ddp):
            refusals.append(
                "megatron_muon needs num_distributed_optimizer_instances=1 (--num-distributed-optimizer-instances 1): "
                "more than one distributed-optimizer instance (HSDP on Megatron-FSDP) is not supported"
            )
        if getattr(settings.optimizer, "muon_step_overlap", "none") == "forward":
            why = cls.step_overlap_refusal(settings.ddp)
            if why is not None:
                refusals.append(step_overlap_cannot_run(why))
        return refusals

    @classmethod
    def check(cls, model_chunks: Sequence[torch.nn.Module], config) -> None:
        """Refuse, naming the fix, chunks this engine did not wrap as the optimizer needs
        (what the settings alone say is :meth:`requirements`')."""
        raise NotImplementedError

    @classmethod
    def prepare(cls, model_chunks: Sequence[torch.nn.Module]) -> Dict[bool, dist.ProcessGroup]:
        """Make the chunks ready for the optimizer; ``{is_expert: data-parallel group}`` where
        the engine shards over a group of its own."""
        return {}

    @classmethod
    def owner_aligned(cls, config, model_chunks: Sequence[torch.nn.Module]) -> bool:
        """Whether each matrix lies whole in one DP rank's shard (``buffer_layout.py``)."""
        return False

    @classmethod
    def step_overlap_refusal(cls, ddp_settings: Sequence[Any]) -> Optional[str]:
        """Why the Muon step cannot finish during the next forward on this engine
        (``muon_step_overlap='forward'``), or None if it can. ``ddp_settings``: each chunk's
        ``ddp_config``, or Megatron-LM's arguments (the same names) before any chunk exists."""
        return f"{cls.__name__} has no per-unit parameter sync that megatron_muon hooks"

    # ------------------------------------------------------------------ the optimizer's storage
    def __init__(
        self,
        opt,
        data_parallel_group: dist.ProcessGroup,
        data_parallel_group_gloo: Optional[dist.ProcessGroup] = None,
        data_parallel_group_idx: int = 0,
    ) -> None:
        """``opt``'s storage over ``data_parallel_group`` (with its gloo twin and this rank's
        model-parallel index, Megatron's ``DistributedOptimizer`` arguments)."""
        self.opt = opt
        self.data_parallel_group = data_parallel_group
        """The group the masters are sharded over (the plan's data-parallel ranks)."""
        self.shard_map: ShardMap = self.build_shard_map()

    def build_shard_map(self) -> ShardMap:
        raise NotImplementedError

    def float16_masters(self) -> List[torch.Tensor]:
        """This rank's fp32 masters of the bf16/fp16 Muon parameters (an fp32 parameter's
        master is the parameter's own storage)."""
        raise NotImplementedError

    def model_ranges(self, masters: Sequence[torch.Tensor]) -> List[Optional[torch.Tensor]]:
        """Per master of :meth:`float16_masters`: the range of its model parameter's storage
        the master -> model copy writes it into (the model's dtype, on the device), where that
        copy is a plain one; None where it is not (the engine quantizes, or has no such range)."""
        return [None for _ in masters]

    def copy_grads_to_masters(self) -> List[torch.Tensor]:
        """The reduced gradients into this rank's masters' ``.grad``; returns every master
        gradient this rank holds (to unscale and check for inf/NaN)."""
        raise NotImplementedError

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or drop) the model's gradients and the masters' (Megatron's ``zero_grad``)."""
        raise NotImplementedError

    def copy_masters_to_model(self, params: Optional[Collection[int]] = None) -> None:
        """The updated masters into the model's parameters (their shard of them); only the
        parameters whose ``id`` is in ``params`` if given."""
        raise NotImplementedError

    def copy_model_to_masters(self, state_dict=None) -> None:
        """The masters from the model's parameters (or from ``state_dict``'s): Megatron's
        ``reload_model_params``, after a load of the model without its optimizer."""
        raise NotImplementedError

    def start_param_sync(self) -> None:
        """Bring every rank's parameters up to date after the update (or start to)."""
        raise NotImplementedError

    def dispatch_param_sync(self) -> None:
        """Start the first model chunk's parameter all-gather now, to overlap the rest of the
        iteration (what Megatron's chain does with ``overlap_param_gather_with_optimizer_step``;
        both engines' chunks take ``force_dispatch``)."""
        self.opt.model_chunks[0].start_param_sync(force_dispatch=True)

    def param_sync_units(self) -> List[Tuple[Any, FrozenSet[int]]]:
        """The units the parameter sync brings up to date one at a time, each with the ids
        of its parameters, in the same order on every rank."""
        raise NotImplementedError

    def hook_param_sync(self, unit: Any, pending: Any, index: int) -> None:
        """Have ``pending.before_sync(index)`` (``pipeline.PendingStep``) run before
        ``unit``'s parameters are synced, on every path that syncs them (the next forward,
        evaluation, checkpointing)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ checkpoints
    def param_name(self, param: torch.nn.Parameter) -> str:
        """Megatron's name of a model parameter in optimizer checkpoints (experts numbered
        globally)."""
        raise NotImplementedError

    def sharded_state_dict(self, chain, model_sharded_state_dict, is_loading: bool, metadata) -> Dict[str, Any]:
        """The chained optimizer's state in :attr:`checkpoint_format`."""
        return self.checkpoint_format.sharded_state_dict(chain, model_sharded_state_dict, is_loading, metadata)

    def load_state_dict(self, chain, state_dict: Dict[str, Any]) -> None:
        """Load what the checkpoint returned for :meth:`sharded_state_dict`."""
        self.checkpoint_format.load_state_dict(chain, state_dict)
