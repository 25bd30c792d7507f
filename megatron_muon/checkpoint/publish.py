"""Publishing a checkpoint directory: at every instant its name holds a complete, verified
checkpoint or nothing.

:func:`publish` is the one routine every writer goes through (the library's
``save_checkpoint``, Megatron-LM's ``save_checkpoint`` through
``megatron_lm.checkpoint_guards``, and the converter):

1. every rank writes into a staging directory (``<target>.tmp/<name>``, inside a container
   of ``staging``'s that only this save made), never into ``target``;
2. once all have written, the manifest (``integrity``) is written, last;
3. when ``target`` exists (a re-save), the new copy is verified before it replaces it;
4. the save directory's lock (``save_lock``) is confirmed to be still this job's;
5. rank 0 swaps the directory into place (:func:`swap_into_place`);
6. the tracker file, if the writer keeps one, is replaced atomically to name it.

A failure at any step leaves ``target`` as it was (and the staging directory, which the next
publish of the same target, or a load that owns the directory, removes: ``staging`` says
which directories a writer may remove). Failures on one rank
are raised on every rank (:func:`on_rank0`), so no rank waits in a collective another left;
a full disk is named as such (:func:`write_failure`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
from typing import Any, Callable, Iterator, Optional, Sequence, Tuple

import torch.distributed as dist
import torch.distributed.checkpoint.api

from .errors import CheckpointError, errors_behind
from .integrity import agreed, has_manifest, verify_manifest, write_atomically, write_manifest
from .staging import inner as staged_in
from .staging import make as make_staging
from .staging import marker as staging_marker
from .staging import removable as removable_staging
from .staging import remove as remove_staging
from .staging import this_process

WRITE_ERRORS = (Exception, torch.distributed.checkpoint.api.CheckpointException)
"""A write that failed (and says why): its staging directory is removed. An interruption
(KeyboardInterrupt, a kill) leaves it to the next publish of the same target."""
STAGING = ".tmp"
"""Suffix of the directory a checkpoint is written into before it is swapped into place."""
PREVIOUS = ".old"
"""Suffix of the previous copy while a swap without an atomic exchange runs."""


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def on_rank0(action: Callable[[], Any], what: str, directory: str) -> Any:
    """Run ``action`` on rank 0; its result on every rank, or its failure raised on every
    rank: a :class:`CheckpointError` as it is, an ``OSError`` as one line
    (:func:`write_failure`)."""
    result, error = None, None
    if _rank0():
        try:
            result = action()
        except CheckpointError as e:
            error = (type(e), str(e))
        except OSError as e:
            error = (CheckpointError, write_failure(e, what, directory))
    result, error = agreed((result, error))
    if error:
        raise error[0](error[1])
    return result


def _barrier() -> None:
    if _world() > 1:
        dist.barrier()


def publish(
    target: str,
    write: Callable[[str], Any],
    *,
    tracker: Optional[Tuple[str, str]] = None,
    source_verified: bool = True,
    lock: Any = None,
) -> Any:
    """``write(staging)`` on every rank, then steps 2-6 of the module docstring, collectively.

    ``write`` may return an asynchronous request (``add_finalize_fn``): steps 2-6 then run as
    its first finalize step. ``tracker``: ``(path, text)`` written atomically once ``target``
    is in place. ``source_verified=False`` labels a conversion of an unverified source.
    ``lock``: the ``save_lock.SaveLock`` this job holds on the directory (rank 0's; confirmed
    before the swap). Returns what ``write`` returned."""
    target = str(target).rstrip("/")
    writer = Writer(lock)

    def prepare() -> str:
        for line in filter(None, [recover_interrupted_swap(target, writer.tokens, writer.locked)]):
            print(f"megatron_muon: {line}", flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
        container = make_staging(target + STAGING, writer.identity, writer.tokens, writer.locked)
        os.mkdir(staged_in(container, target))
        return container

    container = on_rank0(prepare, "creating the staging directory", target + STAGING)
    stage = staged_in(container, target)
    _barrier()
    with _discarded_on_failure(container, target, writer):
        request = write(stage)

    @_discarded_on_failure(container, target, writer)
    def finish() -> None:
        replacing = agreed(os.path.isdir(target) and bool(os.listdir(target)))  # before anyone swaps
        write_manifest(stage, source_verified=source_verified)  # collective; ends with a barrier
        if replacing:
            verify_manifest(stage)  # collective: the copy it replaces stays until this one reads back
        on_rank0(lambda: lock.confirm() if lock is not None else None, "confirming the save directory's lock", target)

        def into_place() -> None:
            swap_into_place(stage, target, writer)
            remove_staging(container, writer.tokens)  # empty, or holding the copy the exchange replaced
            if tracker is not None:
                write_atomically(*tracker)

        on_rank0(into_place, "moving the checkpoint into place", target)

    if hasattr(request, "add_finalize_fn"):
        request.add_finalize_fn(finish)
    else:
        finish()
    return request


class Writer:
    """Who writes a checkpoint: the job holding ``lock`` on its save directory (its token
    marks its staging directories; every other writer there has ended), or this process."""

    def __init__(self, lock: Any = None) -> None:
        self.identity = lock.identity if lock is not None else this_process()
        self.locked = lock is not None
        self.tokens = [self.identity["token"], this_process()["token"]]


@contextlib.contextmanager
def _discarded_on_failure(container: str, target: str, writer: Writer) -> Iterator[None]:
    """When the block fails (:data:`WRITE_ERRORS`), on rank 0: the staging container removed
    (on a full disk it holds the space), and ``target`` if it is an empty directory made for
    this save; the failure goes on, as one :class:`CheckpointError` line when the disk was full
    as it failed (judged before the removal frees the space: torch's and Megatron-core's
    writers lose the OS error on some paths)."""
    try:
        yield
    except WRITE_ERRORS as failure:
        full = os_error_code(failure) == errno.ENOSPC or (
            os_error_code(failure) is None and disk_full(os.path.dirname(target))
        )
        if _rank0():
            with contextlib.suppress(OSError):
                remove_staging(container, writer.tokens)
                _remove_if_empty(target)
        if full and not isinstance(failure, CheckpointError):
            raise CheckpointError(
                write_failure(
                    OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
                    f"saving {os.path.basename(target)}",
                    os.path.dirname(target),
                )
            ) from failure
        raise


def _remove_if_empty(path: str) -> None:
    """``rmdir path`` when it is an empty directory, not a symlink (one made for a save)."""
    if os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path):
        os.rmdir(path)


def write_failure(error: BaseException, what: str, directory: str) -> str:
    """One line for a failed write: a full disk or a read-only filesystem named as such,
    with the fix (torch's writers lose the OS error in some paths: the free space decides)."""
    code = os_error_code(error)
    if code is None and disk_full(directory):
        code = errno.ENOSPC
    if code == errno.ENOSPC:
        return (
            f"{what} in {directory} failed: No space left on device ({_free(directory)}); the checkpoints "
            "already saved are intact: free space there or save elsewhere (--save), then resume"
        )
    if code in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"{what} in {directory} failed: {os.strerror(code)}: save into a writable directory (--save)"
    return f"{what} in {directory} failed: {error}"


def os_error_code(error: BaseException) -> Optional[int]:
    """The ``errno`` behind ``error`` (``errors.errors_behind``; torch's writers lose it on
    some paths, keeping only the message)."""
    for behind in errors_behind(error):
        if isinstance(getattr(behind, "errno", None), int):
            return behind.errno
        if "No space left on device" in str(behind):
            return errno.ENOSPC
    return None


def _free_bytes(directory: str) -> Optional[int]:
    """Free bytes on the filesystem of ``directory`` (or its nearest existing parent)."""
    path = os.path.abspath(directory)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def disk_full(directory: str) -> bool:
    """Whether the filesystem of ``directory`` has less than a MiB free."""
    free = _free_bytes(directory)
    return free is not None and free < (1 << 20)


def _free(directory: str) -> str:
    free = _free_bytes(directory)
    return "free space unknown" if free is None else f"{free / 2**20:.1f} MiB free"


# ---------------------------------------------------------------------------------------
# The swap
# ---------------------------------------------------------------------------------------


def _exchange(a: str, b: str) -> bool:
    """Swap two directories in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); False
    where the system or filesystem has no such call."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), b)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def swap_into_place(stage: str, target: str, writer: Optional[Writer] = None) -> None:
    """Move the complete checkpoint ``stage`` (in a staging container of ``writer``'s) to
    ``target`` so that ``target`` always names a complete checkpoint: a new one is renamed
    in; an existing one is exchanged with it in one atomic step (the previous copy is then at
    ``stage``, removed with its container by the caller). Where the filesystem cannot
    exchange, two renames: ``target`` into a new staging container ``<target>.old`` (refused
    when that name holds anything ``writer`` may not remove), ``stage`` to ``target``; between
    them ``<target>.old`` holds the complete one (:func:`resolve_checkpoint_dir`,
    :func:`recover_interrupted_swap`). An empty ``target`` (a directory made for the save) is
    replaced. One process (rank 0) calls it."""
    writer = writer or Writer()
    target = target.rstrip("/")
    _remove_if_empty(target)
    if not os.path.lexists(target):
        os.rename(stage, target)
    elif not _exchange(stage, target):
        aside = make_staging(target + PREVIOUS, writer.identity, writer.tokens, writer.locked, fixed=True)
        os.rename(target, staged_in(aside, target))
        os.rename(stage, target)
        remove_staging(aside, writer.tokens)
    _fsync_dir(os.path.dirname(os.path.abspath(target)))


def recover_interrupted_swap(target: str, tokens: Sequence[str] = (), locked: bool = False) -> Optional[str]:
    """Undo what a killed :func:`swap_into_place` left at ``target``: the previous checkpoint
    back from the container ``<target>.old`` when ``target`` is missing, or that container
    removed when ``target`` is complete; only a container the caller may remove
    (``staging.removable``). Returns a line saying what was done (None: nothing)."""
    target = target.rstrip("/")
    old = target + PREVIOUS
    if not removable_staging(old, tokens, locked):
        return None
    previous = staged_in(old, target)
    if not os.path.lexists(target) and has_manifest(previous):
        os.rename(previous, target)
        remove_staging(old, tokens, locked)
        return f"{target}: an interrupted re-save left it in {old}; moved back"
    if has_manifest(target):
        remove_staging(old, tokens, locked)
        return f"{target}: removed {old}, the previous copy an interrupted re-save had replaced"
    return None


def resolve_checkpoint_dir(checkpoint_dir: str) -> str:
    """The directory to read for ``checkpoint_dir``: itself when it is complete (has its
    manifest); the previous copy in ``<checkpoint_dir>.old`` when a re-save was interrupted
    between moving it aside and moving the new one in (the directory is then missing, or
    incomplete); otherwise ``checkpoint_dir`` itself, whose verification then reports what is
    wrong. Reads only: the directory may belong to another job or be read-only."""
    base = checkpoint_dir.rstrip("/")
    previous = staged_in(base + PREVIOUS, base)
    if not has_manifest(base) and staging_marker(base + PREVIOUS) is not None and has_manifest(previous):
        return previous
    return checkpoint_dir
