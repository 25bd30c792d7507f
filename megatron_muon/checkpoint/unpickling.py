"""Reading a checkpoint never runs code stored in it: every unpickling goes through here.

A pickle names the functions and classes its reader calls to rebuild objects, so unpickling
a file someone else wrote runs whatever it names (``os.system``, ``builtins.eval``...).
Every checkpoint read unpickles: torch's distributed-checkpoint reader loads ``.metadata``
with plain ``pickle.load``, its default load planner every stored object (Megatron-LM's
common state, RNG states, fsdp_dtensor's arguments) with ``torch.load(weights_only=False)``
(Megatron-core's ``load_common_state_dict`` goes through it too), and Megatron-LM's legacy
files (``common.pt``, ``model_optim_rng.pt``) are ``torch.load`` files.

Here each of those goes through :class:`RestrictedUnpickler`, which resolves only the names
of :data:`ALLOWED` (what Megatron-LM's and our checkpoints hold), sets the state only of
objects it just made (never of a class: a checkpoint cannot reconfigure the process), and
bounds the size and nesting of what it builds while it builds it (a few hundred bytes of
pickle cannot make a reader hash or print for ever); anything else is refused before it
happens, raising :class:`UnsafeCheckpointError` naming it.
``checkpoint.reading`` routes torch's and Megatron-core's readers through it.
"""

from __future__ import annotations

import enum
import functools
import io
import pickle
import types
from typing import Any, Callable, Dict, List, Sequence, Tuple

from .errors import ReadStopped, UnsafeCheckpointError

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
    if module == "torch":
        import torch  # here: reading a lock or a manifest needs no torch

        return getattr(torch, name) if isinstance(getattr(torch, name, None), torch.dtype) else None
    if module.startswith(_ENUM_MODULES) and "." not in name:
        value = getattr(importlib.import_module(module), name, None)
        # One of Megatron-core's own enums, not one it imported (``enum.Enum`` itself).
        if isinstance(value, type) and issubclass(value, enum.Enum) and value.__module__.startswith(_ENUM_MODULES):
            return value
    return None


MAX_DEPTH = 100
"""Deepest nesting a checkpoint's object may have (Megatron-LM's and ours: under 10)."""
_LONG = 64
"""A string or bytes object longer than this counts as ``len // _LONG`` elements (printing
a list of a thousand references to one long string writes it a thousand times)."""


def _element_budget(read: int) -> int:
    """How many elements a pickle of ``read`` bytes may reach through its shared references,
    beyond the ones it spells out: a tree costs at least a byte per element, a DAG of a
    few hundred bytes reaches 2**90 (hashing or printing visits each)."""
    return (1 << 20) + 16 * read


class RestrictedUnpickler(pickle._Unpickler):  # noqa: SLF001 (the Python one: its opcodes can be checked)
    """An unpickler that builds data and nothing else, in a bounded time.

    * **Names**: only :func:`allowed` ones resolve (Python's documented way to restrict
      unpickling: every object a pickle builds comes from a resolved name).
    * **BUILD** (setting an object's state, ``setattr`` with a slot state) applies only to an
      instance this pickle just created of a class it resolved, once, before the instance
      is put into anything: never to a class, a function or an enum member, whose change
      would hold for the whole process.
    * **Bounds, checked at each opcode before anything hashes or prints the result**: every
      object's element count (counted through every reference to a shared part) and
      nesting depth; the elements reached through second and later references to shared
      parts stay within :func:`_element_budget` of the bytes read, and nesting within
      :data:`MAX_DEPTH`. A container is not changed once it has been put into another, so
      the counts stay exact (and no cycle can form).

    A refusal is a :class:`ReadStopped` (a ``BaseException``: torch's readers swallow
    an ``Exception`` there) carrying one line that names what was refused."""

    where = "the checkpoint"

    def __init__(self, file, *args, **kwargs) -> None:
        super().__init__(file, *args, **kwargs)
        read, readline = self._file_read, self._file_readline

        def counted_read(*n):
            data = read(*n)
            self._bytes_read += len(data)
            return data

        def counted_readline():
            data = readline()
            self._bytes_read += len(data)
            return data

        self._file_read, self._file_readline = counted_read, counted_readline
        self._bytes_read = 0
        self._counts: Dict[int, Tuple[int, int]] = {}
        """id -> (elements, depth) of what this pickle made (and long strings it placed)."""
        self._alive: List[Any] = []  # keeps every counted object, so that its id stays its own
        self._placed: set = set()
        self._made: set = set()
        self._built: set = set()
        self._classes: List[type] = []
        self._shared = 0

    def find_class(self, module: str, name: str) -> Any:
        value = allowed(module, name)
        if value is None:  # a BaseException: torch's readers swallow an Exception here
            raise ReadStopped(refused(f"{module}.{name}", self.where))
        if isinstance(value, type):
            self._classes.append(value)
        return value

    def _refuse(self, what: str) -> None:
        raise ReadStopped(
            UnsafeCheckpointError(
                f"{self.where} holds {what}, which no checkpoint of Megatron-LM or megatron_muon holds: refused "
                "without loading it (reading it could change this process's classes, or never end); use a "
                "checkpoint from a source you trust"
            )
        )

    def _place(self, obj: Any) -> Tuple[int, int]:
        """``obj`` put into a container (or passed to a constructor): its (elements, depth);
        a second or later placement adds its elements to the shared ones."""
        key = id(obj)
        count = self._counts.get(key)
        if count is None:
            if not (isinstance(obj, (str, bytes, bytearray)) and len(obj) > _LONG):
                return 1, 0
            count = self._count(obj, 1 + len(obj) // _LONG, 0)
        if key in self._placed:
            self._shared += count[0]
            if self._shared > _element_budget(self._bytes_read):
                self._refuse(
                    f"a pickled structure that reaches over {self._shared:,} elements through shared references "
                    f"from {self._bytes_read:,} bytes (a DAG: hashing or printing it visits every one)"
                )
        else:
            self._placed.add(key)
        return count

    def _count(self, obj: Any, elements: int, depth: int) -> Tuple[int, int]:
        if depth > MAX_DEPTH:
            self._refuse(f"a pickled structure nested deeper than {MAX_DEPTH} levels")
        key = id(obj)
        if key not in self._counts:
            self._alive.append(obj)
        self._counts[key] = (elements, depth)
        return elements, depth

    def _children(self, children: Sequence[Any]) -> Tuple[int, int]:
        """(elements, depth) that ``children`` add to what holds them, placing each."""
        elements, depth = 0, 0
        for child in children:
            n, d = self._place(child)
            elements, depth = elements + n, max(depth, d + 1)
        return elements, depth

    def _creates(self, children: Sequence[Any], original: Callable, made: bool) -> None:
        """An opcode that makes a new object of ``children`` (a tuple, a list...; with
        ``made``, a constructor's or function's result)."""
        elements, depth = self._children(children)
        original(self)
        result = self.stack[-1]
        if id(result) not in self._counts:  # not an existing object returned again (an enum member)
            self._count(result, 1 + elements, max(depth, 1))
            if made:
                self._made.add(id(result))

    def _fills(self, target: Any, children: Sequence[Any], original: Callable, kind: type) -> None:
        """An opcode that adds ``children`` to ``target``, a ``kind`` this pickle made and has
        not yet put anywhere."""
        key = id(target)
        if not isinstance(target, kind) or key not in self._counts or key in self._placed:
            self._refuse(f"a pickle that changes a {type(target).__name__} it did not just make, or already placed")
        if any(child is target for child in children):
            self._refuse(f"a pickled {type(target).__name__} that holds itself")
        elements, depth = self._children(children)
        before = self._counts[key]
        self._count(target, before[0] + elements, max(before[1], depth))
        original(self)

    def _build(self, original: Callable) -> None:
        state, target = self.stack[-1], self.stack[-2]
        if isinstance(target, (type, types.FunctionType, types.BuiltinFunctionType)):
            name = f"{target.__module__}.{target.__qualname__}"
            self._refuse(f"a pickled BUILD on {name} itself (it would set that class's or function's attributes)")
        if isinstance(target, enum.Enum):
            self._refuse(f"a pickled BUILD on the enum member {target!r} (it would change it for the whole process)")
        key = id(target)
        if key not in self._made or key in self._built or not self._classes_hold(target):
            self._refuse(f"a pickled BUILD on a {type(target).__name__} it did not just create")
        self._fills(target, [state], original, object)
        self._built.add(key)

    def _classes_hold(self, target: Any) -> bool:
        return isinstance(target, tuple(self._classes))


def _marked(unpickler: RestrictedUnpickler) -> List[Any]:
    return list(unpickler.stack)  # the items since the last MARK


def _top(n: int) -> Callable[[RestrictedUnpickler], List[Any]]:
    return lambda unpickler: unpickler.stack[-n:] if n else []


def _install_checks() -> None:
    """:class:`RestrictedUnpickler`'s dispatch: Python's, with every opcode that makes or
    changes a container, calls a constructor or sets state going through its checks."""
    base = pickle._Unpickler.dispatch  # noqa: SLF001
    table = dict(base)
    creates = {
        pickle.EMPTY_TUPLE: (_top(0), False),
        pickle.EMPTY_LIST: (_top(0), False),
        pickle.EMPTY_DICT: (_top(0), False),
        pickle.EMPTY_SET: (_top(0), False),
        pickle.TUPLE: (_marked, False),
        pickle.TUPLE1: (_top(1), False),
        pickle.TUPLE2: (_top(2), False),
        pickle.TUPLE3: (_top(3), False),
        pickle.LIST: (_marked, False),
        pickle.DICT: (_marked, False),
        pickle.FROZENSET: (_marked, False),
        pickle.REDUCE: (_top(1), True),  # the arguments (a tuple) of a resolved function or class
        pickle.NEWOBJ: (_top(1), True),
        pickle.NEWOBJ_EX: (_top(2), True),
        pickle.OBJ: (_marked, True),
        pickle.INST: (_marked, True),
    }
    for opcode, (children, made) in creates.items():
        original = base[opcode[0]]
        table[opcode[0]] = functools.partial(
            lambda u, original, children, made: u._creates(children(u), original, made),
            original=original,
            children=children,
            made=made,
        )
    fills = {
        pickle.APPEND: (lambda u: u.stack[-2], _top(1), list),
        pickle.APPENDS: (lambda u: u.metastack[-1][-1], _marked, list),
        pickle.SETITEM: (lambda u: u.stack[-3], _top(2), dict),
        pickle.SETITEMS: (lambda u: u.metastack[-1][-1], _marked, dict),
        pickle.ADDITEMS: (lambda u: u.metastack[-1][-1], _marked, set),
    }
    for opcode, (target, children, kind) in fills.items():
        original = base[opcode[0]]
        table[opcode[0]] = functools.partial(
            lambda u, original, target, children, kind: u._fills(target(u), children(u), original, kind),
            original=original,
            target=target,
            children=children,
            kind=kind,
        )
    build = base[pickle.BUILD[0]]
    table[pickle.BUILD[0]] = lambda u: u._build(build)
    RestrictedUnpickler.dispatch = table


_install_checks()


def _restricted_pickle_module(where: str) -> types.ModuleType:
    """A ``pickle``-like module for ``torch.load(pickle_module=...)``: torch's loader
    subclasses its ``Unpickler`` (and reads storages itself)."""
    module = types.ModuleType("megatron_muon_restricted_pickle")
    module.Unpickler = type("Unpickler", (RestrictedUnpickler,), {"where": where})
    module.load = lambda file, **kw: module.Unpickler(file, **kw).load()
    module.loads = lambda data, **kw: module.Unpickler(io.BytesIO(data), **kw).load()
    return module


def load_pickle(file, where: str) -> Any:
    """A plain pickle (torch DCP's ``.metadata``) from the open binary ``file``; raises
    :class:`UnsafeCheckpointError` naming what it refused."""
    unpickler = RestrictedUnpickler(file)
    unpickler.where = where
    try:
        return unpickler.load()
    except ReadStopped as refusal:
        raise refusal.error from None


def torch_load(file, where: str) -> Any:
    """``torch.load`` of a binary stream (on the CPU), restricted; raises
    :class:`UnsafeCheckpointError` naming what it refused."""
    import torch

    try:
        return torch.load(file, map_location="cpu", weights_only=False, pickle_module=_restricted_pickle_module(where))
    except ReadStopped as refusal:
        raise refusal.error from None
