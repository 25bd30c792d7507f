"""Staging directories: the only directories a writer of ours ever empties or removes.

A checkpoint is written into a staging directory and moved into place once complete
(``publish``); the converter builds a new destination the same way; a re-save moves the
previous copy aside while it swaps. What a killed writer leaves there is cleared by the next
writer of the same directory. Such names (``iter_N.tmp``, ``iter_N.old``, ``DST.tmp``...) may
also be a user's folder, or a symlink to one, and a name proves nothing. So a staging
directory is a **container**:

* created by its writer with ``mkdir`` (exclusive: an existing name is never taken over by
  creating it), then marked at once with :data:`MARKER`, a file holding the writer's
  identity (``save_lock.holder_identity``: host, PID, start time, token);
* the checkpoint itself is written into a directory inside it (:func:`inner`), so the marker
  never enters a checkpoint or its manifest;
* only a real directory (not a symlink) carrying a regular-file marker is ever removed
  (:func:`remove`), and only when its writer is this process or provably gone, or the caller
  holds the lock of the save directory it lies in (the lock proves every other writer
  there has ended); ``shutil.rmtree`` never follows a symlink inside it.

A name taken by anything else is left as it is: :func:`make` then uses a name of its own
(``<name>.<token>``) or, where the caller needs the fixed name, refuses in one line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from typing import Dict, Iterable, Optional

from .errors import CheckpointError

MARKER = "megatron_muon.staging"
"""File name of the marker inside a staging container."""
FRESH = re.compile(r"\.[0-9a-f]{32}$")
"""The suffix of a container made beside a name that was taken (``<name>.<token>``)."""

Identity = Dict[str, object]


class NotOurs(CheckpointError):
    """A name a writer would stage into is taken by something it did not make."""


def marker(path: str) -> Optional[Identity]:
    """The identity in ``path``'s marker when ``path`` is a staging container (a directory,
    not a symlink, holding the marker as a regular file); None otherwise."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return None
        mark = os.path.join(path, MARKER)
        if not stat.S_ISREG(os.lstat(mark).st_mode):
            return None
        with open(mark) as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) and isinstance(value.get("token"), str) else None


def _create(path: str, identity: Identity) -> bool:
    """``mkdir path`` and its marker; False when the name is taken."""
    try:
        os.mkdir(path)
    except FileExistsError:
        return False
    fd = os.open(os.path.join(path, MARKER), os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        json.dump(identity, f)
        f.flush()
        os.fsync(f.fileno())
    return True


def removable(path: str, tokens: Iterable[str] = (), locked: bool = False) -> bool:
    """Whether ``path`` is a staging container that may be removed: marked, and made by a
    writer holding one of ``tokens`` (this process, this job), or made in a directory whose
    lock the caller holds (``locked``), or made by a process that is provably gone."""
    from .save_lock import process_gone

    found = marker(path)
    if found is None:
        return False
    return locked or found["token"] in set(tokens) or process_gone(found) is not None


def remove(path: str, tokens: Iterable[str] = (), locked: bool = False) -> bool:
    """Remove the staging container ``path`` if :func:`removable`; whether it was."""
    if not removable(path, tokens, locked):
        return False
    shutil.rmtree(path)  # path itself is a real directory; rmtree unlinks the symlinks inside
    return True


def not_ours(path: str) -> str:
    """Why ``path`` is left as it is (one phrase)."""
    if os.path.islink(path):
        return "a symlink, not made by megatron_muon"
    return f"not made by megatron_muon (it holds no {MARKER})"


def make(name: str, identity: Identity, tokens: Iterable[str] = (), locked: bool = False, fixed: bool = False) -> str:
    """A new staging container for ``identity``: ``name`` when free (or holding a container
    :func:`removable` by the caller, which is removed first), else ``<name>.<token>`` beside
    what holds the name, left as it is. ``fixed``: refuse with :class:`NotOurs` instead."""
    tokens = [identity["token"], *tokens]
    candidates = [name] if fixed else [name, f"{name}.{identity['token']}"]
    for path in candidates:
        if _create(path, identity) or (remove(path, tokens, locked) and _create(path, identity)):
            return path
    found = marker(name)
    if found is None:
        raise NotOurs(f"{name} exists and is {not_ours(name)}: it is left as it is; move it away, or write elsewhere")
    raise NotOurs(f"{name} is being written by {describe(found)}: wait for it to end, or write elsewhere")


_this_process: Dict[str, Identity] = {}


def this_process() -> Identity:
    """This process's identity as a writer (one token for its life)."""
    from .save_lock import holder_identity

    if os.getpid() not in _this_process:  # a forked child is another writer
        _this_process[os.getpid()] = holder_identity("a checkpoint writer")
    return _this_process[os.getpid()]


def inner(container: str, target: str) -> str:
    """Where in ``container`` the directory bound for ``target`` is written."""
    return os.path.join(container, os.path.basename(target.rstrip("/")))


def describe(identity: Optional[Identity]) -> str:
    if not identity:
        return "unknown"
    return f"{identity.get('purpose', 'a writer')}, pid {identity.get('pid')} on {identity.get('host')}"


def fresh_name(path: str, name: str) -> bool:
    """Whether ``path`` is ``name`` or a container made beside it (``<name>.<token>``)."""
    return path == name or (path.startswith(name + ".") and FRESH.search(path[len(name) :]) is not None)
