"""Reading a checkpoint never runs code stored in it: every unpickling goes through here.

A pickle names the functions and classes its reader calls to rebuild objects, so unpickling
a file someone else wrote runs whatever it names (``os.system``, ``builtins.eval``...).
Every checkpoint read unpickles: torch's distributed-checkpoint reader loads ``.metadata``
with plain ``pickle.load``, its default load planner every stored object (Megatron-LM's
common state, RNG states, fsdp_dtensor's arguments) with ``torch.load(weights_only=False)``
(Megatron-core's ``load_common_state_dict`` goes through it too), and Megatron-LM's legacy
files (``common.pt``, ``model_optim_rng.pt``) are ``torch.load`` files.

Here each of those goes through :class:`RestrictedUnpickler`, which resolves only the names
of :data:`ALLOWED` (what Megatron-LM's and our checkpoints hold) and refuses anything else
before anything is called, raising :class:`UnsafeCheckpointError` with the refused name.
:func:`restricted_unpickling` routes torch's and Megatron-core's readers through it while a
checkpoint is read; :func:`unpickling_patches` does the same for a whole Megatron-LM job.
"""

from __future__ import annotations

import contextlib
import enum
import io
import os
import pickle
import threading
import types
from typing import Any, Dict, Iterator, List, Tuple

import torch

from .errors import CheckpointError, RefusedUnpickling, UnsafeCheckpointError

ALLOWED: Dict[str, Tuple[str, ...]] = {
    "torch's tensors, storages and their metadata": (
        "torch._utils._rebuild_tensor_v2",
        "torch._utils._rebuild_parameter",
        "torch._tensor._rebuild_from_type_v2",
        "torch.Size",
        "torch.device",
        "torch.serialization._get_layout",
        "torch._C.Generator",
        "collections.OrderedDict",
        # Protocol-2 pickles (torch.save's) store bytes as _codecs.encode(str, "latin1").
        "_codecs.encode",
    ),
    "torch's distributed-checkpoint metadata (.metadata)": (
        "torch.distributed.checkpoint.metadata.Metadata",
        "torch.distributed.checkpoint.metadata.MetadataIndex",
        "torch.distributed.checkpoint.metadata.StorageMeta",
        "torch.distributed.checkpoint.metadata.TensorProperties",
        "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
        "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
        "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
        "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
        "torch.distributed.checkpoint.filesystem._StorageInfo",
    ),
    "Megatron-LM's common state (megatron.core.safe_globals: arguments, RNG states, rerun state)": (
        "argparse.Namespace",
        "types.SimpleNamespace",
        "pathlib.PosixPath",
        "signal.Signals",
        "_io.BytesIO",
        "numpy.ndarray",
        "numpy.dtype",
        "numpy.dtypes.UInt32DType",
        "numpy._core.multiarray._reconstruct",
        "numpy.core.multiarray._reconstruct",
        "megatron.core.optimizer.optimizer_config.OptimizerConfig",
        "megatron.core.rerun_state_machine.RerunState",
        "megatron.core.rerun_state_machine.RerunDiagnostic",
    ),
    "megatron_muon's common state": ("megatron_muon.checkpoint.fsdp_dtensor.CommonState",),
    "Python's containers without an opcode of their own": ("builtins.set", "builtins.frozenset", "builtins.complex"),
}
"""Every name a checkpoint may make its reader resolve, by what holds it. Also admitted:
``torch.<dtype>`` (``torch.float32``...) and the enum classes of ``megatron.core`` (the
arguments hold ``AttnBackend``, ``RerunMode``...: rebuilding a member looks it up)."""

_NAMES = frozenset(name for names in ALLOWED.values() for name in names)
_RENAMED = {"megatron_muon.fsdp_dtensor": "megatron_muon.checkpoint.fsdp_dtensor"}
"""Modules of ours that moved: checkpoints written before name them by the old path."""
_ENUM_MODULES = ("megatron.core.",)


def refused(name: str, where: str) -> UnsafeCheckpointError:
    """The refusal of a pickle that names ``name``."""
    return UnsafeCheckpointError(
        f"{where} holds a pickled {name}, which no checkpoint of Megatron-LM or megatron_muon holds: refused "
        "without loading it (unpickling it could run code); use a checkpoint from a source you trust"
    )


def allowed(module: str, name: str) -> Any:
    """The object ``module.name`` if a checkpoint may name it (:data:`ALLOWED`), else None.
    Only an allowed module is imported."""
    import _compat_pickle
    import importlib

    # Protocol-2 pickles (torch.save's) name Python 2's modules (__builtin__.set).
    module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
    module = _compat_pickle.IMPORT_MAPPING.get(module, module)
    module = _RENAMED.get(module, module)
    full = f"{module}.{name}"
    if full in _NAMES:
        target = importlib.import_module(module)
        for part in name.split("."):
            target = getattr(target, part)
        return target
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    if module.startswith(_ENUM_MODULES) and "." not in name:
        value = getattr(importlib.import_module(module), name, None)
        if isinstance(value, type) and issubclass(value, enum.Enum):
            return value
    return None


class RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only :func:`allowed` names (Python's documented way
    to restrict unpickling: every object a pickle builds comes from a resolved name)."""

    where = "the checkpoint"

    def find_class(self, module: str, name: str) -> Any:
        value = allowed(module, name)
        if value is None:  # a BaseException: torch's readers swallow an Exception here
            raise RefusedUnpickling(refused(f"{module}.{name}", self.where))
        return value


def _restricted_pickle_module(where: str) -> types.ModuleType:
    """A ``pickle``-like module for ``torch.load(pickle_module=...)``: torch's loader
    subclasses its ``Unpickler`` (and reads storages itself)."""
    module = types.ModuleType("megatron_muon_restricted_pickle")
    module.Unpickler = type("Unpickler", (RestrictedUnpickler,), {"where": where})
    module.load = lambda file, **kw: module.Unpickler(file, **kw).load()
    module.loads = lambda data, **kw: module.Unpickler(io.BytesIO(data), **kw).load()
    return module


def _load_pickle(file, where: str) -> Any:
    unpickler = RestrictedUnpickler(file)
    unpickler.where = where
    return unpickler.load()


def _torch_load(file, where: str) -> Any:
    return torch.load(file, map_location="cpu", weights_only=False, pickle_module=_restricted_pickle_module(where))


def load_pickle(file, where: str) -> Any:
    """A plain pickle (torch DCP's ``.metadata``) from the open binary ``file``; raises
    :class:`UnsafeCheckpointError` naming a refused type."""
    try:
        return _load_pickle(file, where)
    except RefusedUnpickling as refusal:
        raise refusal.error from None


def torch_load(file, where: str) -> Any:
    """``torch.load`` of a file name or binary stream (on the CPU), restricted; raises
    :class:`UnsafeCheckpointError` naming a refused type."""
    try:
        return _torch_load(file, where)
    except RefusedUnpickling as refusal:
        raise refusal.error from None


def read_dcp_metadata(checkpoint_dir: str):
    """torch DCP's ``.metadata`` of ``checkpoint_dir`` (every stored item, its global shape
    and where it lies), read through :class:`RestrictedUnpickler`; an unreadable one is a
    :class:`CheckpointError` (a refused type, an :class:`UnsafeCheckpointError`)."""
    path = os.path.join(checkpoint_dir, ".metadata")
    try:
        with open(path, "rb") as f:
            return load_pickle(f, path)
    except CheckpointError:
        raise
    except Exception as e:  # a missing, truncated or foreign file: the same user error
        raise CheckpointError(f"{checkpoint_dir} is not a torch_dist or fsdp_dtensor checkpoint ({e})") from e


# ---------------------------------------------------------------------------------------
# torch's and Megatron-core's checkpoint readers, restricted
# ---------------------------------------------------------------------------------------


_RESTRICTED = "__megatron_muon_restricted__"
"""Marks a reader replaced here (``__wrapped__`` alone would not: any ``functools.wraps``
decorator of torch's sets it, and the patch would then be skipped)."""


def _restricted(replacement, original):
    replacement.__wrapped__ = original
    setattr(replacement, _RESTRICTED, True)
    return replacement


def _read_metadata(original):
    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as file:
            metadata = _load_pickle(file, str(path))
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    return _restricted(read_metadata, original)


def _load_bytes(original):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        where = f"the stored object {read_item.dest_index.fqn}"
        obj = _torch_load(value, where)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj

    return _restricted(load_bytes, original)


def _load_common(original):
    def load_common(checkpoint_dir):
        path = os.path.join(str(checkpoint_dir), "common.pt")
        return _torch_load(path, path)

    return _restricted(load_common, original)


def unpickling_patches() -> List[Tuple[Any, str, Any, Any]]:
    """``(owner, name, original, replacement)`` for every checkpoint reader that unpickles:
    torch DCP's ``FileSystemReader.read_metadata`` and ``DefaultLoadPlanner.load_bytes``,
    Megatron-core's legacy ``load_common`` (``common.pt``)."""
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import common
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    out = []
    for owner, name, wrap in (
        (FileSystemReader, "read_metadata", _read_metadata),
        (DefaultLoadPlanner, "load_bytes", _load_bytes),
        (common, "load_common", _load_common),
        (serialization, "load_common", _load_common),
    ):
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        if not getattr(original, _RESTRICTED, False):
            out.append((owner, name, original, wrap(original)))
    return out


_lock = threading.RLock()
_depth = 0
_installed: List[Tuple[Any, str, Any, Any]] = []


@contextlib.contextmanager
def restricted_unpickling() -> Iterator[None]:
    """Inside the block, every checkpoint read of torch DCP and Megatron-core unpickles
    through :class:`RestrictedUnpickler` (reentrant; a no-op where the patches are already
    installed for the whole job)."""
    global _depth, _installed
    with _lock:
        if _depth == 0:
            _installed = unpickling_patches()
            for owner, name, _, replacement in _installed:
                setattr(owner, name, replacement)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for owner, name, original, _ in reversed(_installed):
                    setattr(owner, name, original)
                _installed = []
