"""One job per save directory: a lock file in it, taken before a job writes anything there.

``<directory>/megatron_muon.lock`` names its holder (host, boot, PID namespace, PID and the
process's start time, the command) and a random token. It is created with ``O_CREAT | O_EXCL``, which is
atomic on local filesystems and on the shared ones training clusters use (NFSv3 and later,
Lustre, GPFS); ``flock`` is not used: on NFS it is emulated with byte-range locks whose
state lives in lock daemons and can outlive or lose a crashed client, Lustre honours it only
when mounted with ``-o flock``, object-store (FUSE) mounts ignore it, and a kernel lock
cannot say who holds it.

A lock is **taken over** only when its holder is provably gone:

* on the same host (same boot) and in the same PID namespace: no process has its PID with
  its start time (a PID reused by another process has another start time);
* on another host, or in another PID namespace (a container sharing the host's name, as
  with host networking: its PIDs mean other processes here): its heartbeat is older than
  :data:`LEASE` seconds. The holder touches the
  lock every :data:`HEARTBEAT` seconds from a daemon thread; the age is measured on the
  filesystem's own clock (the time stamp of a file written now), not on either host's.

Otherwise the job is refused in one line naming the holder. A take-over renames the stale
lock aside (one rename can succeed) and checks that what it moved is the lock it judged
stale. Before each checkpoint is swapped into place, the holder confirms the lock is still
its own (:meth:`SaveLock.confirm`), so a job that lost it (its lease ran out while it was
stopped) stops instead of writing beside the new holder.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import stat
import sys
import threading
import time
import uuid
from typing import Dict, Optional

from .errors import CheckpointError, SaveDirectoryLockedError

LOCK = "megatron_muon.lock"
"""File name of the lock inside a save directory."""
HEARTBEAT = 10.0
"""Seconds between the holder's touches of its lock."""
LEASE = 120.0
"""Seconds after its last touch a lock of another host counts as abandoned."""


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_namespace() -> Optional[int]:
    """This process's PID namespace (the inode of ``/proc/self/ns/pid``; equal for every
    process of one namespace, seen from anywhere), None where ``/proc`` does not say."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def process_start(pid: int) -> Optional[str]:
    """A process's start time (clock ticks since boot, from ``/proc``), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[19] if len(fields) > 19 else None


def holder_identity(purpose: str, command: Optional[str] = None) -> Dict[str, object]:
    """What a lock records of this process (``command``: as the user typed it; default
    this process's arguments)."""
    return {
        "host": socket.gethostname(),
        "boot_id": _boot_id(),
        "pid_namespace": _pid_namespace(),
        "pid": os.getpid(),
        "start": process_start(os.getpid()),
        "started_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "purpose": purpose,
        "command": (command or " ".join(sys.argv))[:500],
        "token": uuid.uuid4().hex,
    }


def _read(path: str) -> Optional[Dict[str, object]]:
    from .reading import open_regular  # here: this module stays light (a launcher imports it before torch)

    try:
        with open_regular(path, "r") as f:
            value = json.load(f)
    except (OSError, ValueError, CheckpointError):
        return None
    return value if isinstance(value, dict) else None


def _filesystem_now(directory: str) -> float:
    """The time stamp the filesystem of ``directory`` gives a file written now."""
    probe = os.path.join(directory, f".{LOCK}.clock.{uuid.uuid4().hex}")
    os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    try:
        return os.stat(probe).st_mtime
    finally:
        os.unlink(probe)


def judged_by_pid(holder: Dict[str, object]) -> bool:
    """Whether ``holder`` (an identity :func:`holder_identity` recorded) can be judged by its
    PID here: it ran on this machine, since its last boot, in this PID namespace (a lock
    written without its namespace, by an older version, is judged by its heartbeat)."""
    namespace = _pid_namespace()
    return (
        holder.get("host") == socket.gethostname()
        and holder.get("boot_id") == _boot_id()
        and namespace is not None
        and holder.get("pid_namespace") == namespace
    )


def process_gone(holder: Dict[str, object]) -> Optional[str]:
    """Why the process ``holder`` names is provably gone (one phrase); None while it may live
    or cannot be judged from here (:func:`judged_by_pid`)."""
    if not judged_by_pid(holder):
        return None
    pid = holder.get("pid")
    if not isinstance(pid, int) or process_start(pid) != holder.get("start"):
        return f"process {pid} on this host has ended"
    return None


def holder_gone(holder: Dict[str, object], lock_path: str) -> Optional[str]:
    """Why the holder of ``lock_path`` is provably gone (one phrase), or None while it may live:
    by its PID where :func:`judged_by_pid`, else by its heartbeat."""
    if judged_by_pid(holder):
        return process_gone(holder)
    try:
        age = _filesystem_now(os.path.dirname(lock_path)) - os.stat(lock_path).st_mtime
    except FileNotFoundError:
        return "its lock is gone"
    if age > LEASE:
        return f"its heartbeat stopped {age:.0f} s ago (the lease is {LEASE:.0f} s)"
    return None


def describe(holder: Optional[Dict[str, object]]) -> str:
    if not holder:
        return "a job whose lock is being written"
    return (
        f"{holder.get('purpose', 'a job')} (pid {holder.get('pid')} on {holder.get('host')}, started "
        f"{holder.get('started_at')}: {str(holder.get('command', ''))[:120]})"
    )


class SaveLock:
    """This process's lock on a save directory (:func:`take`)."""

    def __init__(self, directory: str, identity: Dict[str, object]) -> None:
        self.directory = directory
        self.path = os.path.join(directory, LOCK)
        self.identity = identity
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="megatron_muon save lock", daemon=True)
        self._thread.start()
        atexit.register(self.release)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT):
            if not self.held():
                return
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def held(self) -> bool:
        holder = _read(self.path)
        return bool(holder) and holder.get("token") == self.identity["token"]

    def confirm(self) -> None:
        """Raise :class:`SaveDirectoryLockedError` unless the lock is still this process's."""
        if not self.held():
            raise SaveDirectoryLockedError(
                f"{self.directory}: this job no longer holds {LOCK} (now {describe(_read(self.path))}): "
                "stopped before writing beside that job"
            )

    def moved_to(self, directory: str) -> None:
        """The locked directory was renamed to ``directory`` (with the lock inside)."""
        _held.pop(self.directory, None)
        self.directory, self.path = os.path.abspath(directory), os.path.join(os.path.abspath(directory), LOCK)
        _held[self.directory] = self

    def release(self) -> None:
        """Remove the lock if it is still this process's (at exit, or when the job is done)."""
        self._stop.set()
        if self.held():
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        if _held.get(self.directory) is self:
            del _held[self.directory]


_held: Dict[str, SaveLock] = {}


def live_holder(directory: str) -> Optional[str]:
    """Who holds ``directory``'s lock, while that holder may live (None: nobody, or a holder
    that is provably gone). Reads only."""
    path = os.path.join(os.path.abspath(directory), LOCK)
    holder = _read(path)
    if holder is None or holder.get("token") == getattr(held(directory), "identity", {}).get("token"):
        return None
    try:
        return None if holder_gone(holder, path) else describe(holder)
    except OSError:  # a read-only directory: the probe of its clock cannot be written
        return describe(holder)


def refusal(directory: str, holder: str) -> SaveDirectoryLockedError:
    return SaveDirectoryLockedError(
        f"{directory} is being written by {holder}: one job per save directory; wait for it to end, stop it, "
        "or save elsewhere (--save)"
    )


def held(directory: str) -> Optional[SaveLock]:
    """The lock this process holds on ``directory``, if any."""
    lock = _held.get(os.path.abspath(directory))
    return lock if lock is not None and lock.held() else None


def take(directory: str, purpose: str, command: Optional[str] = None) -> SaveLock:
    """The lock of ``directory`` (created if missing) for this process: a new one, this
    process's own again, or a dead holder's taken over (said on stderr). Raises
    :class:`SaveDirectoryLockedError` naming a live holder, :class:`CheckpointError` when
    the directory cannot be written."""
    directory = os.path.abspath(directory)
    if directory in _held and _held[directory].held():
        return _held[directory]
    try:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, LOCK)
        identity = holder_identity(purpose, command)
        for _ in range(20):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                _take_over_if_abandoned(path, directory)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(identity, f)
                f.flush()
                os.fsync(f.fileno())
            _held[directory] = SaveLock(directory, identity)
            return _held[directory]
    except OSError as e:
        raise CheckpointError(
            f"{directory} cannot be written ({e.strerror or e}): a save directory must be writable; "
            "choose another (--save) or fix its permissions"
        ) from e
    raise SaveDirectoryLockedError(f"{directory}: could not take {LOCK} (it kept changing hands)")


def _take_over_if_abandoned(path: str, directory: str) -> None:
    """Remove the lock at ``path`` if its holder is provably gone; raise while it lives, and
    for anything at ``path`` that is not a lock file (left as it is)."""
    from .reading import file_kind

    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        kind = "a symlink" if stat.S_ISLNK(mode) else file_kind(mode)
        raise SaveDirectoryLockedError(
            f"{path} is {kind}, not a lock file of megatron_muon's: it is left as it is; remove or rename it, "
            "or save elsewhere (--save)"
        )
    holder = _read(path)
    if holder is None:  # being written this instant, or damaged: give its writer a moment
        time.sleep(0.2)
        holder = _read(path)
        if holder is None:
            try:
                age = _filesystem_now(directory) - os.stat(path).st_mtime
            except FileNotFoundError:
                return
            if age <= LEASE:
                raise SaveDirectoryLockedError(
                    f"{directory} holds an unreadable {LOCK} written {age:.0f} s ago: another job may be starting "
                    f"there; if none is, remove {path}"
                )
    why = holder_gone(holder, path) if holder is not None else "its lock is unreadable and old"
    if why is None:
        raise refusal(directory, describe(holder))
    aside = f"{path}.stale.{uuid.uuid4().hex}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return  # another job took it over first
    moved = _read(aside)
    if holder is not None and (moved is None or moved.get("token") != holder.get("token")):
        with contextlib.suppress(OSError):  # not the lock judged stale: put it back
            os.link(aside, path)
        os.unlink(aside)
        return
    os.unlink(aside)
    print(f"megatron_muon: took over {path} from {describe(holder)}: {why}", file=sys.stderr, flush=True)
