"""A Megatron-FSDP defect (megatron-core 0.19.2, any device) and its fix: the one change the
core makes to Megatron's code, a row of the table (``megatron_lm/patches.py``) declared here,
where the core uses it, and installed only when a caller asks for it.

Kept apart from ``storage/megatron_fsdp.py`` (which re-exports it) so that the table can be
imported without importing Megatron-core: the CPU path quiets Megatron-core's import-time
notices and compiles nothing while it is first imported, both before that import.
"""

from __future__ import annotations

import functools
from typing import Tuple

from . import patching
from .patching import Patch


def _distributed_single_rank_grads(original, context=None):
    """``DataParallelBuffer.__init__`` building a one-rank group's main-grad buffer
    "distributed" under ``optim_grads`` / ``optim_grads_params`` (see :data:`SINGLE_RANK_GROUPS`)."""

    @functools.wraps(original)
    def __init__(self, ddp_config, params, is_data_distributed, bucket_id, *args, **kwargs):
        group = kwargs.get("data_parallel_group")
        if (
            not is_data_distributed
            and kwargs.get("gradient_scaling_factor") is not None  # main-grad buffers only
            and ddp_config.data_parallel_sharding_strategy in ("optim_grads", "optim_grads_params")
            and group is not None
            and group.size() == 1
        ):
            is_data_distributed = True
        original(self, ddp_config, params, is_data_distributed, bucket_id, *args, **kwargs)

    return __init__


SINGLE_RANK_GROUPS: Tuple[Patch, ...] = (
    Patch(
        "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer:DataParallelBuffer",
        "__init__",
        "megatron_muon.megatron_fsdp_fix:_distributed_single_rank_grads",
        "Megatron-FSDP scales an unsharded one-rank group's accumulated gradient by 1/dp again at every "
        "micro-batch (optim_grads / optim_grads_params): its main-grad buffer is built distributed instead",
        "megatron-core 0.19.2",
    ),
)
"""The one change the core makes to Megatron (a row of ``megatron_lm/patches.py``'s table,
declared here where the core uses it): installed only by
:func:`fix_gradient_accumulation_on_single_rank_groups`, which the caller runs."""


def fix_gradient_accumulation_on_single_rank_groups() -> None:
    """Make Megatron-FSDP accumulate micro-batch gradients right where a data-parallel group
    has one rank (expert parameters with ``expert_model_parallel_size`` equal to the DP size).

    Under ``optim_grads`` / ``optim_grads_params`` Megatron-FSDP reduces the gradient after
    every micro-batch and scales the bucket by ``1/dp`` before the reduction. A main-grad
    buffer of a one-rank group is built unsharded, so its bucket is the accumulated gradient
    itself and earlier micro-batches are scaled again at every later one (two micro-batches
    give ``g1/4 + g2/2`` instead of ``(g1 + g2)/2``). Built as "distributed" (a one-rank shard
    is the whole bucket), each micro-batch's gradient goes through a temporary bucket and is
    added, as on larger groups. Call before wrapping with ``FullyShardedDataParallel``
    (``get_muon_optimizer`` refuses chunks built without it); idempotent, in force for the
    process (:data:`SINGLE_RANK_GROUPS` through ``megatron_muon.patching``)."""
    patching.install(SINGLE_RANK_GROUPS)
