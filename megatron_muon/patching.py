"""The one way megatron_muon replaces an attribute of Megatron's (or torch's) code.

A :class:`Patch` declares one replacement: the attribute (``target`` module, or
``module:Class``, and ``attribute``), the function that builds the replacement from what it
replaces (``replacement``, ``"module:function"``, called as ``build(original, context)``),
why it exists, and the megatron-core or torch version it was read in. ``megatron_lm/patches.py``
holds the table of every one, with the signature (and, where the replacement restates part
of the original, a fingerprint of its source) each was written against, which
:func:`mismatch` checks (``tests/unit/test_patches.py``).

:func:`install` and :func:`scoped` are the only code that assigns them. Each attribute keeps
Megatron's own value and the rows that are in force on it; its value is always Megatron's
wrapped by those rows in the order of their ``stack`` (lowest nearest Megatron's), however
they were installed and undone, and with no row left it is Megatron's own object again.
A row in force through two layers (a job-wide install and a scope inside it) is applied
once, with the context of the layer that installed it first.

Installing the same rows on the same owners again returns the layer already in force
(idempotent); :func:`scoped` nests, reference-counted, and leaves in force what an
:func:`install` holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import inspect
import re
import threading
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

__all__ = ["Patch", "Layer", "install", "scoped", "installed", "original", "mismatch", "fingerprint", "KEEP", "MISSING"]


class _Sentinel:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


MISSING = _Sentinel("MISSING")
"""The original of an attribute the owner does not have."""
KEEP = _Sentinel("KEEP")
"""What a builder returns to leave the attribute as it is (the patch does not apply here)."""


@dataclasses.dataclass(frozen=True)
class Patch:
    """One declared replacement (see the module docstring)."""

    target: str
    """The owner: a module (``megatron.training.arguments``) or ``module:Class``."""
    attribute: str
    replacement: str
    """``"module:function"``: ``function(original, context)`` returns the new value (or :data:`KEEP`)."""
    why: str
    checked: str
    """``megatron-core 0.19.2`` or ``torch 2.11.0``: what the target was read in."""
    cpu_only: bool = False
    """Installed only on the CPU path (``megatron_lm.cpu``): a GPU run installs none of these."""
    stack: int = 0
    """Position among the patches of one attribute: a lower one sits nearer Megatron's value."""
    adds: bool = False
    """The attribute may be missing (the replacement adds it); else a missing one is left alone."""
    builds: bool = True
    """``replacement`` names a builder; False: it names the new value itself (a CPU stand-in)."""

    @property
    def name(self) -> str:
        return f"{self.target}.{self.attribute} <- {self.replacement}"

    def owner(self) -> Any:
        module, _, cls = self.target.partition(":")
        owner = importlib.import_module(module)
        for part in filter(None, cls.split(".")):
            owner = getattr(owner, part)
        return owner

    def resolve(self) -> Any:
        """The object ``replacement`` names."""
        module, _, name = self.replacement.partition(":")
        return getattr(importlib.import_module(module), name)

    def build(self, original: Any, context: Any) -> Any:
        """The value this patch puts over ``original`` (or :data:`KEEP`)."""
        return self.resolve()(original, context) if self.builds else self.resolve()


def fingerprint(value: Any) -> str:
    """The first 16 hex digits of the SHA-256 of ``value``'s source (``inspect.getsource``)."""
    return hashlib.sha256(inspect.getsource(value).encode()).hexdigest()[:16]


def signature_text(value: Any) -> str:
    """``str(inspect.signature(value))`` without object addresses (a default's repr may hold one)."""
    return re.sub(r" at 0x[0-9a-f]+", "", str(inspect.signature(value)))


def _raw(owner: Any, attribute: str) -> Any:
    """What restoring ``owner.attribute`` must put back: a class's own ``__dict__`` entry (a
    staticmethod stays one; an inherited attribute is :data:`MISSING`: deleted again)."""
    if isinstance(owner, type):
        return owner.__dict__.get(attribute, MISSING)
    return getattr(owner, attribute, MISSING)


class _Slot:
    """One attribute of one owner while any patch is in force on it."""

    def __init__(self, owner: Any, attribute: str) -> None:
        self.owner, self.attribute = owner, attribute
        self.raw = _raw(owner, attribute)
        self.value = getattr(owner, attribute, MISSING)
        self.holders: Dict[Patch, List["Layer"]] = {}

    def refresh(self) -> None:
        """Set the attribute to Megatron's value wrapped by the patches in force, in stack order."""
        value = self.value
        for patch in sorted(self.holders, key=lambda p: p.stack):
            layer = self.holders[patch][0]
            built = layer.built_on(patch, value)
            if built is not KEEP:
                value = built
                if patch.builds:  # a function made for this layer: it names the undo
                    with contextlib.suppress(AttributeError, TypeError):
                        built.__megatron_muon_undo__ = layer.undo
        if value is MISSING or (not self.holders and self.raw is MISSING):
            with contextlib.suppress(AttributeError):
                delattr(self.owner, self.attribute)
        elif not self.holders:
            setattr(self.owner, self.attribute, self.raw)
        else:
            setattr(self.owner, self.attribute, value)


_lock = threading.RLock()
_slots: Dict[Tuple[int, str], _Slot] = {}
_layers: Dict[tuple, "Layer"] = {}


class Layer:
    """Rows installed together with one context; ``undo`` (a stable function) removes them."""

    def __init__(self, key: tuple, patches: Sequence[Patch], context: Any, owners: Mapping[str, Any]) -> None:
        self.key, self.patches, self.context, self.owners = key, tuple(patches), context, dict(owners)
        self.held = False
        self.depth = 0
        self.slots: List[Tuple[Patch, _Slot]] = []
        # What each row built on what it wrapped: a slot rebuilt when another layer comes or
        # goes wraps the same value again and gets the same function back, so a layer's
        # departure restores the functions in force before it by identity.
        self._built: Dict[Tuple[Patch, int], Tuple[Any, Any]] = {}

        def undo() -> None:
            """Remove this layer's patches (a no-op once removed)."""
            with _lock:
                self.held = False
                if self.depth == 0 and _layers.get(self.key) is self:
                    self._remove()

        self.undo = undo

    def built_on(self, patch: Patch, value: Any) -> Any:
        """``patch``'s replacement for ``value`` in this layer (built once per ``value``)."""
        kept = self._built.get((patch, id(value)))
        if kept is None or kept[0] is not value:
            kept = self._built[(patch, id(value))] = (value, patch.build(value, self.context))
        return kept[1]

    @property
    def active(self) -> bool:
        return bool(self.slots)

    def _add(self) -> None:
        touched = []
        for patch in self.patches:
            owner = self.owners.get(patch.target, MISSING)
            if owner is MISSING:
                owner = patch.owner()
            if owner is None or (not patch.adds and not hasattr(owner, patch.attribute)):
                continue
            slot = _slots.get((id(owner), patch.attribute))
            if slot is None:
                slot = _slots[(id(owner), patch.attribute)] = _Slot(owner, patch.attribute)
            slot.holders.setdefault(patch, []).append(self)
            self.slots.append((patch, slot))
            touched.append(slot)
        for slot in dict.fromkeys(touched):
            slot.refresh()
        _layers[self.key] = self

    def _remove(self) -> None:
        touched = []
        for patch, slot in self.slots:
            holders = slot.holders[patch]
            holders.remove(self)
            if not holders:
                del slot.holders[patch]
            touched.append(slot)
        self.slots = []
        for slot in dict.fromkeys(touched):
            slot.refresh()
            if not slot.holders:
                _slots.pop((id(slot.owner), slot.attribute), None)
        _layers.pop(self.key, None)


def _layer_in_force(patches: Sequence[Patch], context: Any, owners: Optional[Mapping[str, Any]]) -> Layer:
    """The layer of ``patches`` on ``owners`` in force, else a new one put in force (under ``_lock``)."""
    owners = dict(owners or {})
    key = tuple(patches), tuple(sorted((t, id(o)) for t, o in owners.items()))
    layer = _layers.get(key)
    if layer is None:
        layer = Layer(key, patches, context, owners)
        layer._add()
    return layer


def install(patches: Sequence[Patch], context: Any = None, owners: Optional[Mapping[str, Any]] = None) -> Layer:
    """Put ``patches`` in force until the returned layer's ``undo``; the same rows on the same
    ``owners`` again return the layer in force. ``owners`` maps a row's ``target`` to the
    object to patch instead (a stand-in module), or to None to skip those rows."""
    with _lock:
        layer = _layer_in_force(patches, context, owners)
        layer.held = True
        return layer


@contextlib.contextmanager
def scoped(
    patches: Sequence[Patch], context: Any = None, owners: Optional[Mapping[str, Any]] = None
) -> Iterator[Layer]:
    """``patches`` in force inside the block (reentrant; what an :func:`install` of the same
    rows holds stays in force after it)."""
    with _lock:
        layer = _layer_in_force(patches, context, owners)
        layer.depth += 1
    try:
        yield layer
    finally:
        with _lock:
            layer.depth -= 1
            if layer.depth == 0 and not layer.held:
                layer._remove()


def installed(patch: Patch, owner: Any = None) -> bool:
    """Whether ``patch`` is in force (on ``owner``, default its target)."""
    owner = patch.owner() if owner is None else owner
    slot = _slots.get((id(owner), patch.attribute))
    return slot is not None and patch in slot.holders


def original(patch: Patch, owner: Any = None) -> Any:
    """Megatron's own value of ``patch``'s attribute, whatever is in force on it now."""
    owner = patch.owner() if owner is None else owner
    slot = _slots.get((id(owner), patch.attribute))
    return slot.value if slot is not None else getattr(owner, patch.attribute, MISSING)


def mismatch(patch: Patch, signature: Optional[str] = None, source: Optional[str] = None) -> Optional[str]:
    """Why ``patch`` no longer fits the installed code, naming the patch and the reason it
    exists: its target missing, its signature not ``signature`` (``str(inspect.signature)``),
    its source's :func:`fingerprint` not ``source`` (None: not checked); None when it fits."""
    where = f"patch {patch.name} (checked against {patch.checked}; it exists because: {patch.why})"
    try:
        owner = patch.owner()
        patch.resolve()
    except (ImportError, AttributeError) as e:
        return f"{where}: {e}"
    value = original(patch, owner)
    if value is MISSING:
        return None if patch.adds else f"{where}: {patch.target} has no attribute {patch.attribute!r}"
    if signature is not None:
        try:
            found = signature_text(value)
        except (TypeError, ValueError) as e:
            found = f"<no signature: {e}>"
        if found != signature:
            return f"{where}: the signature is now {found}, it was written against {signature}"
    if source is not None and fingerprint(value) != source:
        return f"{where}: the source it restates changed (fingerprint {fingerprint(value)}, was {source})"
    return None
