"""What a checkpoint that cannot be used raises: one class per reason, each message one line
that names the cause and the fix."""

from __future__ import annotations

from typing import Iterator, Optional


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (or written), with the reason and the fix."""


class CheckpointIntegrityError(CheckpointError):
    """A checkpoint's files do not match its manifest (or it has none)."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint that holds an object whose unpickling could run code."""


class SaveDirectoryLockedError(CheckpointError):
    """A save directory another live job writes into."""


class ReadStopped(BaseException):
    """Carries a :class:`CheckpointError` out of torch's and Megatron-core's checkpoint
    readers, which swallow an ``Exception`` there (torch DCP falls back to rank-local
    metadata on any): a refused pickle or a read that did not finish must end the read.
    :func:`checkpoint_error_in` unwraps it."""

    def __init__(self, error: CheckpointError) -> None:
        super().__init__(str(error))
        self.error = error


def errors_behind(error: BaseException) -> Iterator[BaseException]:
    """``error``, its causes and contexts, and the failures torch's distributed checkpoint
    collected from ranks and re-raised wrapped (``CheckpointException.failures``)."""
    seen, pending = set(), [error]
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        yield error
        pending += [error.__cause__, error.__context__]
        for failure in getattr(error, "failures", {}).values():
            pending.append(failure[0] if isinstance(failure, tuple) else failure)


def checkpoint_error_in(error: BaseException) -> Optional[CheckpointError]:
    """The :class:`CheckpointError` behind ``error`` (:func:`errors_behind`), or None."""
    for behind in errors_behind(error):
        if isinstance(behind, CheckpointError):
            return behind
        if isinstance(behind, ReadStopped):
            return behind.error
    return None
