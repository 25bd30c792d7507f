"""A Muon run moved between Megatron-FSDP (``fsdp_dtensor``) and the DistributedOptimizer
(``torch_dist``): ``tools/convert_checkpoint.py to-torch-dist`` / ``to-fsdp-dtensor``
(``convert.change_format``). The reading and writing are the fsdp_dtensor format's
(``checkpoint.fsdp_dtensor``); these are its two calls with what Megatron-LM gives them
(:data:`.converter_support.SUPPORT`).
"""

from __future__ import annotations

from megatron_muon.checkpoint.format import Checkpoint
from megatron_muon.checkpoint.fsdp_dtensor import FSDP_DTENSOR

from .converter_support import SUPPORT


def read_fsdp_dtensor(path: str, adam: bool = False) -> Checkpoint:
    """The fsdp_dtensor checkpoint at ``path`` in the converter's torch_dist form (verify it
    first: ``checkpoint_dirs.check_source``): a Muon run's, or with ``adam`` Megatron's AdamW's."""
    return FSDP_DTENSOR.read(path, SUPPORT, adam)


def write_fsdp_dtensor(path: str, ckpt: Checkpoint) -> None:
    """Write the torch_dist form ``ckpt`` as an fsdp_dtensor checkpoint into the empty
    directory ``path`` (``checkpoint_dirs.write_checkpoint``'s twin)."""
    FSDP_DTENSOR.write(path, ckpt, SUPPORT)
