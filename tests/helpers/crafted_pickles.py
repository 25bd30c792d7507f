"""Pickles an attacker writes by hand, opcode by opcode (Python's pickler would hash a set
of a deep DAG before it wrote it, and never emits BUILD on a class): shared by the unit
tests of the unpickler and the end-to-end attacks on whole checkpoints."""

from __future__ import annotations

import pickle
import struct

MEMO_BASE = 1_000_000
"""Memo slots of the crafted parts, far above those of a pickle they are spliced into."""


def put(index: int) -> bytes:
    return pickle.LONG_BINPUT + struct.pack("<I", index)


def get(index: int) -> bytes:
    return pickle.LONG_BINGET + struct.pack("<I", index)


def text(value: str) -> bytes:
    raw = value.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw


def global_(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def tuple_dag(levels: int, base: int = MEMO_BASE) -> bytes:
    """Pushes t_levels, t_i = (t_{i-1}, t_{i-1}), t_0 = (): 2**levels leaves, in a few bytes
    per level; hashing or printing it visits every leaf."""
    out = [pickle.EMPTY_TUPLE, put(base)]
    for i in range(1, levels + 1):
        out += [get(base + i - 1), get(base + i - 1), pickle.TUPLE2, put(base + i)]
    return b"".join(out)


def list_dag(levels: int, base: int = MEMO_BASE) -> bytes:
    """Pushes l_levels, l_i = [l_{i-1}, l_{i-1}], each list complete before it is shared (as
    Python's own pickler writes ``l = [l, l]`` repeated)."""
    out = [pickle.EMPTY_LIST, put(base)]
    for i in range(1, levels + 1):
        out += [pickle.EMPTY_LIST, put(base + i), pickle.MARK, get(base + i - 1), get(base + i - 1), pickle.APPENDS]
    return b"".join(out)


def set_of(body: bytes) -> bytes:
    """Pushes a set of what ``body`` pushes (protocol 4's EMPTY_SET / ADDITEMS)."""
    return pickle.EMPTY_SET + pickle.MARK + body + pickle.ADDITEMS


def whole(body: bytes) -> bytes:
    """A complete pickle of what ``body`` pushes."""
    return pickle.PROTO + bytes([4]) + body + pickle.STOP


def build_on_global(module: str, name: str, attribute: str, value: str) -> bytes:
    """Pushes the global ``module.name`` after BUILD with the slot state ``{attribute:
    value}``: ``setattr(module.name, attribute, value)`` in an unpickler that lets it."""
    state = pickle.NONE + pickle.EMPTY_DICT + text(attribute) + text(value) + pickle.SETITEM + pickle.TUPLE2
    return global_(module, name) + state + pickle.BUILD


def splice(pickled: bytes, placeholder: str, body: bytes) -> bytes:
    """``pickled`` (protocol 2: no frames to resize) with the string ``placeholder`` it holds
    replaced by what ``body`` pushes."""
    raw = placeholder.encode()
    for opcode in (pickle.BINUNICODE + struct.pack("<I", len(raw)), pickle.SHORT_BINUNICODE + bytes([len(raw)])):
        if opcode + raw in pickled:
            return pickled.replace(opcode + raw, body, 1)
    raise ValueError(f"{placeholder!r} is not in the pickle")
