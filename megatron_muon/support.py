"""What megatron_muon runs on: one support matrix, read by the library and the command line alike.

A run's settings are seen through one neutral view, :class:`Settings`: the optimizer's (a
``MuonConfig``, or Megatron-LM's arguments, which carry the same names) and the
data-parallel engine's (each model chunk's ``DistributedDataParallelConfig``, or Megatron-LM's
arguments again). Each part of the matrix owns its ``requirements(settings) -> [refusal]``:
the optimizer's here (:func:`optimizer_requirements`), each storage backend's on its class
(``StorageBackend.requirements``). A refusal is one sentence naming the setting, its
Megatron-LM flag and the fix, written once: ``get_muon_optimizer`` raises it prefixed with
its own name, Megatron-LM's argument check (``megatron_lm.integration.check_supported``)
prefixed with the flags that chose megatron_muon, before any model is built.

Validity of a single ``MuonConfig`` value (a momentum of 1.5) is the config's own check,
run where the config is made (``config.config_problems``, which also runs the CPU offload's
requirements, :func:`~megatron_muon.config.offload_problems`, read here too); what the
command line alone can ask for (a checkpoint format, Torch FSDP2) is ``check_supported``'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Sequence, Tuple

from .config import offload_problems


@dataclasses.dataclass(frozen=True)
class Settings:
    """A run's settings as the support matrix reads them."""

    optimizer: Any
    """A ``MuonConfig``, or Megatron-LM's arguments mapped onto its names
    (``megatron_lm.integration.settings_from_args``)."""
    ddp: Tuple[Any, ...]
    """Each model chunk's ``DistributedDataParallelConfig``, or (before any chunk exists)
    Megatron-LM's arguments, which carry the same names."""

    @classmethod
    def of(cls, config: Any, model_chunks: Sequence[Any]) -> "Settings":
        """The settings of ``get_muon_optimizer(config, model_chunks)``."""
        return cls(config, tuple(chunk.ddp_config for chunk in model_chunks))


def optimizer_requirements(settings: Settings) -> List[str]:
    """What the Muon optimizer needs of its config on any engine."""
    config = settings.optimizer
    refusals = offload_problems(config)
    if getattr(config, "use_precision_aware_optimizer", False):
        refusals.append(
            "megatron_muon does not support use_precision_aware_optimizer (--use-precision-aware-optimizer; it keeps "
            "fp32 masters of its own): drop it"
        )
    if getattr(config, "reuse_grad_buf_for_mxfp8_param_ag", False):
        refusals.append(
            "megatron_muon does not support reuse_grad_buf_for_mxfp8_param_ag (MXFP8 parameter all-gather through "
            "the grad buffer, --reuse-grad-buf-for-mxfp8-param-ag): leave it off"
        )
    return refusals


def step_overlap_cannot_run(why: str) -> str:
    """The refusal of ``muon_step_overlap='forward'`` where the engine says ``why`` not."""
    return (
        f"muon_step_overlap='forward' cannot run here: {why}. Set muon_step_overlap='none' "
        "(--muon-step-overlap none), or 'auto' to overlap wherever it can"
    )


def refusals(settings: Settings, storage: Any) -> List[str]:
    """Every refusal of ``settings`` on the engine of ``storage`` (a ``StorageBackend``
    class), in the order they are reported; empty when the run is supported."""
    return optimizer_requirements(settings) + storage.requirements(settings)
