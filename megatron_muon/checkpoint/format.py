"""What a checkpoint format is (:class:`CheckpointFormat`), and the converter's form of a
whole checkpoint (:class:`Checkpoint`).

Megatron-LM writes two formats that megatron_muon saves its state in: ``torch_dist``
(Megatron-core's dist-checkpointing, with the DistributedOptimizer: :mod:`.torch_dist`) and
``fsdp_dtensor`` (torch DCP alone, with Megatron-FSDP: :mod:`.fsdp_dtensor`). Each is one
:class:`CheckpointFormat` object in its own module, written against the shard map and
Megatron-core alone; a storage backend holds the one its engine writes
(``StorageBackend.checkpoint_format``), and the Megatron-LM glue and the converter ask it
rather than branch on the format's name. A new format is one module with a subclass, added
to ``formats.FORMATS`` (``docs/design.md``, "Where each checkpoint format lives").

The converter's in-memory form of a whole checkpoint (:class:`Checkpoint`) is torch_dist's
terms: every format reads into it and writes from it, so a conversion between any two is a
read and a write.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, Tuple


@dataclass
class Checkpoint:
    """A whole checkpoint in memory, in torch_dist's terms."""

    tensors: Dict[str, Any] = field(default_factory=dict)
    objects: Dict[Tuple[str, Tuple[int, ...], Tuple[int, ...]], Any] = field(default_factory=dict)
    """(key, global offset, global shape) -> object (e.g. layers' ``_extra_state``)."""
    common: Dict[str, Any] = field(default_factory=dict)
    group_meta: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    """Read from an fsdp_dtensor checkpoint: parameter name -> its optimizer group's settings."""


@dataclass(frozen=True)
class ConverterSupport:
    """What only the Megatron-LM glue can give a format's converter read and write."""

    collective_io: Callable[[], ContextManager[Any]]
    """Megatron-core's checkpoint I/O from one process (a one-rank group, its CPU stand-ins)."""
    model_layout: Callable[[Any], Any]
    """Saved Megatron-LM arguments -> where each model tensor lies in torch_dist's form
    (``fsdp_dtensor.Layout``), from the model Megatron-LM builds of them."""


class CheckpointFormat:
    """One checkpoint format: the optimizer's part of a save and a load (from the shard map),
    how to tell a directory of it, its common state, and the converter's read and write."""

    name: str
    """Megatron-LM's ``--ckpt-format`` of it."""
    engine: str
    """How a run writes it, as a phrase of the command line (``with --use-megatron-fsdp``)."""
    described: str
    """It in a sentence, with an article (``a torch_dist (DistributedOptimizer)``)."""
    convert_command: str
    """``tools/convert_checkpoint.py``'s command that moves a Muon run into this format."""
    converted_suffix: str
    """What a save directory moved into this format is suffixed with, by the advice we print."""
    megatron_dcp_only: bool = False
    """Whether Megatron-LM reads and writes it with one torch DCP call of its own (not through
    dist-checkpointing, which megatron_muon wraps): the glue verifies it when Megatron-LM
    detects its format, and stages the DCP save."""
    async_save: bool = True
    """Whether megatron_muon can stage and verify Megatron-core's asynchronous save of it."""

    # ------------------------------------------------------------------ the optimizer's state
    def sharded_state_dict(self, chain, model_sharded_state_dict, is_loading: bool, metadata) -> Dict[str, Any]:
        """The ``MuonChainedOptimizer``'s state for a save (or, ``is_loading``, what a load fills)."""
        raise NotImplementedError

    def load_state_dict(self, chain, state_dict: Dict[str, Any]) -> None:
        """Load what the checkpoint returned for :meth:`sharded_state_dict`."""
        raise NotImplementedError

    # ------------------------------------------------------------------ a directory of it
    def detect(self, path: str) -> bool:
        """Whether the files of ``path`` are of this format (our record aside: ``formats.detect``)."""
        raise NotImplementedError

    def read_common(self, path: str) -> Dict[str, Any]:
        """The common (non-tensor) state, as Megatron-LM's torch_dist common state dict keys it
        (iteration, args, checkpoint_version, optimizer), without reading a tensor; through
        the restricted unpickler, no process group needed."""
        raise NotImplementedError

    def state_of_key(self, key: str) -> str:
        """The optimizer state a stored tensor key under ``optimizer.state.`` holds."""
        raise NotImplementedError

    def requested_by(self, megatron_args: Any) -> bool:
        """Whether Megatron-LM's arguments ask for this format (``--ckpt-format``)."""
        return getattr(megatron_args, "ckpt_format", "torch_dist") == self.name

    # ------------------------------------------------------------------ the converter
    def read(self, path: str, support: ConverterSupport, adam: bool = False) -> Checkpoint:
        """The checkpoint ``path`` (verified first by the caller) in the converter's form: a
        Muon run's, or with ``adam`` Megatron's AdamW's."""
        raise NotImplementedError

    def write(self, path: str, ckpt: Checkpoint, support: ConverterSupport) -> None:
        """Write ``ckpt`` in this format into the empty directory ``path`` (a staging directory:
        the caller publishes it with its manifest)."""
        raise NotImplementedError

    def adam_needs_resave(self, optimizer_common: Any) -> bool:
        """Whether Megatron's AdamW state in this format must be re-saved parameter by parameter
        by Megatron-LM before :meth:`read` (its default layout of DDP buckets)."""
        return False

    def __repr__(self) -> str:
        return f"<checkpoint format {self.name}>"
