"""The scalars and configuration of an offline W&B run (``WANDB_MODE=offline``), read from its ``run-*.wandb``
file: a record log in LevelDB's framing (a 7-byte file header, then 32 KiB blocks of records,
each a 7-byte header - checksum, length, kind - and a piece of one protobuf ``Record``).
W&B has no public reader of offline runs; this reads only what the suite checks."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Dict, List

BLOCK = 32768
FILE_HEADER = 7  # ":W&B", a magic number, a version
RECORD_HEADER = struct.Struct("<IHB")  # checksum, length, kind
FULL, LAST = 1, 4  # the kinds that end a record (FIRST and MIDDLE continue it)


def records(path: Path) -> List[object]:
    """Every protobuf ``Record`` of the file, in order."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending, out = path.read_bytes(), FILE_HEADER, b"", []
    while pos + RECORD_HEADER.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < RECORD_HEADER.size:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = RECORD_HEADER.unpack_from(data, pos)
        if length == 0 and kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        pending += data[pos + RECORD_HEADER.size : pos + RECORD_HEADER.size + length]
        pos += RECORD_HEADER.size + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def scalars(directory: Path) -> Dict[str, List[float]]:
    """``{key: [value at each logged step]}`` of the one offline run under ``directory``
    (``--wandb-save-dir``)."""
    (run,) = list(directory.glob("wandb/offline-run-*/run-*.wandb"))
    out: Dict[str, List[float]] = {}
    for record in records(run):
        if record.WhichOneof("record_type") != "history":
            continue
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            if not key.startswith("_"):  # W&B's own (_step, _runtime, _timestamp)
                out.setdefault(key, []).append(json.loads(item.value_json))
    return out


def config(directory: Path) -> Dict[str, object]:
    """The run configuration (``wandb.init(config=...)``, updates applied in order) of the one
    offline run under ``directory``."""
    (run,) = list(directory.glob("wandb/offline-run-*/run-*.wandb"))
    out: Dict[str, object] = {}
    for record in records(run):
        kind = record.WhichOneof("record_type")
        if kind in ("run", "config"):  # the run record holds the initial configuration
            for item in (record.run.config if kind == "run" else record.config).update:
                out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out
