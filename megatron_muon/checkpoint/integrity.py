"""Checkpoint integrity: a checksum manifest written last at save, verified first at load.

The manifest is Megatron-core's own (``integrity.json`` of
``megatron.core.dist_checkpointing.validation``: ``{"algorithm": "sha256", "files": {name:
sha256}}`` over every file of the checkpoint directory), so Megatron's
``verify_integrity_manifest`` accepts what we write and we accept what it writes. What we
add on top:

* **The work is split over ranks.** Megatron hashes every file on rank 0; here each rank
  hashes a share of the files (balanced by size, largest first), the digests are
  all-gathered, and rank 0 writes the manifest. Verification splits the same way and the
  verdicts are all-gathered, so a mismatch fails on *every* rank with the same message.
* **Tensors are named.** For torch_dist data files the manifest also records, per stored
  item of torch's ``.metadata`` (one tensor shard or object), its byte range and CRC-32
  (``"items"``), computed in the same pass as the file's SHA-256; a corrupt file is
  reported with the tensors whose bytes changed.
* **Written atomically**, after everything else: a temporary file, fsync, ``os.replace``.
  A directory whose manifest is missing was not completely saved.
* **Its absence is noticed.** Before hashing, a record (``megatron_muon.json``, covered by
  the manifest) says that the directory carries a manifest and which format it holds, so a
  checkpoint whose manifest was deleted is refused rather than loaded as one from a tool
  that writes none.
* **It lists the whole directory.** A file the manifest does not name (added after the
  save), or one it names that is gone, fails verification like a changed one; a manifest
  that lists nothing verifies nothing, so it is refused.

Sizes are checked before contents: a truncated file is reported as truncated, a missing file
as missing. ``items`` verifies only what a reader is about to read (the small files whole,
named items of the data files by their CRC-32), for a look at a checkpoint's common state
before the collective load verifies everything. ``python -m
megatron_muon.checkpoint.integrity write|verify DIR`` runs the same on one process.

The manifest is an unkeyed checksum: it detects corruption and incomplete or mixed saves, not
a forger, who can rewrite it (``docs/checkpoints.md``: what reading a checkpoint guarantees).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import uuid
import zlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist
from megatron.core.dist_checkpointing.validation import INTEGRITY_FNAME

from .errors import CheckpointError, CheckpointIntegrityError, UnsafeCheckpointError
from .reading import bounded, file_kind, open_regular, read_dcp_metadata

MANIFEST = INTEGRITY_FNAME
"""File name of the manifest inside a checkpoint directory (Megatron-core's)."""
RECORD = "megatron_muon.json"
"""File name of the record that a checkpoint directory carries a manifest (ours)."""
ALGORITHM = "sha256"
_BLOCK = 16 << 20
_TORCH_METADATA = ".metadata"


# ---------------------------------------------------------------------------------------
# Hashing one file
# ---------------------------------------------------------------------------------------

Item = Tuple[int, int, str]  # (offset, length, name)


def _stored_items(checkpoint_dir: str) -> Dict[str, List[Item]]:
    """File name -> the byte ranges of the tensors / objects torch's ``.metadata`` places
    in it (empty when the directory has no torch_dist metadata)."""
    if not os.path.isfile(os.path.join(checkpoint_dir, _TORCH_METADATA)):
        return {}
    try:
        metadata = read_dcp_metadata(checkpoint_dir)
    except UnsafeCheckpointError:
        raise
    except CheckpointError:
        return {}  # not torch's metadata: the files are hashed whole, no item named
    out: Dict[str, List[Item]] = {}
    for index, info in metadata.storage_data.items():
        offset = tuple(index.offset) if index.offset is not None else ()
        name = index.fqn + (f" (shard at offset {offset})" if any(offset) else "")
        out.setdefault(info.relative_path, []).append((int(info.offset), int(info.length), name))
    for items in out.values():
        items.sort()
    return out


def _hash_file(path: str, items: List[Item]) -> Tuple[str, int, List[int]]:
    """(sha256 of the whole file, its size, CRC-32 of each item's byte range), one read."""
    sha = hashlib.sha256()
    crcs = [0] * len(items)
    position, first = 0, 0  # items are sorted and disjoint: sweep them with the blocks
    with open_regular(path) as f:
        while True:
            block = f.read(_BLOCK)
            if not block:
                break
            sha.update(block)
            end = position + len(block)
            while first < len(items) and items[first][0] + items[first][1] <= position:
                first += 1
            i = first
            while i < len(items) and items[i][0] < end:
                start, length, _ = items[i]
                lo, hi = max(start, position), min(start + length, end)
                if lo < hi:
                    crcs[i] = zlib.crc32(block[lo - position : hi - position], crcs[i])
                i += 1
            position = end
    return sha.hexdigest(), position, crcs


# ---------------------------------------------------------------------------------------
# Splitting the work over ranks
# ---------------------------------------------------------------------------------------


def _group_info(group: Optional[dist.ProcessGroup]) -> Tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _my_share(sizes: Dict[str, int], rank: int, world: int) -> List[str]:
    """Files of this rank: largest first, each to the least loaded rank (deterministic)."""
    loads = [0] * world
    mine = []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        target = loads.index(min(loads))
        loads[target] += max(sizes[name], 1)
        if target == rank:
            mine.append(name)
    return mine


def _all_gather(value, group: Optional[dist.ProcessGroup], world: int) -> list:
    if world == 1:
        return [value]
    out = [None] * world
    dist.all_gather_object(out, value, group=group)
    return out


def _checkpoint_files(checkpoint_dir: str) -> Dict[str, int]:
    """Every regular file of the directory (Megatron's manifest is flat) -> its size."""
    return {
        entry.name: entry.stat().st_size
        for entry in os.scandir(checkpoint_dir)
        if entry.is_file() and entry.name != MANIFEST and not entry.name.startswith(MANIFEST + ".")
    }


# ---------------------------------------------------------------------------------------
# Save: write the manifest
# ---------------------------------------------------------------------------------------


def stored_format(checkpoint_dir: str) -> str:
    """What the files of ``checkpoint_dir`` are: ``torch_dist`` (Megatron-core's
    dist-checkpointing, with its ``metadata.json``), ``fsdp_dtensor`` (torch DCP alone), or
    ``unknown``."""
    if os.path.isfile(os.path.join(checkpoint_dir, "metadata.json")):
        return "torch_dist"
    if os.path.isfile(os.path.join(checkpoint_dir, _TORCH_METADATA)):
        return "fsdp_dtensor"
    return "unknown"


def write_manifest(
    checkpoint_dir: str, group: Optional[dist.ProcessGroup] = None, source_verified: bool = True
) -> None:
    """Hash every file of ``checkpoint_dir`` and write its manifest atomically, last.

    Collective over ``group`` (default: all ranks) when torch.distributed is initialized:
    call it on every rank after every rank finished writing (e.g. after
    ``dist_checkpointing.save`` returned). Rank 0 first writes the :data:`RECORD` (that a
    manifest exists, the format); each rank hashes its share of the files; rank 0 writes the
    manifest; all ranks return after it exists. ``source_verified=False`` (a conversion of a
    checkpoint that had no manifest) says so in the record, and loading warns.
    """
    rank, world = _group_info(group)
    if rank == 0:
        record = {"manifest": MANIFEST, "source_verified": source_verified, "format": stored_format(checkpoint_dir)}
        write_atomically(os.path.join(checkpoint_dir, RECORD), json.dumps(record))
    sizes = _checkpoint_files(checkpoint_dir) if rank == 0 else None
    sizes = agreed(sizes, group)
    items = _stored_items(checkpoint_dir)
    digests = {}
    for name in _my_share(sizes, rank, world):
        sha, size, crcs = _hash_file(os.path.join(checkpoint_dir, name), items.get(name, []))
        digests[name] = (sha, size, [[o, n, c, label] for (o, n, label), c in zip(items.get(name, []), crcs)])
    merged: Dict[str, tuple] = {}
    for part in _all_gather(digests, group, world):
        merged.update(part)
    if rank == 0:
        manifest = {
            "algorithm": ALGORITHM,
            "files": {name: merged[name][0] for name in sorted(merged)},
            "sizes": {name: merged[name][1] for name in sorted(merged)},
            "items": {name: merged[name][2] for name in sorted(merged) if merged[name][2]},
        }
        write_atomically(os.path.join(checkpoint_dir, MANIFEST), json.dumps(manifest, indent=1))
    if world > 1:
        dist.barrier(group=group)


def agreed(value, group: Optional[dist.ProcessGroup] = None):
    """The first rank's ``value`` (of ``group``, default all) on every rank: what a rank sees
    of the filesystem decides which collectives follow, so every rank must decide alike."""
    _, world = _group_info(group)
    if world == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]


def write_atomically(path: str, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old contents or the new, never a
    part: a temporary file, fsync, ``os.replace``, fsync of the directory."""
    tmp = f"{path}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o644)  # a new file: never another's
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------
# Load: verify the manifest
# ---------------------------------------------------------------------------------------


def has_manifest(checkpoint_dir: str) -> bool:
    """Whether ``checkpoint_dir`` holds a manifest (i.e. was saved completely, with one; one
    that is not a regular file is refused when it is read)."""
    return os.path.lexists(os.path.join(checkpoint_dir, MANIFEST))


def saved_with_manifest(checkpoint_dir: str) -> bool:
    """Whether ``checkpoint_dir`` was saved with a manifest (its :data:`RECORD` says so),
    whether or not the manifest is still there."""
    return os.path.isfile(os.path.join(checkpoint_dir, RECORD))


def record(checkpoint_dir: str) -> Dict[str, object]:
    """What the :data:`RECORD` says (empty when there is none or it is unreadable)."""
    path = os.path.join(checkpoint_dir, RECORD)
    try:
        with bounded(path), open_regular(path, "r") as f:
            value = json.load(f)
    except (OSError, ValueError, CheckpointError):
        return {}
    return value if isinstance(value, dict) else {}


def source_verified(checkpoint_dir: str) -> bool:
    """False when the record says the checkpoint was converted from an unverified source."""
    return bool(record(checkpoint_dir).get("source_verified", True))


def missing_manifest_error(checkpoint_dir: str) -> CheckpointIntegrityError:
    """The refusal of a checkpoint saved with a manifest that is no longer there."""
    return CheckpointIntegrityError(
        f"{checkpoint_dir} was saved with a manifest ({RECORD} says so) but {MANIFEST} is missing: its files "
        "cannot be verified; restore it from a copy of the checkpoint, or if you trust the files, write a new one "
        f"with `python -m megatron_muon.checkpoint.integrity write {checkpoint_dir}`"
    )


def _read_manifest(checkpoint_dir: str) -> dict:
    path = os.path.join(checkpoint_dir, MANIFEST)
    if not os.path.lexists(path) and saved_with_manifest(checkpoint_dir):
        raise missing_manifest_error(checkpoint_dir)
    if not os.path.lexists(path):
        raise CheckpointIntegrityError(
            f"{checkpoint_dir} has no {MANIFEST}: it was not completely saved (the manifest is "
            "written last), or by a tool that writes none; if you trust its files, write one "
            f"with `python -m megatron_muon.checkpoint.integrity write {checkpoint_dir}`."
        )
    try:
        with bounded(path), open_regular(path, "r") as f:
            manifest = json.load(f)
    except CheckpointError as e:
        raise CheckpointIntegrityError(str(e)) from e
    except (OSError, ValueError) as e:
        raise CheckpointIntegrityError(f"{path} is unreadable ({e}); the checkpoint cannot be verified.") from e
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise CheckpointIntegrityError(
            f"{path} is not a manifest (no file -> sha256 table); the checkpoint cannot be verified."
        )
    if not _tables(manifest):
        raise CheckpointIntegrityError(
            f"{path} is not a manifest (its sizes or items are not tables of file -> size, file -> items); the "
            "checkpoint cannot be verified."
        )
    if manifest.get("algorithm", ALGORITHM) != ALGORITHM:
        raise CheckpointIntegrityError(f"{path}: unsupported hash algorithm {manifest.get('algorithm')!r}.")
    if not files:
        raise CheckpointIntegrityError(f"{path} lists no files: it verifies nothing, so the checkpoint is refused.")
    return manifest


def _tables(manifest: dict) -> bool:
    """Whether the manifest's optional ``sizes`` and ``items`` have the shapes
    :func:`write_manifest` writes (file -> bytes; file -> [offset, length, crc32, label]...)."""

    def number(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    def item(value) -> bool:
        return isinstance(value, list) and len(value) == 4 and all(map(number, value[:3])) and isinstance(value[3], str)

    sizes, items = manifest.get("sizes", {}), manifest.get("items", {})
    return (
        isinstance(sizes, dict)
        and all(map(number, sizes.values()))
        and isinstance(items, dict)
        and all(isinstance(v, list) and all(map(item, v)) for v in items.values())
    )


def _listing_problems(checkpoint_dir: str, manifest: dict) -> List[str]:
    """Files the manifest names that are missing or of another size, and entries of the
    directory it does not name (one line each)."""
    problems = []
    sizes = manifest.get("sizes", {})
    present = {entry.name: entry for entry in os.scandir(checkpoint_dir) if entry.name != MANIFEST}
    for name in manifest["files"]:
        entry = present.get(name)
        if entry is None or not os.path.exists(entry.path):
            problems.append(f"{name}: missing")
        elif not entry.is_file():
            problems.append(f"{name}: {file_kind(os.stat(entry.path).st_mode)}, not a regular file")
        elif sizes.get(name) is not None and entry.stat().st_size != sizes[name]:
            problems.append(f"{name}: truncated or extended ({entry.stat().st_size} bytes, saved with {sizes[name]})")
    problems += [
        f"{name}: not in the manifest (added after the save)" for name in sorted(set(present) - set(manifest["files"]))
    ]
    return problems


def _changed_items(path: str, recorded: list, labels: Sequence[str]) -> List[str]:
    """The recorded items of data file ``path`` whose label starts with one of ``labels``
    and whose bytes no longer match their CRC-32."""
    changed = []
    with open_regular(path) as f:
        for offset, length, crc, label in recorded:
            if label.startswith(tuple(labels)):
                f.seek(offset)
                if zlib.crc32(f.read(length)) != crc:
                    changed.append(label)
    return changed


def _check_file(checkpoint_dir: str, name: str, manifest: dict, items: Optional[Sequence[str]]) -> Optional[str]:
    """One line describing how file ``name`` (present, of its size) differs from the
    manifest, or None. With ``items``, a data file is checked only at those items."""
    path = os.path.join(checkpoint_dir, name)
    recorded = manifest.get("items", {}).get(name, [])
    if items is not None and recorded:
        changed = _changed_items(path, recorded, items)
        return f"{name}: contents changed in {', '.join(changed[:3])}" if changed else None
    sha, _, crcs = _hash_file(path, [(o, n, label) for o, n, _, label in recorded])
    if sha == manifest["files"][name]:
        return None
    changed = [label for (_, _, crc, label), now in zip(recorded, crcs) if crc != now]
    where = (
        f" in {', '.join(changed[:3])}" + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
        if changed
        else ""
    )
    return f"{name}: contents changed (sha256 mismatch){where}"


def verify_manifest(
    checkpoint_dir: str,
    group: Optional[dist.ProcessGroup] = None,
    local: bool = False,
    items: Optional[Sequence[str]] = None,
) -> None:
    """Check ``checkpoint_dir`` against its manifest before anything of it is read.

    Every file the manifest names must be there with its size, nothing else may be, and
    every file must hash as saved. Collective over ``group`` (default: all ranks) when
    torch.distributed is initialized: each rank hashes its share of the files, the findings
    are all-gathered, and every rank raises the same :class:`CheckpointIntegrityError`
    naming the files (and, for torch_dist data files, the tensors) that are missing,
    truncated, changed or unlisted. A missing, unreadable or empty manifest fails the same
    way on every rank. ``local=True``: this process checks every file alone (no collective),
    e.g. rank 0 choosing a checkpoint for everyone. ``items``: check the data files only at
    the stored items whose names start so (``("common_state",)``), every other file whole.
    """
    rank, world = (0, 1) if local else _group_info(group)
    problems: List[str] = []
    try:
        manifest = _read_manifest(checkpoint_dir)
    except CheckpointIntegrityError as e:
        manifest, problems = None, [str(e)]
    if manifest is not None:
        problems = _listing_problems(checkpoint_dir, manifest) if rank == 0 else []
        present = {name for name in manifest["files"] if os.path.isfile(os.path.join(checkpoint_dir, name))}
        sizes = manifest.get("sizes") or {}
        for name in _my_share({n: sizes.get(n, 1) for n in manifest["files"] if n in present}, rank, world):
            if name in sizes and os.path.getsize(os.path.join(checkpoint_dir, name)) != sizes[name]:
                continue  # the listing reports it
            problem = _check_file(checkpoint_dir, name, manifest, items)
            if problem:
                problems.append(problem)
    found = sorted({p for part in _all_gather(problems, group, world) for p in part})
    if found:
        if manifest is None:
            raise CheckpointIntegrityError(found[0])
        raise CheckpointIntegrityError(
            f"{checkpoint_dir} is corrupt ({len(found)} of {len(manifest['files'])} files): " + "; ".join(found)
        )


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_muon.checkpoint.integrity", description=__doc__.split("\n")[0]
    )
    parser.add_argument("action", choices=("write", "verify"))
    parser.add_argument("checkpoint_dir")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.checkpoint_dir):
        print(f"error: {args.checkpoint_dir} is not a directory", file=sys.stderr)
        return 2
    try:
        (write_manifest if args.action == "write" else verify_manifest)(args.checkpoint_dir)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{args.action}: {args.checkpoint_dir} OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
