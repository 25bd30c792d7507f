"""Megatron-LM's checkpoint directories: their layout, verified before any read.

A save directory (``--save``) holds ``iter_NNNNNNN`` directories (or ``release``) and the
tracker ``latest_checkpointed_iteration.txt`` naming the one to resume from. An iteration
directory holds one checkpoint format (``checkpoint.formats``: torch_dist or fsdp_dtensor),
whose object reads and writes it; what megatron_muon writes there also carries its manifest
and record (``checkpoint.integrity``).

Every read here verifies first and unpickles through the restricted unpickler
(``checkpoint.unpickling``); every write goes through ``checkpoint.publish`` under the
directory's lock (``checkpoint.save_lock``). The converter's commands (``convert``,
``convert_fsdp``), the start-up checks (``launch``) and Megatron-LM's load hooks
(``checkpoint_guards``) build on this module.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from megatron_muon.checkpoint import formats, staging
from megatron_muon.checkpoint.errors import CheckpointError
from megatron_muon.checkpoint.format import Checkpoint, CheckpointFormat
from megatron_muon.checkpoint.fsdp_dtensor import FSDP_DTENSOR, load_dcp  # noqa: F401 (load_dcp: for callers)
from megatron_muon.checkpoint.integrity import (
    MANIFEST,
    RECORD,
    has_manifest,
    missing_manifest_error,
    saved_with_manifest,
    verify_manifest,
)
from megatron_muon.checkpoint.optimizer_state import STATE_PREFIX
from megatron_muon.checkpoint.publish import PREVIOUS, STAGING, publish, recover_interrupted_swap
from megatron_muon.checkpoint.reading import bounded, open_regular, read_dcp_metadata, regular_files_only
from megatron_muon.checkpoint.torch_dist import TORCH_DIST

from .converter_support import SUPPORT

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
_ITERATION_DIR = re.compile(r"^iter_(\d{7})$")
_LEFTOVER = re.compile(r"^(iter_\d{7}|release)(\.tmp|\.old|\.resave\.tmp)(\.[0-9a-f]{32})?$")
"""The names of what an interrupted save or conversion of ours leaves in a save directory
(its staging containers: ``checkpoint.staging``)."""
RESAVE = ".resave.tmp"
"""Suffix of the container in which Megatron-LM re-saves a converter's source (``convert``)."""


# ---------------------------------------------------------------------------------------
# The layout of a save directory
# ---------------------------------------------------------------------------------------


def iteration_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def saved_iterations(directory: str) -> List[int]:
    """The iterations of ``directory``'s ``iter_NNNNNNN`` directories, newest first."""
    if not os.path.isdir(directory):
        return []
    found = (_ITERATION_DIR.match(name) for name in os.listdir(directory))
    return sorted((int(m.group(1)) for m in found if m), reverse=True)


def same_directory(a: Optional[str], b: Optional[str]) -> bool:
    """Whether ``a`` and ``b`` (either may be unset) name one directory, however spelled."""
    return bool(a) and bool(b) and os.path.realpath(a) == os.path.realpath(b)


def holds_a_run(directory: Optional[str]) -> bool:
    """Whether ``directory`` holds a training run's checkpoints (a tracker or iterations)."""
    return bool(directory) and (os.path.isfile(os.path.join(directory, TRACKER)) or bool(saved_iterations(directory)))


def read_tracker(directory: str) -> Optional[str]:
    """What ``directory``'s tracker names (an iteration in ASCII digits, or ``release``); None
    when it is missing, empty, not a regular file, or anything else."""
    path = os.path.join(directory, TRACKER)
    try:
        with bounded(path), open_regular(path, "r") as f:
            text = f.read(64).strip()
    except (OSError, UnicodeDecodeError, CheckpointError):
        return None
    return text if (text.isascii() and text.isdigit()) or text == RELEASE else None  # "³".isdigit(); int() fails


def tracker_entry(directory: str, iteration: int) -> Tuple[str, str]:
    """``(path, text)`` of the tracker naming ``iteration`` (for ``publish(tracker=...)``)."""
    return os.path.join(directory, TRACKER), str(iteration)


def newest_verified(directory: str) -> Optional[int]:
    """The newest iteration of ``directory`` whose manifest verifies (this process alone)."""
    for iteration in saved_iterations(directory):
        try:
            verify_manifest(os.path.join(directory, iteration_dir_name(iteration)), local=True)
        except CheckpointError:
            continue
        return iteration
    return None


def remove_leftovers(directory: str) -> List[str]:
    """Undo what interrupted saves and conversions of ours left in ``directory`` (a swap's
    ``iter_N.old`` put back or removed, a staging ``iter_N.tmp`` or re-save scratch
    removed); one line per thing done, and per thing of such a name left because no writer of
    ours made it (``checkpoint.staging``: a user's folder, a symlink). Only for a directory
    this process holds the lock of: a leftover of a live job is that job's work in progress."""
    done = []
    if not os.path.isdir(directory):
        return done
    for name in sorted(os.listdir(directory)):
        match = _LEFTOVER.match(name)
        if match is None:
            continue
        path = os.path.join(directory, name)
        if staging.marker(path) is None:
            done.append(f"left {path} as it is: it is {staging.not_ours(path)}")
        elif match.group(2) == PREVIOUS and not match.group(3):
            line = recover_interrupted_swap(os.path.join(directory, match.group(1)), locked=True)
            if line:
                done.append(line)
        elif staging.remove(path, locked=True):
            done.append(f"removed {path}, left by an interrupted save")
    return done


def resume_iteration(directory: str) -> Tuple[Optional[int], Optional[str]]:
    """The iteration to resume from in ``directory`` when its tracker cannot say, and the
    line saying why: ``(None, None)`` when the tracker names an iteration that is there
    (or nothing was saved). An empty, unreadable or missing tracker beside saved iterations,
    or one naming a missing iteration, resumes from the newest iteration that verifies;
    none verifying is a :class:`CheckpointError`."""
    tracked = read_tracker(directory)
    tracker = os.path.join(directory, TRACKER)
    if tracked is not None:
        name = RELEASE if tracked == RELEASE else iteration_dir_name(int(tracked))
        if os.path.isdir(os.path.join(directory, name)):
            return None, None
        what = f"names {name}, which is missing"
    elif not saved_iterations(directory):
        return None, None
    else:
        what = "is missing" if not os.path.exists(tracker) else "is empty or unreadable"
    newest = newest_verified(directory)
    if newest is None:
        raise CheckpointError(
            f"{tracker} {what} and no iteration in {directory} verifies against its manifest: nothing to resume "
            "from; check the directory, or start a new run with another --save"
        )
    return newest, f"{tracker} {what}: resuming from {iteration_dir_name(newest)}, the newest iteration that verifies"


def resolve_source(src: str) -> str:
    """The checkpoint directory ``src`` names: itself (an iteration directory), or the
    iteration a save directory's tracker names (the newest that verifies when the tracker
    is broken or names a missing iteration, said on stdout)."""
    if os.path.isdir(src) and (holds_a_run(src) or os.path.exists(os.path.join(src, TRACKER))):
        iteration, why = resume_iteration(src)
        if why:
            print(f"megatron_muon: {why}", flush=True)
        if iteration is None:
            tracked = read_tracker(src)
            if tracked is None:
                raise CheckpointError(f"{os.path.join(src, TRACKER)} is empty and {src} holds no iteration")
            return os.path.join(src, RELEASE if tracked == RELEASE else iteration_dir_name(int(tracked)))
        return os.path.join(src, iteration_dir_name(iteration))
    if formats.detect(src) is None:
        raise CheckpointError(
            f"{src} is neither a checkpoint directory (no {TRACKER}) nor a torch_dist or fsdp_dtensor "
            "checkpoint; give the --save directory or one iter_XXXXXXX in it"
        )
    return src


# ---------------------------------------------------------------------------------------
# One iteration directory: its format, whether it is ours, verified before any read
# ---------------------------------------------------------------------------------------


def checkpoint_format(path: str) -> str:
    """``torch_dist``, ``fsdp_dtensor`` or ``unknown``: the name of :func:`formats.detect`'s answer."""
    found = formats.detect(path)
    return found.name if found is not None else "unknown"


def is_fsdp_dtensor(path: str) -> bool:
    return formats.detect(path) is FSDP_DTENSOR


_OUR_KEYS = (STATE_PREFIX + "momentum_buffer.", "optimizer.muon.common")


def written_by_megatron_muon(path: str) -> bool:
    """Whether ``path`` holds what only megatron_muon writes: Muon optimizer state (its DCP
    metadata says), or arguments of a run under megatron_muon (``--muon-impl``, read through
    the restricted unpickler). Such a checkpoint always carries our manifest and record, so
    one that lost both is refused rather than read as someone else's."""
    try:
        keys = read_dcp_metadata(path).state_dict_metadata
    except CheckpointError:
        return False
    if any(k.startswith(_OUR_KEYS) or k.endswith(".momentum_buffer") for k in keys):
        return True
    try:
        args = read_common(path).get("args")
    except CheckpointError:
        return False
    return hasattr(args, "muon_impl")


COMMON_ITEMS = ("common_state", "iteration", "args", "optimizer.muon.common", "optimizer.param_to_group_meta")
"""The stored items :func:`read_common` reads, in either format (for ``check_source(items=...)``)."""


def check_source(path: str, unverified: bool = False, items: Optional[Sequence[str]] = None) -> bool:
    """Verify ``path`` against its manifest before anything of it is unpickled; returns
    whether it was verified. Refused: a checkpoint saved with a manifest that is gone, one
    holding what only megatron_muon writes without our files, and (unless ``unverified``)
    any other without a manifest (e.g. saved by plain Megatron-LM). ``items``: verify only
    what reading those stored items needs (``integrity.verify_manifest``); this process alone."""
    if has_manifest(path):
        verify_manifest(path, local=items is not None, items=items)
        return True
    if saved_with_manifest(path):
        raise missing_manifest_error(path)
    regular_files_only(path)
    if written_by_megatron_muon(path):
        raise CheckpointError(
            f"{path} was written by megatron_muon but has lost its {MANIFEST} and {RECORD}, which every checkpoint "
            "it writes carries: it cannot be verified, so it is refused; restore it from a copy"
        )
    if not unverified:
        raise CheckpointError(
            f"{path} has no {MANIFEST} (saved without megatron_muon), so its files cannot be verified: pass "
            "--unverified-source to convert it anyway (the result is labelled as converted from an unverified source)"
        )
    return False


# ---------------------------------------------------------------------------------------
# Reading (after check_source) and writing a whole checkpoint in memory
# ---------------------------------------------------------------------------------------


def checkpoint_iteration(common: Dict[str, Any]) -> int:
    """The training iteration a checkpoint was saved at (Megatron-LM's ``iteration``)."""
    return int(common.get("iteration", common.get("extra", {}).get("iteration", 0)) or 0)


def format_of(path: str) -> CheckpointFormat:
    """The format of the checkpoint directory ``path`` (``formats.detect``), torch_dist,
    Megatron-core's default, when its files say neither."""
    return formats.detect(path) or formats.default()


def read_common(path: str) -> Dict[str, Any]:
    """The common (non-tensor) state of the checkpoint ``path`` in its format, without
    reading a tensor (fsdp_dtensor: iteration, arguments and the optimizer's common state).
    Needs no process group (a rank reads it at start-up, before it joins its job)."""
    return format_of(path).read_common(path)


def read_checkpoint(path: str) -> Checkpoint:
    """Every tensor (full global shape), sharded object and the common state of the
    torch_dist checkpoint ``path`` (verify it first: :func:`check_source`)."""
    return TORCH_DIST.read(path, SUPPORT)


def write_checkpoint(path: str, ckpt: Checkpoint) -> None:
    """Write ``ckpt`` as a torch_dist checkpoint into the empty directory ``path`` (a
    staging directory of :func:`publish_iteration`, which adds the manifest)."""
    TORCH_DIST.write(path, ckpt, SUPPORT)


# ---------------------------------------------------------------------------------------
# Writing an iteration into a save directory
# ---------------------------------------------------------------------------------------


def check_paths(src: str, dst: str) -> None:
    """The source is never the destination, inside it, or its parent (nor the reverse), nor
    is it, or does it lie inside, ``DST.tmp``, where a new destination is built (:func:`owned`):
    nothing the converter writes or removes holds the source."""
    a, b = os.path.realpath(src), os.path.realpath(dst)
    if a == b or a.startswith(b + os.sep) or b.startswith(a + os.sep):
        raise CheckpointError(
            f"the destination {dst} {'is' if a == b else 'contains' if a.startswith(b + os.sep) else 'is inside'} "
            f"the source {src}; write the converted checkpoint to a separate directory"
        )
    built = dst.rstrip("/") + STAGING
    c = os.path.realpath(built)
    if a == c or a.startswith(c + os.sep):
        raise CheckpointError(
            f"the source {src} {'is' if a == c else 'lies inside'} {built}, where the converter builds {dst}: "
            "choose another destination"
        )


def check_destination(dst: str, iteration: int, overwrite: bool) -> None:
    """Without ``overwrite``, an existing ``dst`` may neither hold ``iteration`` already nor
    a later one, tracked or not (its tracker would name an older iteration than it holds)."""
    final = os.path.join(dst, iteration_dir_name(iteration))
    if os.path.exists(final) and not overwrite:
        raise CheckpointError(f"{final} already exists; pass --overwrite to replace it, or choose another destination")
    tracked = read_tracker(dst) if os.path.isdir(dst) else None
    if tracked is not None and tracked.isdigit() and int(tracked) > iteration:
        what, newest = f"{os.path.join(dst, TRACKER)} names iteration {tracked}", int(tracked)
    elif any(i > iteration for i in saved_iterations(dst)):  # a broken or missing tracker
        newest = saved_iterations(dst)[0]
        what = f"{dst} holds {iteration_dir_name(newest)}"
    else:
        return
    if not overwrite:
        raise CheckpointError(
            f"{what}, later than the converted {iteration}: --load {dst} would no longer resume from {newest}; "
            f"choose another destination, or pass --overwrite to point its tracker at {iteration} "
            f"({iteration_dir_name(newest)} is kept)"
        )


@contextlib.contextmanager
def owned(directory: str, purpose: str) -> Iterator[Tuple[str, Any]]:
    """A save directory to write into under this process's lock (``save_lock.take``), what
    interrupted writes of ours left there undone first; yields ``(where to write, lock)``.

    An existing ``directory`` is written in place. A new one is built complete inside the
    staging container ``<directory>.tmp`` (``checkpoint.staging``: made by this process, or
    left by a converter that is provably gone, never a folder it did not make) and renamed
    to ``directory`` when the block ends without error, so a killed writer never leaves a
    partial ``directory``; on an error the container is removed."""
    from megatron_muon.checkpoint.save_lock import take

    directory = directory.rstrip("/")
    if os.path.lexists(directory):
        lock = take(directory, purpose)
        try:
            for line in remove_leftovers(directory):
                print(f"megatron_muon: {line}", flush=True)
            yield directory, lock
        finally:
            lock.release()
        return
    os.makedirs(os.path.dirname(os.path.abspath(directory)), exist_ok=True)
    identity = staging.this_process()
    container = _take_staging(directory + STAGING, directory, identity)
    where = staging.inner(container, directory)
    try:
        lock = take(where, purpose)
    except BaseException:
        staging.remove(container, [identity["token"]])
        raise
    try:
        yield where, lock
        if os.path.lexists(directory):
            raise CheckpointError(f"{directory} appeared while the converter built it: it is left as it is")
        os.rename(where, directory)
        lock.moved_to(directory)
    finally:
        lock.release()
        staging.remove(container, [identity["token"]])


def _take_staging(name: str, directory: str, identity: Dict[str, Any]) -> str:
    """The staging container ``name`` for building ``directory``, made by this process; one a
    killed converter left is removed first once its writer is provably gone (by its PID on
    this machine, else by the heartbeat of the lock it took inside)."""
    from megatron_muon.checkpoint.save_lock import LOCK, live_holder, process_gone

    found = staging.marker(name)
    if found is not None and process_gone(found) is None:
        inner = staging.inner(name, directory)
        holder = live_holder(inner) if os.path.lexists(os.path.join(inner, LOCK)) else staging.describe(found)
        if holder is not None:
            raise staging.NotOurs(f"{name} is being written by {holder}: wait for it to end, or write elsewhere")
    return staging.make(name, identity, locked=found is not None, fixed=True)


def publish_iteration(
    dst: str,
    iteration: int,
    write: Callable[[str], Any],
    lock: Any,
    source_verified: bool = True,
) -> str:
    """Write ``dst/iter_NNNNNNN`` with ``write(staging)`` through ``checkpoint.publish``
    (staged, manifest, verified when replacing, swapped in), then the tracker naming it.
    ``lock``: this process's ``save_lock`` of ``dst``. Returns the iteration directory."""
    final = os.path.join(dst, iteration_dir_name(iteration))
    publish(final, write, tracker=tracker_entry(dst, iteration), source_verified=source_verified, lock=lock)
    return final
