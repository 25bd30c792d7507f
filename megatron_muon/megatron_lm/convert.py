"""Checkpoint conversion: Megatron AdamW <-> Muon, expert layouts, and a readable summary.

Works on whole torch_dist checkpoints in one process: every tensor is read at its full
global shape, transformed by key, and written back with Megatron's own
``dist_checkpointing.save``, so the result loads into any parallel layout. An AdamW
source in Megatron-LM's default optimizer format (DDP buckets, not parameters) is first
re-saved fully reshardable by Megatron-LM itself, with the run's own arguments
(:mod:`.resave`). Megatron-FSDP's fsdp_dtensor checkpoints are read into and written from
the same in-memory form by :mod:`.convert_fsdp` (which builds the model on the meta device
to learn torch_dist's layout), so ``adam-to-muon`` / ``muon-to-adam`` take either format
and ``to-torch-dist`` / ``to-fsdp-dtensor`` move a Muon run between them.

Megatron-LM's layout on both sides: the source is a checkpoint directory (``--save`` of
``tools/pretrain_gpt.py``, whose ``latest_checkpointed_iteration.txt`` names the iteration)
or one ``iter_XXXXXXX`` directory; the destination is a checkpoint directory that receives
``iter_XXXXXXX`` (same iteration) and the tracker file, so ``--load DST`` resumes from it.
The common state (arguments, iteration, scheduler, RNG, rerun state) is kept; only the
optimizer's part and ``args.optimizer`` change.

Nothing it did not create is deleted or overwritten: an existing destination iteration is
refused unless ``--overwrite``; the source can never be the destination, inside it or its
parent; the output is written into a temporary directory and renamed into place, then the
tracker is replaced atomically, so a conversion killed at any point leaves every earlier
checkpoint loadable (and at worst a ``*.tmp-*`` directory to remove).

Key conventions (both Megatron's ``fully_reshardable`` distributed optimizer and ours):
model tensors under their model key; optimizer state under
``optimizer.state.<state>.<model key>`` with ``<state>`` in ``param`` (fp32 master),
``exp_avg`` / ``exp_avg_sq`` (AdamW) and ``momentum_buffer`` (Muon), plus ``second_moment``
(Muon with variance reduction: the factored second moment expanded to the parameter's
shape). Converting to Muon writes no second moments: a Muon run with variance reduction
that loads such a checkpoint starts them at zero, as a fresh run does.
"""

from __future__ import annotations

import copy
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from megatron_muon.checkpoint import (
    _READ_ERRORS,
    FORMAT,
    STATE_PREFIX,
    CheckpointError,
    common_state,
    read_common,
    swap_into_place,
)
from megatron_muon.checkpoint import state_key as _state_key
from megatron_muon.integrity import (
    MANIFEST,
    CheckpointIntegrityError,
    has_manifest,
    missing_manifest_error,
    saved_with_manifest,
    verify_manifest,
    write_atomically,
    write_manifest,
)
from megatron_muon.matrices import is_muon_matrix
from megatron_muon.megatron_lm.checkpoint_guards import TRACKER, read_tracker
from megatron_muon.state import MOMENTUM, MUON_STATES

_SHARD = re.compile(r"^(?P<key>.+)/shard_(?P<offset>[\d.]+)_(?P<shape>[\d.]+)$")


@dataclass
class Checkpoint:
    """A whole torch_dist checkpoint in memory."""

    tensors: Dict[str, torch.Tensor] = field(default_factory=dict)
    objects: Dict[Tuple[str, Tuple[int, ...], Tuple[int, ...]], Any] = field(default_factory=dict)
    """(key, global offset, global shape) -> object (e.g. layers' ``_extra_state``)."""
    common: Dict[str, Any] = field(default_factory=dict)
    group_meta: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    """Read from an fsdp_dtensor checkpoint: parameter name -> its optimizer group's settings."""


def _ensure_process_group() -> None:
    """A one-rank gloo group (Megatron's checkpoint I/O is collective), on the CPU if no GPU.

    Its store lives in this process (no port, no ``MASTER_*`` variables set for the caller)."""
    import torch.distributed as dist

    from .cpu import install_cpu_patches

    if not torch.cuda.is_available():
        install_cpu_patches()
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _read_metadata(path: str):
    """torch.distributed.checkpoint's metadata of ``path`` (every tensor's global shape)."""
    from torch.distributed.checkpoint import FileSystemReader

    _ensure_process_group()
    try:
        return FileSystemReader(path).read_metadata()
    except _READ_ERRORS as e:
        raise CheckpointError(f"{path} is not a torch_dist or fsdp_dtensor checkpoint ({e})") from e


def check_source(path: str, unverified: bool = False) -> bool:
    """Verify ``path`` against its manifest; returns whether it was verified. A checkpoint
    without one is refused (one saved with a manifest that is gone, always; one saved
    without, e.g. by plain Megatron-LM, unless ``unverified``)."""
    if has_manifest(path):
        verify_manifest(path)
        return True
    if saved_with_manifest(path):
        raise missing_manifest_error(path)
    if not unverified:
        raise CheckpointError(
            f"{path} has no {MANIFEST} (saved without megatron_muon), so its files cannot be verified: pass "
            "--unverified-source to convert it anyway (the result is labelled as converted from an unverified source)"
        )
    return False


def read_checkpoint(path: str) -> Checkpoint:
    """Every tensor (full global shape), sharded object and the common state of ``path``
    (verified first when it has a manifest)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = _read_metadata(path)
    if has_manifest(path):
        verify_manifest(path)
    request: Dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            request[key] = ShardedTensor.from_rank_offsets(
                key, torch.empty(md.size, dtype=md.properties.dtype), replica_id=0
            )
        elif key.startswith("common_state"):
            continue
        else:
            m = _SHARD.match(key)
            if m is None:
                continue
            offset = tuple(int(x) for x in m["offset"].split("."))
            shape = tuple(int(x) for x in m["shape"].split("."))
            request[key] = ShardedObject(m["key"], None, shape, offset, replica_id=0)
    try:
        loaded = dist_checkpointing.load(request, path)
    except _READ_ERRORS as e:
        raise CheckpointError(f"{path} could not be read (truncated or corrupt?): {e}") from e
    ckpt = Checkpoint(common=dist_checkpointing.load_common_state_dict(path))
    for key, req in request.items():
        if isinstance(req, ShardedTensor):
            ckpt.tensors[key] = loaded[key]
        else:
            ckpt.objects[(req.key, req.global_offset, req.global_shape)] = loaded[key]
    return ckpt


def write_checkpoint(path: str, ckpt: Checkpoint, source_verified: bool = True) -> None:
    """Write ``ckpt`` as a torch_dist checkpoint into the new, empty directory ``path``."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    _ensure_process_group()
    state: Dict[str, Any] = dict(ckpt.common)
    sharded = {
        key: ShardedTensor.from_rank_offsets(key, t.contiguous(), replica_id=0) for key, t in ckpt.tensors.items()
    }
    objects = {
        f"{key}/{offset}": ShardedObject(key, value, shape, offset, replica_id=0)
        for (key, offset, shape), value in ckpt.objects.items()
    }
    state["__tensors__"] = sharded
    state["__objects__"] = objects
    os.makedirs(path, exist_ok=False)
    dist_checkpointing.save(state, path)
    # Written last, so a converter killed mid-write leaves a directory no loader accepts.
    write_manifest(path, source_verified=source_verified)


# ---------------------------------------------------------------------------------------
# Megatron-LM's checkpoint directory layout, and writing without losing anything
# ---------------------------------------------------------------------------------------


def iteration_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def resolve_source(src: str) -> str:
    """The checkpoint directory ``src`` names: itself, or the iteration its tracker names."""
    tracker = os.path.join(src, TRACKER)
    if os.path.isfile(tracker):
        latest = read_tracker(src)
        if latest is None:
            raise CheckpointError(f"{tracker} is empty or unreadable: give the iter_XXXXXXX directory to convert")
        path = os.path.join(src, "release" if latest == "release" else iteration_dir_name(int(latest)))
        if not os.path.isdir(path):
            raise CheckpointError(f"{tracker} names iteration {latest}, but {path} does not exist")
        return path
    if not os.path.isfile(os.path.join(src, ".metadata")):
        raise CheckpointError(
            f"{src} is neither a checkpoint directory (no {TRACKER}) nor a torch_dist or fsdp_dtensor "
            "checkpoint (no .metadata); give the --save directory or one iter_XXXXXXX in it"
        )
    return src


def checkpoint_iteration(ckpt: Checkpoint) -> int:
    """The training iteration a checkpoint was saved at (Megatron-LM's ``iteration``)."""
    value = ckpt.common.get("iteration", ckpt.common.get("extra", {}).get("iteration", 0))
    return int(value)


def check_paths(src: str, dst: str) -> None:
    """The source is never the destination, inside it, or its parent (nor the reverse)."""
    a, b = os.path.realpath(src), os.path.realpath(dst)
    if a == b or a.startswith(b + os.sep) or b.startswith(a + os.sep):
        raise CheckpointError(
            f"the destination {dst} {'is' if a == b else 'contains' if a.startswith(b + os.sep) else 'is inside'} "
            f"the source {src}; write the converted checkpoint to a separate directory"
        )


def check_destination(dst: str, iteration: int, overwrite: bool) -> None:
    """Without ``overwrite``, an existing ``dst`` may neither hold ``iteration`` already nor
    track a later one (its tracker would move back)."""
    final = os.path.join(dst, iteration_dir_name(iteration))
    if os.path.exists(final) and not overwrite:
        raise CheckpointError(f"{final} already exists; pass --overwrite to replace it, or choose another destination")
    tracked = read_tracker(dst) if os.path.isdir(dst) else None
    if tracked is not None and tracked.isdigit() and int(tracked) > iteration and not overwrite:
        raise CheckpointError(
            f"{os.path.join(dst, TRACKER)} names iteration {tracked}, later than the converted {iteration}: --load "
            f"{dst} would no longer resume from {tracked}; choose another destination, or pass --overwrite to point "
            f"it at {iteration} ({iteration_dir_name(int(tracked))} is kept)"
        )


def publish(
    dst: str,
    iteration: int,
    ckpt: Checkpoint,
    overwrite: bool = False,
    source_verified: bool = True,
    writer: Optional[Callable[[str, Checkpoint, bool], None]] = None,
) -> str:
    """Write ``ckpt`` as ``dst/iter_XXXXXXX`` plus the tracker; returns the iteration directory.

    A new ``dst`` is built complete under a temporary name and renamed into place. Into an
    existing ``dst`` the iteration is written under a temporary name and swapped in
    (``swap_into_place``; an existing one only with ``overwrite``), then the tracker is
    replaced atomically; a tracker naming a later iteration is moved back only with
    ``overwrite``. Nothing else in ``dst`` is touched. ``writer`` writes the iteration
    directory (default :func:`write_checkpoint`, torch_dist).
    """
    writer = writer or write_checkpoint
    name = iteration_dir_name(iteration)
    final = os.path.join(dst, name)
    if not os.path.exists(dst):
        parent = os.path.dirname(os.path.abspath(dst))
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=os.path.basename(dst) + ".tmp-", dir=parent)
        writer(os.path.join(staging, name), ckpt, source_verified)
        _write_tracker(staging, iteration)
        os.rename(staging, dst)
        return final
    check_destination(dst, iteration, overwrite)
    staging = tempfile.mkdtemp(prefix=name + ".tmp-", dir=dst)
    writer(os.path.join(staging, name), ckpt, source_verified)
    swap_into_place(os.path.join(staging, name), final)
    os.rmdir(staging)
    _write_tracker(dst, iteration)
    return final


def _write_tracker(directory: str, iteration: int) -> None:
    write_atomically(os.path.join(directory, TRACKER), str(iteration))


def _retarget_args(ckpt: Checkpoint, optimizer: str) -> None:
    """Megatron-LM's saved arguments say which optimizer wrote the state: the converted one."""
    args = ckpt.common.get("args")
    if args is not None and hasattr(args, "optimizer"):
        args = copy.copy(args)
        args.optimizer = optimizer
        ckpt.common["args"] = args


def model_keys(ckpt: Checkpoint) -> List[str]:
    """Model tensor keys that have an fp32 master in the optimizer state."""
    prefix = _state_key("param", "")
    return sorted(k[len(prefix) :] for k in ckpt.tensors if k.startswith(prefix))


_LINEAR_WEIGHT = re.compile(r"(^|\.)(linear_\w+\.weight\d*|weight[12]|router\.weight)$")
"""Keys of the weight matrices of Megatron's GPT layers (linear layers, grouped and legacy
fused experts, the router). A checkpoint stacks layers and experts into extra dims, so a
key's tensor rank does not say whether each parameter is a matrix; its name does."""


def is_muon_key(key: str, exclude: Iterable[str] = (), router: bool = False) -> bool:
    """Which model tensors Muon optimizes, from their checkpoint key (no model at hand):
    ``matrices.is_muon_matrix`` with the rank and role read off Megatron's GPT names."""
    role = (
        "embedding"
        if "embedding" in key or key.startswith("output_layer")
        else "router"
        if key.endswith("router.weight")
        else "weight"
    )
    return is_muon_matrix(key, 2 if _LINEAR_WEIGHT.search(key) else 1, role, tuple(exclude), router)


def adam_to_muon(
    src: str,
    dst: str,
    momentum: str = "zeros",
    exclude: Iterable[str] = (),
    router: bool = False,
    overwrite: bool = False,
    unverified_source: bool = False,
) -> Dict[str, int]:
    """Megatron DistributedOptimizer (AdamW) -> Muon checkpoint. Megatron-LM's default
    format (DDP buckets) is first re-saved fully reshardable by Megatron-LM (:mod:`.resave`).

    Weights and fp32 masters are kept; Muon matrices get a ``momentum_buffer`` (zeros, or
    ``exp_avg`` with ``momentum='exp_avg'``) instead of their AdamW moments; the scalar
    parameters keep their AdamW state."""
    from .convert_fsdp import fsdp_common, is_fsdp_dtensor, read_fsdp_dtensor, write_fsdp_dtensor

    check_paths(src, dst)
    source = resolve_source(src)
    verified = check_source(source, unverified_source)
    fsdp = is_fsdp_dtensor(source)
    common = fsdp_common(source) if fsdp else read_common(source)
    iteration = checkpoint_iteration(Checkpoint(common=common))
    check_destination(dst, iteration, overwrite)
    opt_common = common.get("optimizer", {})
    if opt_common.get("format") == FORMAT:
        raise CheckpointError(f"{source} already holds Muon optimizer state (muon-to-adam converts it to AdamW).")
    if "param_state_sharding_type" not in opt_common:
        raise CheckpointError(f"{source} holds no Megatron distributed-optimizer state (saved with --no-save-optim?)")
    if fsdp:  # Megatron-FSDP's format is parameter by parameter already
        ckpt = read_fsdp_dtensor(source, adam=True)
    elif opt_common["param_state_sharding_type"] == "fully_reshardable":
        ckpt = read_checkpoint(source)
    else:  # Megatron-LM's default (DDP buckets): Megatron-LM re-saves it parameter by parameter
        ckpt = _read_resaved(source, iteration, common, dst)
    opt_common = ckpt.common.get("optimizer", {})
    groups = opt_common.get("optimizer", {}).get("param_groups", [])
    step = int(max((g.get("step", 0) for g in groups), default=0))
    if iteration and step > iteration:
        # At most one optimizer step per iteration. torch's AdamW under Megatron-core 0.19.2
        # (no TE / Apex) counted a step once per parameter after a resume (fixed in our CPU
        # patches); such a checkpoint's step is not the number of updates.
        print(f"warning: the checkpoint's AdamW step {step} exceeds its iteration {iteration}; using {iteration}")
        step = iteration
    converted = 0
    for key in model_keys(ckpt):
        if not is_muon_key(key, exclude, router):
            continue
        exp_avg = ckpt.tensors.pop(_state_key("exp_avg", key))
        ckpt.tensors.pop(_state_key("exp_avg_sq", key))
        ckpt.tensors[_state_key(MOMENTUM, key)] = (
            exp_avg.clone() if momentum == "exp_avg" else torch.zeros_like(exp_avg)
        )
        converted += 1
    dense = {"grad_scaler": opt_common.get("grad_scaler"), "param_groups": groups}
    ckpt.common["optimizer"] = dict(common_state(step, {"dense": dense}, {}), converted_from="megatron_adam")
    _retarget_args(ckpt, "muon")
    writer = write_fsdp_dtensor if fsdp else None
    written = publish(dst, iteration, ckpt, overwrite, source_verified=verified, writer=writer)
    return {"muon_matrices": converted, "scalar": len(model_keys(ckpt)) - converted, "step": step, "wrote": written}


def _read_resaved(source: str, iteration: int, common: Dict[str, Any], dst: str) -> Checkpoint:
    """``source`` (Megatron-LM's default distributed-optimizer format, at ``iteration``) re-saved fully
    reshardable by Megatron-LM (:mod:`.resave`) into a directory beside ``dst`` that is
    removed afterwards, and read; its common state stays the source's."""
    import shutil

    from .resave import resave_fully_reshardable

    if not hasattr(common.get("args"), "world_size"):
        raise CheckpointError(
            f"{source} does not hold its run's arguments, which the re-save needs (saved by Megatron-LM?)"
        )
    parent = os.path.dirname(os.path.abspath(dst))
    os.makedirs(parent, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=os.path.basename(os.path.abspath(dst)) + ".resave-", dir=parent)
    try:
        ckpt = read_checkpoint(resave_fully_reshardable(os.path.dirname(source), iteration, common["args"], scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    ckpt.common = dict(common, optimizer=ckpt.common["optimizer"])
    return ckpt


def muon_to_adam(
    src: str,
    dst: str,
    exp_avg: str = "zeros",
    beta1: float = 0.9,
    overwrite: bool = False,
    unverified_source: bool = False,
) -> Dict[str, int]:
    """Muon checkpoint -> Megatron DistributedOptimizer (AdamW, ``fully_reshardable``).

    ``exp_avg`` of former Muon matrices is zero, or ``(1 - beta1) * momentum`` with
    ``exp_avg='momentum'`` (Muon's momentum is a plain sum, AdamW's an average);
    ``exp_avg_sq`` is zero (printed as a warning: AdamW's first steps then take
    sign-like updates of size lr)."""
    from .convert_fsdp import fsdp_common, is_fsdp_dtensor, read_fsdp_dtensor, write_fsdp_dtensor

    check_paths(src, dst)
    source = resolve_source(src)
    verified = check_source(source, unverified_source)
    fsdp = is_fsdp_dtensor(source)
    common = fsdp_common(source) if fsdp else read_common(source)
    check_destination(dst, checkpoint_iteration(Checkpoint(common=common)), overwrite)
    ckpt = read_fsdp_dtensor(source) if fsdp else read_checkpoint(source)
    opt_common = ckpt.common.get("optimizer", {})
    if opt_common.get("format") != FORMAT:
        raise CheckpointError(
            f"{source} holds no Muon optimizer state (format {opt_common.get('format')!r}); "
            "an AdamW checkpoint converts to Muon with adam-to-muon."
        )
    converted = 0
    for key in model_keys(ckpt):
        states = {s.name: ckpt.tensors.pop(_state_key(s.name, key), None) for s in MUON_STATES}
        m = states[MOMENTUM]
        if m is None:
            continue
        ckpt.tensors[_state_key("exp_avg", key)] = (1 - beta1) * m if exp_avg == "momentum" else torch.zeros_like(m)
        ckpt.tensors[_state_key("exp_avg_sq", key)] = torch.zeros_like(m)
        converted += 1
    print(
        f"warning: exp_avg_sq of {converted} former Muon matrices is zero; AdamW's first updates "
        "of those parameters will be about lr in size per element."
    )
    step = int(opt_common.get("step", 0))
    groups = []
    for common in opt_common.get("optimizers", {}).values():
        for group in common.get("param_groups", []):
            group = {k: v for k, v in group.items() if k not in ("params", "muon")}
            group["step"] = float(step)
            if group not in groups:
                groups.append(group)
    dense = opt_common.get("optimizers", {}).get("dense", {})
    ckpt.common["optimizer"] = {
        "optimizer": {"param_groups": groups},
        "param_state_sharding_type": "fully_reshardable",
    }
    if dense.get("grad_scaler") is not None:
        ckpt.common["optimizer"]["grad_scaler"] = dense["grad_scaler"]
    if isinstance(ckpt.common.get("content_metadata"), dict):  # Megatron-LM loads by this label
        ckpt.common["content_metadata"] = dict(
            ckpt.common["content_metadata"], distrib_optim_sharding_type="fully_reshardable"
        )
    _retarget_args(ckpt, "adam")
    writer = write_fsdp_dtensor if fsdp else None
    written = publish(dst, checkpoint_iteration(ckpt), ckpt, overwrite, source_verified=verified, writer=writer)
    return {"converted": converted, "step": step, "wrote": written}


def inspect(path: str) -> str:
    """A readable summary of a checkpoint."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .convert_fsdp import fsdp_common, is_fsdp_dtensor

    path = resolve_source(path)
    metadata = _read_metadata(path)
    fsdp = is_fsdp_dtensor(path)
    common = fsdp_common(path) if fsdp else dist_checkpointing.load_common_state_dict(path)
    opt = common.get("optimizer", {}) if isinstance(common.get("optimizer"), dict) else {}
    kind = (
        "muon"
        if opt.get("format") == FORMAT
        else (f"megatron {opt.get('param_state_sharding_type')}" if opt else "model only")
    )
    lines = [f"checkpoint: {path}", f"optimizer: {kind}"]
    if "iteration" in common:
        lines.append(f"iteration: {common['iteration']}")
    extra = common.get("extra", {})
    for key in ("iteration", "layout", "args"):
        if key in extra:
            lines.append(f"{key}: {extra[key]}")
    if opt.get("format") == FORMAT:
        lines.append(f"optimizer steps: {opt.get('step')}")
        cfg = opt.get("muon_config", {})
        if cfg:
            lines.append("muon settings: " + ", ".join(f"{k}={v}" for k, v in sorted(cfg.items())))
    tensors = {k: md for k, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
    by_state: Dict[str, int] = {}
    total = 0
    for key, md in tensors.items():
        if key.startswith("rng_state"):
            continue  # an fsdp_dtensor checkpoint's generator states (objects in torch_dist)
        numel = 1
        for s in md.size:
            numel *= s
        total += numel * md.properties.dtype.itemsize
        group = "model"
        if key.startswith(STATE_PREFIX):
            group = key.rsplit(".", 1)[1] if fsdp else key.split(".")[2]
        by_state[group] = by_state.get(group, 0) + numel
    lines.append(f"tensors: {len(tensors)}, {total / 2**20:.1f} MiB")
    for group, numel in sorted(by_state.items()):
        lines.append(f"  {group:16s} {numel:>14,d} elements")
    model = [k for k in tensors if not k.startswith((STATE_PREFIX, "rng_state"))]
    for key in sorted(model)[:200]:
        lines.append(f"  {key}  {tuple(tensors[key].size)}  {tensors[key].properties.dtype}")
    return "\n".join(lines)


_FUSED = re.compile(r"^(?P<prefix>.*\.experts)\.weight(?P<which>[12])$")
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.local_experts\.(?P<e>\d+)\.linear_fc(?P<which>[12])\.weight$")


def experts_state_dict(
    state: Dict[str, torch.Tensor], to: str, num_experts: Optional[int] = None
) -> Dict[str, torch.Tensor]:
    """Convert a (single-rank) torch state dict between the legacy fused ``GroupedMLP``
    (``experts.weight1`` ``[hidden, E*ffn(*2)]``, ``experts.weight2`` ``[E*ffn, hidden]``,
    read as per-expert ``view(E, hidden, -1)`` / ``view(E, -1, hidden)``) and per-expert
    ``SequentialMLP`` names (``experts.local_experts.<e>.linear_fc1/2.weight``, nn.Linear
    (out, in) orientation). GLU gate/up halves keep their order ([gate | up] columns of a
    fused expert are [gate; up] rows of its fc1). Distributed (torch_dist) checkpoints
    need no conversion: they store experts per expert, in model coordinates, already."""
    out: Dict[str, torch.Tensor] = {}
    if to == "sequential":
        if num_experts is None:
            raise CheckpointError("converting fused expert weights needs the number of local experts (--num-experts)")
        for name, t in state.items():
            m = _FUSED.match(name)
            if m is None:
                out[name] = t
                continue
            if m["which"] == "1":
                view = t.reshape(num_experts, t.shape[0], -1)  # (E, hidden, ffn[*2]): (in, out)
                fc = "linear_fc1"
            else:
                view = t.reshape(num_experts, -1, t.shape[1])  # (E, ffn, hidden): (in, out)
                fc = "linear_fc2"
            for e in range(num_experts):
                out[f"{m['prefix']}.local_experts.{e}.{fc}.weight"] = view[e].t().contiguous()
        return out
    if to == "legacy_grouped":
        groups: Dict[Tuple[str, str], Dict[int, torch.Tensor]] = {}
        for name, t in state.items():
            m = _PER_EXPERT.match(name)
            if m is None:
                out[name] = t
                continue
            groups.setdefault((m["prefix"], m["which"]), {})[int(m["e"])] = t
        for (prefix, which), experts in groups.items():
            views = torch.stack([experts[e].t() for e in sorted(experts)])  # (E, in, out)
            if which == "1":
                # Memory is expert-major: E blocks of (hidden, ffn) read back by view(E, hidden, -1).
                out[f"{prefix}.weight1"] = views.contiguous().view(views.shape[1], -1)
            else:
                out[f"{prefix}.weight2"] = views.contiguous().view(-1, views.shape[2])
        return out
    raise ValueError(f"experts conversion target must be 'sequential' or 'legacy_grouped', not {to!r}")


def convert_experts_file(src: str, dst: str, to: str, num_experts: Optional[int], overwrite: bool = False) -> None:
    """``experts`` on one torch file: a state dict of tensors, or Megatron-LM's legacy
    ``--ckpt-format torch`` file (``mp_rank_XX/model_optim_rng.pt``: ``model`` or ``model0``,
    ``model1``... per virtual stage). torch_dist checkpoints need no conversion."""
    if os.path.isdir(src):
        raise CheckpointError(
            f"{src} is a directory. torch_dist checkpoints (what tools/pretrain_gpt.py writes by default) "
            "store experts per expert in model coordinates and load into any expert layout: nothing to convert. "
            "`experts` converts one torch file: a state dict, or Megatron-LM's --ckpt-format torch "
            "mp_rank_XX/model_optim_rng.pt."
        )
    check_paths(src, dst)
    if os.path.exists(dst) and not overwrite:
        raise CheckpointError(f"{dst} already exists; pass --overwrite to replace it, or choose another name")
    state = torch.load(src, map_location="cpu", weights_only=False)
    keys = [k for k in ("model", *(f"model{i}" for i in range(len(state)))) if isinstance(state, dict) and k in state]
    models = {k: state[k] for k in keys} if keys else {None: state}
    for key, model in models.items():
        if not isinstance(model, dict):
            raise CheckpointError(
                f"{src}{'' if key is None else f'[{key!r}]'} is a {type(model).__name__}, not a state dict "
                "(name -> tensor); `experts` reads a torch state dict or Megatron-LM's model_optim_rng.pt."
            )
        converted = experts_state_dict(model, to, num_experts)
        state = converted if key is None else dict(state, **{key: converted})
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(dst) + ".tmp-", dir=os.path.dirname(os.path.abspath(dst)))
    os.close(fd)
    torch.save(state, tmp)
    os.replace(tmp, dst)


def _print_to_pipe(text: str) -> None:
    """Print; a reader that stops early (``| head``) ends the output quietly, as in Unix tools."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Python would report the broken pipe again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


UNVERIFIED_HELP = (
    "convert a source that has no integrity manifest (saved without megatron_muon); the result is labelled "
    "as converted from an unverified source"
)


def main(argv: Optional[List[str]] = None) -> None:
    """Command line of ``tools/convert_checkpoint.py``."""
    import argparse

    parser = argparse.ArgumentParser(prog="convert_checkpoint.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    a2m = sub.add_parser("adam-to-muon", help="Megatron AdamW distributed-optimizer checkpoint -> Muon")
    a2m.add_argument("src")
    a2m.add_argument("dst")
    a2m.add_argument("--momentum", choices=("zeros", "exp_avg"), default="zeros")
    a2m.add_argument("--muon-exclude-patterns", nargs="*", default=[])
    a2m.add_argument("--muon-router", action="store_true", help="the router weight is a Muon matrix")
    a2m.add_argument("--overwrite", action="store_true", help="replace DST's iteration if it exists")
    a2m.add_argument("--unverified-source", action="store_true", help=UNVERIFIED_HELP)
    m2a = sub.add_parser("muon-to-adam", help="Muon checkpoint -> Megatron AdamW distributed optimizer")
    m2a.add_argument("src")
    m2a.add_argument("dst")
    m2a.add_argument("--exp-avg", choices=("zeros", "momentum"), default="zeros")
    m2a.add_argument("--beta1", type=float, default=0.9, help="AdamW beta1 (scales momentum into exp_avg)")
    m2a.add_argument("--overwrite", action="store_true", help="replace DST's iteration if it exists")
    m2a.add_argument("--unverified-source", action="store_true", help=UNVERIFIED_HELP)
    exp = sub.add_parser("experts", help="legacy fused GroupedMLP <-> per-expert weights of a torch state dict")
    exp.add_argument("src")
    exp.add_argument("dst")
    exp.add_argument("--to", choices=("sequential", "legacy_grouped"), required=True)
    exp.add_argument("--num-experts", type=int, default=None, help="local experts per fused tensor")
    exp.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    for name, what in (
        ("to-fsdp-dtensor", "torch_dist -> fsdp_dtensor"),
        ("to-torch-dist", "fsdp_dtensor -> torch_dist"),
    ):
        fmt = sub.add_parser(name, help=f"a Muon checkpoint, {what} (DistributedOptimizer <-> Megatron-FSDP)")
        fmt.add_argument("src")
        fmt.add_argument("dst")
        fmt.add_argument("--overwrite", action="store_true", help="replace DST's iteration if it exists")
        fmt.add_argument("--unverified-source", action="store_true", help=UNVERIFIED_HELP)
    ins = sub.add_parser("inspect", help="print what a checkpoint holds")
    ins.add_argument("path")
    args = parser.parse_args(argv)
    try:
        if args.command == "adam-to-muon":
            print(
                adam_to_muon(
                    args.src,
                    args.dst,
                    args.momentum,
                    args.muon_exclude_patterns,
                    args.muon_router,
                    args.overwrite,
                    args.unverified_source,
                )
            )
        elif args.command == "muon-to-adam":
            print(muon_to_adam(args.src, args.dst, args.exp_avg, args.beta1, args.overwrite, args.unverified_source))
        elif args.command in ("to-fsdp-dtensor", "to-torch-dist"):
            from .convert_fsdp import change_format

            to = args.command[len("to-") :].replace("-", "_")
            print(change_format(args.src, args.dst, to, args.overwrite, args.unverified_source))
        elif args.command == "experts":
            convert_experts_file(args.src, args.dst, args.to, args.num_experts, args.overwrite)
            print(f"wrote {args.dst}")
        else:
            _print_to_pipe(inspect(args.path))
    except (CheckpointError, CheckpointIntegrityError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from e
    except OSError as e:  # an unwritable destination, a full disk: what and where, in one line
        print(f"error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        raise SystemExit(2) from e
