"""Megatron-LM's own ``save_checkpoint`` / ``load_checkpoint``, with nothing lost on the way.

Saving an iteration (``dist_checkpointing.save`` as Megatron-LM's checkpointing module sees
it, :class:`GuardedDistCheckpointing`, and DCP's save for fsdp_dtensor) goes through
``checkpoint.publish``: staged in ``iter_N.tmp``, manifest last, verified when it replaces a
copy, this job's lock on ``--save`` confirmed, swapped into place. Megatron-LM then writes
its tracker through :class:`AtomicTrackerWrites` (temporary file, fsync, rename), so a kill
never leaves it empty. A save of the iteration this job last saved or loaded, with no step
since (the rerun state machine's save when it stops on a NaN), keeps the existing checkpoint
as it is. A failed save (a full disk) is one line that says so.

Loading (``load_checkpoint``, :func:`_wrap_load_checkpoint`): in a directory this job owns
(``--load`` is ``--save``) rank 0 first undoes what interrupted saves left; when the tracker
is empty, unreadable, missing beside saved iterations or names a missing iteration, it picks
the newest iteration whose manifest verifies and says so; every rank loads that one. Each
directory is verified before its first read, and every read unpickles through the
restricted unpickler (``checkpoint.unpickling``, installed for the whole job); one that lost
our manifest or record is refused; the optimizer state must hold what the run loads
(``optimizer_state.states_to_load``); a checkpoint whose padded vocabulary differs from this
run's is refused, naming ``--make-vocab-size-divisible-by``. docs/design.md ("Inside
Megatron-LM") says where each hooks in; ``patches.CHECKPOINTS`` declares them, and
``use_megatron_muon`` installs them (their context holds one :class:`CheckpointGuards`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable, Optional, Tuple

import torch.distributed as dist

from megatron_muon import patching
from megatron_muon.checkpoint import formats, save_lock
from megatron_muon.checkpoint.errors import CheckpointError, checkpoint_error_in
from megatron_muon.checkpoint.integrity import (
    MANIFEST,
    has_manifest,
    missing_manifest_error,
    saved_with_manifest,
    source_verified,
    verify_manifest,
    write_atomically,
)
from megatron_muon.checkpoint.optimizer_state import optimizer_kind, saved_keys, states_to_load
from megatron_muon.checkpoint.publish import agreed, disk_full, on_rank0, os_error_code, publish, write_failure
from megatron_muon.checkpoint.reading import regular_files_only
from megatron_muon.checkpoint.torch_dist import keep_states, requested_keys

from .checkpoint_dirs import (
    COMMON_ITEMS,
    TRACKER,
    read_tracker,
    remove_leftovers,
    resume_iteration,
    same_directory,
    written_by_megatron_muon,
)


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _say(line: str) -> None:
    if _rank0():
        print(f"megatron_muon: {line}", flush=True)


class CheckpointGuards:
    """What the save and load hooks share: the directory this job last saved or loaded (a
    save of it again, with no step since, is not repeated) and the manifest verified by the
    first of Megatron-LM's two reads of a directory."""

    def __init__(self) -> None:
        self.current: Optional[str] = None
        self.verified: Optional[Tuple[str, int, int]] = None
        self.resume_iteration: Optional[int] = None
        """Set while ``load_checkpoint`` loads the iteration chosen in place of the tracker's."""
        self.first_read = True
        """Whether Megatron-LM's read in progress is its first of the directory (the common state)."""
        self.dcp_load_dir: Optional[str] = None
        """The directory of a format Megatron-LM reads with DCP alone (fsdp_dtensor) that the
        read in progress verified."""


# ---------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------


class InternalAsyncPathNotice(logging.Filter):
    """Drops Megatron-core 0.19's "MCore's async save is deprecated" notice: its synchronous
    torch_dist save runs through that path itself (``TorchDistSaveShardedStrategy.save``
    calls ``async_save(async_strategy="mcore")``), so every rank printed it at its first save
    whatever the run's settings, and Megatron-LM has no flag that chooses another path."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("MCore's async save is deprecated")


class GuardedDistCheckpointing:
    """``megatron.core.dist_checkpointing`` as Megatron-LM's checkpointing module sees it:
    everything is Megatron-core's, except that ``save`` writes into a staging directory and
    swaps it into place with its manifest (module docstring, steps 1-3)."""

    def __init__(self, package: Any, guards: CheckpointGuards) -> None:
        self.__wrapped__ = package
        self._guards = guards
        strategies = logging.getLogger("megatron.core.dist_checkpointing.strategies.torch")
        if not any(isinstance(f, InternalAsyncPathNotice) for f in strategies.filters):
            strategies.addFilter(InternalAsyncPathNotice())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__wrapped__, name)

    def save(self, sharded_state_dict, checkpoint_dir, *args, **kwargs):
        """Megatron-core's ``save`` through :func:`guarded_save`."""
        if "verify_integrity" in kwargs:
            kwargs["verify_integrity"] = False  # our manifest replaces Megatron's rank-0 one
        return guarded_save(
            self._guards,
            checkpoint_dir,
            lambda staging: self.__wrapped__.save(sharded_state_dict, staging, *args, **kwargs),
        )


def guarded_save(guards: CheckpointGuards, checkpoint_dir: str, write: Callable[[str], Any]) -> Any:
    """``write(staging)`` through ``checkpoint.publish`` (staged, manifest, verified when
    replacing, this job's lock on the save directory confirmed, swapped into place); for an
    async save the rest runs as its first finalize step, before Megatron-LM's own that moves
    the tracker. A save of the directory this job last saved or loaded, with no step since,
    keeps it as it is."""
    target = str(checkpoint_dir).rstrip("/")
    if same_directory(target, guards.current) and agreed(has_manifest(target)):
        _say(f"{target} already holds this iteration (saved or loaded by this job, no step since): kept as it is")
        return None
    directory = os.path.dirname(target)
    held = {}  # rank 0's lock (taken at start-up by tools/pretrain_gpt.py; else here, once)
    on_rank0(
        lambda: held.update(lock=save_lock.take(directory, "Megatron-LM's save_checkpoint")),
        "locking the save directory",
        directory,
    )
    request = publish(target, write, lock=held.get("lock"))

    def saved() -> None:
        guards.current = target

    if hasattr(request, "add_finalize_fn"):
        request.add_finalize_fn(saved)
    else:
        saved()
    return request


def _guarded_dist_checkpointing(original: Any, context: Any) -> GuardedDistCheckpointing:
    return GuardedDistCheckpointing(original, context.checkpoint_guards)


def _guarded_dcp_save(original: Callable, guards: CheckpointGuards) -> Callable:
    """torch DCP's ``save`` as Megatron-LM's fsdp_dtensor save calls it, through :func:`guarded_save`."""

    def save(state_dict, *, storage_writer, **options):
        def write(staging: str):
            return original(state_dict=state_dict, storage_writer=type(storage_writer)(staging), **options)

        return guarded_save(guards, storage_writer.path, write)

    return save


def _wrap_save_checkpoint(original: Callable, context: Any) -> Callable:
    """Megatron-LM's ``save_checkpoint``: a failure is one :class:`CheckpointError` line (a
    full disk named as such; the last complete checkpoint stays); with ``--ckpt-format
    fsdp_dtensor`` its ``torch.distributed.checkpoint.save`` (the one call that writes the
    directory) goes through :func:`guarded_save` while it runs."""
    from .patches import DCP_SAVE_SCOPE

    guards = context.checkpoint_guards

    def save_checkpoint(*args, **kwargs):
        from megatron.training import get_args

        margs = get_args()
        try:
            written = formats.named(margs.ckpt_format)
            dcp_only = written is not None and written.megatron_dcp_only
            with patching.scoped(DCP_SAVE_SCOPE, guards) if dcp_only else contextlib.nullcontext():
                return original(*args, **kwargs)
        except CheckpointError:
            raise
        except BaseException as e:
            ours = checkpoint_error_in(e)
            if ours is not None:
                raise ours from None
            if os_error_code(e) is None and not disk_full(margs.save):
                raise
            iteration = args[0] if args else kwargs.get("iteration")
            raise CheckpointError(write_failure(e, f"saving iteration {iteration}", margs.save)) from e

    save_checkpoint.__wrapped__ = original  # type: ignore[attr-defined]
    return save_checkpoint


class _AtomicFile:
    """A text file opened for writing whose contents replace ``path`` at once on close."""

    def __init__(self, path: str) -> None:
        self.path, self._parts = path, []

    def write(self, text: str) -> int:
        self._parts.append(text)
        return len(text)

    def __enter__(self) -> "_AtomicFile":
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            write_atomically(self.path, "".join(self._parts))


def _atomic_tracker_writes(original: Any, context: Any) -> "AtomicTrackerWrites":
    return AtomicTrackerWrites(original)


class AtomicTrackerWrites:
    """Megatron-core's ``maybe_msc`` as Megatron-LM's checkpointing module sees it, except
    that opening the tracker for writing gives a file that replaces it atomically on close."""

    def __init__(self, wrapped: Any) -> None:
        self.__wrapped__ = wrapped

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__wrapped__, name)

    def open(self, path, mode: str = "r", *args, **kwargs):
        opener = self.__wrapped__.open
        if "w" in mode and os.path.basename(str(path)) == TRACKER and opener is open:  # local files only
            return _AtomicFile(str(path))
        return opener(path, mode, *args, **kwargs)


# ---------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------


def choose_iteration(directory: str, owned: bool, choose: bool) -> Optional[int]:
    """On rank 0, before anything is loaded from ``directory``: when this job owns it
    (``--load`` is ``--save``, whose lock it holds) undo what interrupted saves of ours left
    there; with ``choose``, the iteration to load when the tracker cannot say
    (``checkpoint_dirs.resume_iteration``, one line says why), else None. A directory this
    job does not own is only read: its leftovers may be another job's work in progress, or
    the directory read-only."""
    if not os.path.isdir(directory):
        return None
    if owned:
        for line in remove_leftovers(directory):
            _say(line)
    if not choose:
        return None
    iteration, why = resume_iteration(directory)
    if why:
        _say(why)
    return iteration


def _wrap_load_checkpoint(original: Callable, context: Any) -> Callable:
    guards = context.checkpoint_guards

    def load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg="load", *a, **kw):
        from megatron.training import get_args

        args = get_args()
        directory = getattr(args, load_arg, None)
        if not directory or not dist.is_initialized():
            return _one_error(original)(ddp_model, optimizer, opt_param_scheduler, load_arg, *a, **kw)
        owned = same_directory(directory, args.save) and save_lock.held(args.save) is not None if _rank0() else False
        chosen = on_rank0(
            lambda: choose_iteration(directory, owned, choose=args.ckpt_step is None), "reading", directory
        )
        given = args.ckpt_step
        guards.resume_iteration = given if given is not None else chosen
        args.ckpt_step = guards.resume_iteration  # Megatron-LM reads no tracker then, present or not
        try:
            return _one_error(original)(ddp_model, optimizer, opt_param_scheduler, load_arg, *a, **kw)
        finally:
            guards.resume_iteration, args.ckpt_step = None, given

    load_checkpoint.__wrapped__ = original  # type: ignore[attr-defined]
    return load_checkpoint


def _one_error(function: Callable) -> Callable:
    """``function`` raising the :class:`CheckpointError` behind any failure (torch's
    distributed checkpoint re-raises one a rank raised while reading, wrapped)."""

    def call(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except CheckpointError:
            raise
        except BaseException as e:
            ours = checkpoint_error_in(e)
            if ours is None:
                raise
            raise ours from None

    return call


def _wrap_read_metadata(original: Callable, context: Any) -> Callable:
    guards = context.checkpoint_guards

    def read_metadata(tracker_filename):
        if guards.resume_iteration is not None:
            return guards.resume_iteration, False
        if read_tracker(os.path.dirname(str(tracker_filename))) is None:
            # Megatron-LM's own answer is sys.exit() with status 0: a "finished" job that trained nothing.
            raise CheckpointError(
                f"{tracker_filename} is empty or unreadable (it must hold an iteration number, or 'release'): "
                "name the iteration to load with --ckpt-step"
            )
        return original(tracker_filename)

    read_metadata.__wrapped__ = original  # type: ignore[attr-defined]
    return read_metadata


def _manifest_facts(checkpoint_dir: str) -> Tuple[bool, bool, Optional[Tuple[str, int, int]], bool]:
    """(has a manifest, has the record of one, the manifest's identity (path, mtime, size),
    holds what only megatron_muon writes)."""
    if not has_manifest(checkpoint_dir):
        record = saved_with_manifest(checkpoint_dir)
        if not record:
            regular_files_only(checkpoint_dir)  # raised on rank 0: on_rank0 in verify_before_read
        return False, record, None, not record and written_by_megatron_muon(checkpoint_dir)
    stat = os.stat(os.path.join(checkpoint_dir, MANIFEST))
    return True, True, (os.path.abspath(checkpoint_dir), stat.st_mtime_ns, stat.st_size), True


def verify_before_read(checkpoint_dir: str, first_read: bool, guards: CheckpointGuards) -> None:
    """Verify ``checkpoint_dir`` (collectively) before Megatron-LM reads it.

    Megatron-LM reads a torch_dist checkpoint twice, the common state (``first_read``) and
    then the tensors; the second read skips the hashing if the manifest verified by the first
    is unchanged. Before the process group exists (Megatron-LM reading the checkpoint's
    arguments) this process verifies what that read reads. A checkpoint of ours that lost
    its manifest or record is refused; one from plain Megatron-LM loads with a warning."""
    checkpoint_dir = str(checkpoint_dir)
    if not dist.is_initialized():
        if has_manifest(checkpoint_dir):
            verify_manifest(checkpoint_dir, local=True, items=COMMON_ITEMS)
        else:
            regular_files_only(checkpoint_dir)
        return
    manifest, record, stamp, ours = on_rank0(lambda: _manifest_facts(checkpoint_dir), "reading", checkpoint_dir)
    if not manifest:
        if record:
            raise missing_manifest_error(checkpoint_dir)
        if ours:
            raise CheckpointError(
                f"{checkpoint_dir} was written by megatron_muon but has lost its {MANIFEST} and megatron_muon.json, "
                "which every checkpoint it writes carries: it cannot be verified, so it is refused; restore it from "
                "a copy, or resume from an earlier iteration with --ckpt-step"
            )
        _say(f"warning: {checkpoint_dir} has no {MANIFEST}: loading it unverified (saved without megatron_muon)")
        return
    if not first_read and guards.verified == stamp:
        return
    verify_manifest(checkpoint_dir)
    if not source_verified(checkpoint_dir):
        _say(f"warning: {checkpoint_dir} was converted from a checkpoint that had no manifest (unverified source)")
    guards.verified = stamp if first_read else None


def check_padded_vocabulary(common: Any, checkpoint_dir: str) -> None:
    """Refuse a checkpoint whose embedding rows were padded to another count than this run's
    (Megatron-LM would load the rows it finds, shifted against the shards: a silent wrong
    load)."""
    from megatron.training import get_args

    saved_args = common.get("args") if isinstance(common, dict) else None
    saved = getattr(saved_args, "padded_vocab_size", None)
    args = get_args()
    now = getattr(args, "padded_vocab_size", None)
    if saved is None or now is None or saved == now:
        return
    tp = args.tensor_model_parallel_size
    hint = (
        f"--make-vocab-size-divisible-by {saved // tp} pads it alike at TP{tp}"
        if saved % tp == 0
        else f"no --make-vocab-size-divisible-by pads {saved} rows at TP{tp}: load at a TP size dividing {saved}"
    )
    raise CheckpointError(
        f"{checkpoint_dir} was saved with the vocabulary padded to {saved} rows "
        f"(--make-vocab-size-divisible-by {getattr(saved_args, 'make_vocab_size_divisible_by', '?')} x "
        f"TP{getattr(saved_args, 'tensor_model_parallel_size', '?')}), this run pads it to {now}: {hint}"
    )


def _wrap_load_base_checkpoint(original: Callable, context: Any) -> Callable:
    """Megatron-LM's ``_load_base_checkpoint``, for an fsdp_dtensor checkpoint (torch_dist
    ones go through :func:`_wrap_load_global_dist_base_checkpoint`): the directory verified
    before DCP reads it (:func:`_wrap_get_checkpoint_format` sees its name first), the padded
    vocabulary checked on the first read."""
    guards = context.checkpoint_guards

    def load_base_checkpoint(load_dir, args, rank0=False, *rest, **kw):
        guards.first_read, guards.dcp_load_dir = bool(rank0), None
        out = original(load_dir, args, rank0, *rest, **kw)
        checkpoint_dir, guards.dcp_load_dir = guards.dcp_load_dir, None
        if checkpoint_dir is not None and dist.is_initialized():
            if rank0:
                check_padded_vocabulary(out[0], checkpoint_dir)
            else:
                guards.current = checkpoint_dir.rstrip("/")
        return out

    load_base_checkpoint.__wrapped__ = original  # type: ignore[attr-defined]
    return load_base_checkpoint


def _wrap_get_checkpoint_format(original: Callable, context: Any) -> Callable:
    """Megatron-LM's format detection, after an fsdp_dtensor checkpoint (by our record, or by
    its files: one that lost its ``.metadata`` is still one) is verified: Megatron-LM would
    call it ``unknown``, or read it as another format."""
    guards = context.checkpoint_guards

    def get_checkpoint_format(checkpoint_name, *args, **kwargs):
        found = formats.detect(str(checkpoint_name))
        verified = found is not None and found.megatron_dcp_only
        if verified:
            verify_before_read(str(checkpoint_name), first_read=guards.first_read, guards=guards)
        said = original(checkpoint_name, *args, **kwargs)
        told = formats.named(said)
        if told is not None and told.megatron_dcp_only:
            if not verified:
                verify_before_read(str(checkpoint_name), first_read=guards.first_read, guards=guards)
            guards.dcp_load_dir = str(checkpoint_name)
        return said

    get_checkpoint_format.__wrapped__ = original  # type: ignore[attr-defined]
    return get_checkpoint_format


def check_holds_state(state_dict: dict, checkpoint_dir: str) -> dict:
    """``state_dict`` (what a load asks the fsdp_dtensor checkpoint for) without the optional
    optimizer states the checkpoint lacks (``optimizer_state.states_to_load``: they start at
    zero, as on torch_dist); refuses, naming them, a checkpoint that lacks a weight or a
    required state (Megatron-LM's strict DCP load would fail on it without saying what to
    do; a partial one would leave it as initialized)."""
    saved = saved_keys(checkpoint_dir)
    missing = sorted(f"model.{key}" for key in state_dict.get("model", {}) if f"model.{key}" not in saved)
    if missing:
        raise CheckpointError(
            f"{checkpoint_dir} lacks {len(missing)} tensor(s) this run loads ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}): it was saved from another model; load it with "
            "the flags it was trained with"
        )
    optimizer = state_dict.get("optimizer")
    if isinstance(optimizer, dict) and "state" in optimizer:
        wanted = {
            name: {s: f"optimizer.state.{name}.{s}" for s in states} for name, states in optimizer["state"].items()
        }
        kept = states_to_load(wanted, saved, checkpoint_dir)
        state = {
            name: {s: v for s, v in states.items() if s in kept[name]} for name, states in optimizer["state"].items()
        }
        state_dict = dict(state_dict, optimizer=dict(optimizer, state=state))
    return state_dict


def keep_saved_states(sharded_state_dict: dict, checkpoint_dir: str) -> None:
    """Our torch_dist optimizer state in ``sharded_state_dict`` (what Megatron-LM asks the
    checkpoint for) without the optional states the checkpoint lacks; a required one
    missing is refused (``optimizer_state.states_to_load``)."""
    optimizer = sharded_state_dict.get("optimizer")
    if optimizer_kind(optimizer) != "megatron_muon":
        return  # Megatron's own optimizer, or no optimizer loaded
    param_state = optimizer["param_state"]
    keep_states(param_state, states_to_load(requested_keys(param_state), saved_keys(checkpoint_dir), checkpoint_dir))


def _wrap_preprocess(original: Callable, context: Any) -> Callable:
    """Megatron-LM's ``preprocess_fsdp_dtensor_state_dict`` replaced by
    ``fsdp_state_dict.preprocess_state_dict``; before a load, the checkpoint
    checked to hold every weight and optimizer state (:func:`check_holds_state`)."""
    from megatron_muon.megatron_lm.fsdp_state_dict import preprocess_state_dict

    guards = context.checkpoint_guards

    def preprocess_fsdp_dtensor_state_dict(args, raw_state_dict, model):
        state_dict = preprocess_state_dict(args, raw_state_dict, model)
        if guards.dcp_load_dir is not None:  # set while a load reads that directory
            state_dict = check_holds_state(state_dict, guards.dcp_load_dir)
        return state_dict

    preprocess_fsdp_dtensor_state_dict.__wrapped__ = original  # type: ignore[attr-defined]
    return preprocess_fsdp_dtensor_state_dict


def _wrap_load_global_dist_base_checkpoint(original: Callable, context: Any) -> Callable:
    import megatron.training.checkpointing as checkpointing

    guards = context.checkpoint_guards

    def load_global_dist_base_checkpoint(load_dir, args, rank0, sharded_state_dict, iteration, release, *rest, **kw):
        checkpoint_dir = checkpointing.get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)
        verify_before_read(checkpoint_dir, first_read=bool(rank0), guards=guards)
        if not rank0 and isinstance(sharded_state_dict, dict):
            keep_saved_states(sharded_state_dict, checkpoint_dir)
        out = original(load_dir, args, rank0, sharded_state_dict, iteration, release, *rest, **kw)
        if rank0 and dist.is_initialized():
            check_padded_vocabulary(out[0], checkpoint_dir)
        if not rank0:
            guards.current = str(checkpoint_dir).rstrip("/")
        return out

    load_global_dist_base_checkpoint.__wrapped__ = original  # type: ignore[attr-defined]
    return load_global_dist_base_checkpoint
