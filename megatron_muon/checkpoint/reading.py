"""Reading a checkpoint's files: only its own regular files, through the restricted
unpickler, and at start-up in a bounded time.

A checkpoint is a directory of regular files. A FIFO, a device or a socket in its place
would block a reader for ever (opening a FIFO waits for a writer) or feed it without end
(``/dev/zero``), and torch DCP's ``.metadata`` names, for each stored item, the file it lies
in, which torch's reader joins to the directory unchecked: any local file could be read as
the checkpoint's. So:

* :func:`open_regular` opens a file without blocking, checks what it opened, and refuses
  anything but a regular file in one line naming it; every file of a checkpoint is opened
  through it (torch DCP's local reads too, inside :func:`restricted_reading`);
* :func:`check_storage` refuses a ``.metadata`` whose items lie anywhere but in a DCP data
  file of the checkpoint itself (a plain ``*.distcp`` name, a regular file, listed in the
  manifest when there is one), or past that file's end;
* :func:`bounded` ends a read that does not finish in :func:`read_bound` seconds (a hung
  filesystem) with one line naming the file being read; the start-up checks run inside it.

:func:`restricted_reading` routes torch DCP's and Megatron-core's readers through the
restricted unpickler (``checkpoint.unpickling``) and the checks above while a checkpoint is
read; :func:`reader_patches` does the same for a whole Megatron-LM job.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import stat
import threading
import weakref
from typing import IO, Any, Iterator, List, Optional, Tuple

from .. import patching
from ..patching import Patch
from .errors import CheckpointError, ReadStopped, UnsafeCheckpointError
from .unpickling import load_pickle, torch_load

READ_BOUND_ENV = "MEGATRON_MUON_READ_TIMEOUT"
"""Environment variable: seconds a start-up read of a checkpoint may take (default
:data:`READ_BOUND`)."""
READ_BOUND = 300.0
"""Seconds a start-up read may take: its files are small (the tracker, the manifest,
``.metadata``, the common state), read in well under a second on any working filesystem."""
DCP_METADATA = ".metadata"
DCP_DATA_SUFFIX = ".distcp"
MANIFEST = "integrity.json"
"""Megatron-core's manifest file name (``integrity.MANIFEST``; read here only for its listing)."""

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))  # fmt: skip


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words ("a regular file", "a FIFO"...)."""
    return next((kind for test, kind in _KINDS if test(mode)), "a regular file" if stat.S_ISREG(mode) else "special")


class NotARegularFile(CheckpointError):
    """A checkpoint's file that is a FIFO, a device, a socket or a directory."""


# ---------------------------------------------------------------------------------------
# Opening one file, within the time bound
# ---------------------------------------------------------------------------------------

_open: List[Tuple[str, Any]] = []
"""(path, weak reference to its file) of what :func:`open_regular` opened in a bounded
block: the last one still open is named when the bound runs out."""
_armed = threading.Lock()


def _being_read() -> Optional[str]:
    for path, ref in reversed(_open):
        f = ref()
        if f is not None and not f.closed:
            return path
    return None


def open_regular(path: str, mode: str = "rb", **kwargs: Any) -> IO:
    """``open(path, mode)`` for reading, refusing (:class:`NotARegularFile`, one line naming
    it) anything but a regular file: it is opened without blocking (a FIFO would wait for a
    writer) and checked before it is read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        kind = file_kind(os.fstat(fd).st_mode)
        if kind != "a regular file":
            raise NotARegularFile(
                f"{path} is {kind}, not a regular file: a checkpoint holds only regular files (a reader would wait "
                "or read for ever); remove it, or restore the file from a copy of the checkpoint"
            )
        os.set_blocking(fd, True)
        f = os.fdopen(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise
    if _armed.locked():
        _open[:] = [(p, ref) for p, ref in _open if ref() is not None and not ref().closed]
        _open.append((str(path), weakref.ref(f)))
    return f


def regular_files_only(checkpoint_dir: str) -> None:
    """Refuse (:class:`NotARegularFile`, one line) a checkpoint directory holding a FIFO, a
    device or a socket (followed through a symlink), before a reader that does not open
    through :func:`open_regular` (Megatron-core's ``metadata.json``) blocks on it. For a
    checkpoint without a manifest, whose listing would have found it."""
    for entry in os.scandir(checkpoint_dir):
        try:
            kind = file_kind(os.stat(entry.path).st_mode)
        except OSError:
            continue  # a dangling symlink: opening it fails at once
        if kind not in ("a regular file", "a directory"):
            raise NotARegularFile(
                f"{entry.path} is {kind}, not a regular file: a checkpoint holds only regular files (a reader would "
                "wait or read for ever); remove it"
            )


def read_bound() -> float:
    """Seconds a bounded read may take: ``$MEGATRON_MUON_READ_TIMEOUT``, else :data:`READ_BOUND`."""
    try:
        value = float(os.environ.get(READ_BOUND_ENV, READ_BOUND))
    except ValueError:
        return READ_BOUND
    return value if value > 0 else READ_BOUND


@contextlib.contextmanager
def bounded(what: str) -> Iterator[None]:
    """Inside the block, reading that takes longer than :func:`read_bound` seconds ends with a
    :class:`CheckpointError` naming the file being read (the last one :func:`open_regular`
    opened, else ``what``). A timer signal (``SIGALRM``) interrupts the read, so this works
    in the main thread only; elsewhere, and inside another bounded block (whose bound
    holds), the block runs unbounded. A read the kernel does not interrupt (an NFS hard
    mount in uninterruptible sleep) is not ended."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getitimer(signal.ITIMER_REAL)[0] > 0 or not _armed.acquire(blocking=False):
        yield
        return
    seconds = read_bound()

    def expired(signum, frame):
        raise ReadStopped(
            CheckpointError(
                f"reading {_being_read() or what} did not finish in {seconds:g} s (a hung filesystem, or a file that "
                f"never ends): check it; {READ_BOUND_ENV} sets the bound in seconds"
            )
        )

    previous = signal.signal(signal.SIGALRM, expired)
    _open.clear()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except ReadStopped as stopped:
        raise stopped.error from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        _open.clear()
        _armed.release()


# ---------------------------------------------------------------------------------------
# torch DCP's .metadata: read restricted, naming only the checkpoint's own files
# ---------------------------------------------------------------------------------------


def _listed(checkpoint_dir: str) -> Optional[set]:
    """The files the manifest of ``checkpoint_dir`` lists; None without a manifest (an
    unreadable one lists nothing)."""
    path = os.path.join(checkpoint_dir, MANIFEST)
    if not os.path.lexists(path):
        return None
    try:
        with open_regular(path, "r") as f:
            files = json.load(f).get("files")
    except (OSError, ValueError, AttributeError, CheckpointError):
        return set()
    return set(files) if isinstance(files, dict) else set()


def check_storage(metadata: Any, checkpoint_dir: str, where: str) -> None:
    """Refuse (:class:`UnsafeCheckpointError`, one line) a DCP ``metadata`` (read from
    ``where``) that places a stored item anywhere but in a DCP data file of
    ``checkpoint_dir`` itself: a plain ``*.distcp`` file name (no directory, not absolute),
    a regular file there (not a FIFO, a device, a symlink), listed in the manifest when the
    checkpoint has one; and the item's bytes inside that file."""
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        return  # not DCP metadata: its reader fails on it, naming it
    listed, sizes = _listed(checkpoint_dir), {}

    def refuse(name: Any, why: str) -> None:
        raise UnsafeCheckpointError(
            f"{where} places stored items in {name!r}, {why}: refused without reading it (a checkpoint's items "
            "lie in its own DCP data files); use a checkpoint from a source you trust"
        )

    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or os.path.basename(name) != name or not name.endswith(DCP_DATA_SUFFIX):
            refuse(name, f"which is not a {DCP_DATA_SUFFIX} file of the checkpoint's own directory")
        if listed is not None and name not in listed:
            refuse(name, f"which its {MANIFEST} does not list")
        if name not in sizes:
            try:
                info_stat = os.lstat(os.path.join(checkpoint_dir, name))
            except FileNotFoundError:
                refuse(name, "which is missing")
            kind = "a symlink" if stat.S_ISLNK(info_stat.st_mode) else file_kind(info_stat.st_mode)
            if kind != "a regular file":
                refuse(name, f"which is {kind}, not a regular file")
            sizes[name] = info_stat.st_size
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (isinstance(offset, int) and isinstance(length, int) and 0 <= offset and 0 <= length):
            refuse(name, "at no valid byte range")
        if offset + length > sizes[name]:
            refuse(name, f"at bytes {offset}-{offset + length}, past its end ({sizes[name]} bytes)")


def read_dcp_metadata(checkpoint_dir: str):
    """torch DCP's ``.metadata`` of ``checkpoint_dir`` (every stored item, its global shape
    and where it lies), read through the restricted unpickler and :func:`check_storage`; an
    unreadable one is a :class:`CheckpointError` (a refused one, an
    :class:`UnsafeCheckpointError`)."""
    path = os.path.join(checkpoint_dir, DCP_METADATA)
    try:
        with bounded(path), open_regular(path) as f:
            metadata = load_pickle(f, path)
    except CheckpointError:
        raise
    except Exception as e:  # a missing, truncated or foreign file: the same user error
        raise CheckpointError(f"{checkpoint_dir} is not a torch_dist or fsdp_dtensor checkpoint ({e})") from e
    check_storage(metadata, checkpoint_dir, path)
    return metadata


# ---------------------------------------------------------------------------------------
# torch's and Megatron-core's checkpoint readers, restricted
# ---------------------------------------------------------------------------------------


def _read_metadata(original, context=None):
    from torch.distributed.checkpoint.filesystem import FileSystem

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as file:
                metadata = load_pickle(file, str(path))
            if isinstance(self.fs, FileSystem):  # a local directory (fsspec's readers name remote objects)
                check_storage(metadata, str(self.path), str(path))
        except CheckpointError as refusal:  # DCP would swallow it
            raise ReadStopped(refusal) from None
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    read_metadata.__wrapped__ = original  # type: ignore[attr-defined]
    return read_metadata


def _create_stream(original, context=None):
    """torch DCP's local ``FileSystem.create_stream``: reads through :func:`open_regular`."""

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if "r" not in mode or "+" in mode:
            with original(self, path, mode) as stream:
                yield stream
            return
        try:
            stream = open_regular(os.fspath(path), mode)
        except CheckpointError as refusal:  # DCP would swallow it
            raise ReadStopped(refusal) from None
        with stream:
            yield stream

    create_stream.__wrapped__ = original  # type: ignore[attr-defined]
    return create_stream


def _load_bytes(original, context=None):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch_load(value, f"the stored object {read_item.dest_index.fqn}")
        except CheckpointError as refusal:  # DCP would swallow it
            raise ReadStopped(refusal) from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj

    load_bytes.__wrapped__ = original  # type: ignore[attr-defined]
    return load_bytes


def _load_common(original, context=None):
    def load_common(checkpoint_dir):
        path = os.path.join(str(checkpoint_dir), "common.pt")
        try:
            with open_regular(path) as f:
                return torch_load(f, path)
        except CheckpointError as refusal:  # Megatron-core's caller would swallow it
            raise ReadStopped(refusal) from None

    load_common.__wrapped__ = original  # type: ignore[attr-defined]
    return load_common


_HERE = "megatron_muon.checkpoint.reading"
_WHY_READ = "every checkpoint read unpickles through the restricted unpickler and opens regular files only"
READERS: Tuple[Patch, ...] = (
    Patch(
        "torch.distributed.checkpoint.filesystem:FileSystemReader",
        "read_metadata",
        f"{_HERE}:_read_metadata",
        _WHY_READ + " (DCP's .metadata; restated: the storage it names is checked to lie inside the checkpoint)",
        "torch 2.11.0",
    ),
    Patch(
        "torch.distributed.checkpoint.filesystem:FileSystem",
        "create_stream",
        f"{_HERE}:_create_stream",
        _WHY_READ + " (every file DCP opens for reading)",
        "torch 2.11.0",
    ),
    Patch(
        "torch.distributed.checkpoint.default_planner:DefaultLoadPlanner",
        "load_bytes",
        f"{_HERE}:_load_bytes",
        _WHY_READ + " (DCP's stored objects; restated)",
        "torch 2.11.0",
    ),
    *(
        Patch(
            module,
            "load_common",
            f"{_HERE}:_load_common",
            _WHY_READ + " (Megatron-core's common.pt; restated)",
            "megatron-core 0.19.2",
        )
        for module in (
            "megatron.core.dist_checkpointing.strategies.common",
            "megatron.core.dist_checkpointing.serialization",
        )
    ),
)
"""Every checkpoint reader of torch DCP and Megatron-core, restricted (table rows of
``megatron_lm/patches.py``; declared here, where the core uses them)."""


@contextlib.contextmanager
def restricted_reading() -> Iterator[None]:
    """Inside the block, every checkpoint read of torch DCP and Megatron-core goes through
    :data:`READERS` (reentrant; what a whole Megatron-LM job installed stays in force)."""
    with patching.scoped(READERS):
        yield
