"""What a resumed run must agree on with the checkpoint it loads (``--load``), checked at
start-up, before any model is built, each in one line with exit code 2 (``launch``): the
checkpoint's format and optimizer (with the converter command that moves it), and its
model's shape and learning-rate schedule, which Megatron-LM itself asserts only once the
model is built (a traceback). The checks are Megatron-LM's own (``check_checkpoint_args``,
its ``OptimizerParamScheduler``), run on the checkpoint's arguments and scheduler state,
read through the verified, restricted readers (``checkpoint_dirs``)."""

from __future__ import annotations

import argparse
import copy
import os
import re
import types
import warnings
from typing import Any, Dict, Optional, Tuple

from megatron_muon.checkpoint.errors import CheckpointError, UnsafeCheckpointError
from megatron_muon.checkpoint.integrity import has_manifest
from megatron_muon.checkpoint.optimizer_state import optimizer_kind

from .checkpoint_dirs import COMMON_ITEMS, check_source, format_of, iteration_dir_name, read_common, read_tracker


def _iteration_to_load(args: argparse.Namespace) -> Optional[Tuple[int, str]]:
    """(iteration, its directory) that ``--load`` / ``--ckpt-step`` name; None without a
    readable tracker naming an existing iteration (the load path resumes from the newest
    that verifies then: ``checkpoint_guards``)."""
    tracked = read_tracker(args.load)
    if args.ckpt_step is not None:
        iteration = args.ckpt_step
    elif tracked is not None and tracked != "release":
        iteration = int(tracked)
    else:
        return None
    path = os.path.join(args.load.rstrip("/"), iteration_dir_name(iteration))
    return (iteration, path) if os.path.isdir(path) else None


def check_checkpoint_format(args: argparse.Namespace) -> None:
    """``--optimizer muon --load`` of a checkpoint in the other format than the run's (an
    fsdp_dtensor one without ``--use-megatron-fsdp``, a torch_dist one with it) stops here,
    nothing built, with the converter command that moves it."""
    from .integration import _checkpoint_format, _ours

    found = _iteration_to_load(args) if args.load and _ours(args) else None
    if found is None:
        return
    held, runs = format_of(found[1]), _checkpoint_format(args)
    if held is runs:
        return
    src = args.load.rstrip("/")
    dst = f"{src}_{runs.converted_suffix}"
    source = found[1] if args.ckpt_step is not None else src
    command = f"python tools/convert_checkpoint.py {runs.convert_command} {source} {dst}"
    raise ValueError(f"--load {args.load} holds {held.described} checkpoint but this run is {runs.engine}: "
                     f"move it with `{command}`, then --load {dst}")  # fmt: skip


def check_optimizer_to_load(args: argparse.Namespace) -> None:
    """``--optimizer muon --load`` of an AdamW run (Megatron's distributed optimizer, in any of
    its formats) stops here, before any model is built, with the converter command that
    switches it to Muon (``adam-to-muon``; momentum from zeros, or ``--momentum exp_avg``).
    ``--no-load-optim`` (weights only) loads as it is. The checkpoint's common state is
    verified against its manifest first, then read through the restricted unpickler; a
    checkpoint that fails either is refused here."""
    from .integration import _ours

    if not (args.load and _ours(args)) or args.no_load_optim:
        return
    resumed = _resumed(args)
    if resumed is None:
        return
    iteration, iteration_dir, common = resumed
    src = args.load.rstrip("/")
    if optimizer_kind(common.get("optimizer")) != "megatron":
        return
    muon = f"{src}_muon"
    source = iteration_dir if args.ckpt_step is not None else src
    unverified = "" if has_manifest(iteration_dir) else " --unverified-source"
    steps = f"python tools/convert_checkpoint.py adam-to-muon {source} {muon}{unverified}"
    raise ValueError(
        f"--load {args.load} holds AdamW state (Megatron's distributed optimizer, iteration {iteration}), not Muon's: "
        f"switch it with `{steps}` (--momentum exp_avg starts the momentum from AdamW's first moment), then --load {muon}"
        " (or load its weights alone with --no-load-optim)"
    )


def _resumed(args: argparse.Namespace) -> Optional[Tuple[int, str, Dict[str, Any]]]:
    """(iteration, its directory, its common state) of what ``--load`` resumes: verified
    against the manifest first (the items read), read through the restricted unpickler; None
    where it cannot be told here (Megatron-LM's load reports what is wrong)."""
    found = _iteration_to_load(args) if args.load else None
    if found is None:
        return None
    with warnings.catch_warnings():  # torch's notice that no process group exists yet
        warnings.simplefilter("ignore")
        check_source(found[1], unverified=True, items=COMMON_ITEMS)
        try:
            return (*found, read_common(found[1]))
        except UnsafeCheckpointError:
            raise
        except CheckpointError:
            return None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


_MODEL_ARGUMENT = re.compile(
    r"^(\w+) value from checkpoint \((.*)\) is not equal to the input argument value \((.*)\)\.$"
)
_SCHEDULE_VALUE = re.compile(r"class input value (.*) and checkpoint ?value (.*) for (.*) do not match")
SCHEDULE_FLAGS = {
    "learning rate": ("lr",),
    "minimum learning rate": ("min_lr",),
    "warmup iterations": ("lr_warmup_iters", "lr_warmup_samples", "lr_warmup_fraction", "global_batch_size"),
    "total number of iterations": ("lr_decay_iters", "lr_decay_samples", "train_iters", "train_samples",
                                   "global_batch_size"),
    "learning rate decay style": ("lr_decay_style",),
    "start weight decay": ("start_weight_decay", "weight_decay"),
    "end weight decay": ("end_weight_decay", "weight_decay"),
    "total number of weight decay iterations": ("train_iters", "train_samples", "global_batch_size"),
    "weight decay incr style": ("weight_decay_incr_style",),
}  # fmt: skip
"""The arguments behind each value Megatron-LM's ``OptimizerParamScheduler`` checks on load."""


def check_resumed_arguments(args: argparse.Namespace) -> None:
    """A resume whose model differs in shape from the checkpoint's (``--num-layers``,
    ``--hidden-size``...: Megatron-LM's ``check_checkpoint_args``) or whose learning-rate
    schedule differs from the saved one (``--train-iters``, ``--lr``...: the checks of
    Megatron-LM's ``OptimizerParamScheduler.load_state_dict``, unless
    ``--override-opt_param-scheduler`` or ``--use-checkpoint-opt_param-scheduler``) stops
    here naming the argument and both values. Where Megatron-LM skips them (``--finetune``,
    ``--use-checkpoint-args``; the schedule with ``--no-load-optim``), so does this."""
    if not args.load or args.finetune or getattr(args, "use_checkpoint_args", False):
        return
    resumed = _resumed(args)
    saved = resumed[2].get("args") if resumed is not None else None
    if not isinstance(saved, argparse.Namespace):
        return
    iteration, common = resumed[0], resumed[2]
    from megatron.training import checkpointing

    checkpointing.set_checkpoint_version(common.get("checkpoint_version", 0))  # as Megatron-LM's load does
    try:
        checkpointing.check_checkpoint_args(saved)
    except AssertionError as e:
        found = _MODEL_ARGUMENT.match(str(e))
        if found is None:
            raise
        name, then, now = found.groups()
        raise ValueError(
            f"--load {args.load} (iteration {iteration}) holds a model saved with {_flag(name)} {then}; this run has "
            f"{_flag(name)} {now}: a resumed run keeps its model's shape: give {_flag(name)} {then}, or start a new "
            "run (another --save)"
        ) from None
    state = common.get("opt_param_scheduler")
    if args.no_load_optim or not isinstance(state, dict):
        return
    try:
        _this_runs_scheduler(args).load_state_dict(copy.deepcopy(state))
    except AssertionError as e:
        found = _SCHEDULE_VALUE.search(str(e))
        if found is None:
            raise
        now, then, what = found.groups()
        if "iterations" in what:  # Megatron-LM counts them in samples (iterations x the global batch size)
            now, then = f"{now} samples", f"{then} samples"
        names = SCHEDULE_FLAGS.get(what, ())
        differ = [n for n in names if getattr(args, n, None) != getattr(saved, n, None)]
        # An argument this run leaves unset (Megatron-LM derives it) is named only when nothing else differs.
        differ = [n for n in differ if getattr(args, n, None) is not None] or differ or list(names[:1])
        given = ", ".join(f"{_flag(n)} {getattr(args, n, None)} (the checkpoint's run: {getattr(saved, n, None)})"
                          for n in differ)  # fmt: skip
        raise ValueError(
            f"--load {args.load} (iteration {iteration}) was saved with a learning-rate schedule whose {what} is "
            f"{then}, this run's is {now}: {given}; resume with the checkpoint's values, or pass "
            "--override-opt_param-scheduler to take this run's (--use-checkpoint-opt_param-scheduler: the checkpoint's)"
        ) from None


def _this_runs_scheduler(args: argparse.Namespace) -> Any:
    """Megatron-LM's own learning-rate scheduler for ``args`` (``get_optimizer_param_scheduler``,
    on a copy of the arguments: it fills in derived ones), stepping an optimizer of no groups."""
    from megatron.training import global_vars, training

    global_vars.set_args(copy.copy(args))
    try:
        return training.get_optimizer_param_scheduler(types.SimpleNamespace(param_groups=[]))
    finally:
        global_vars.set_args(args)
