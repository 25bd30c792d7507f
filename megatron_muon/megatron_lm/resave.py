"""Megatron-LM's default distributed-optimizer checkpoints, read by Megatron-LM itself.

By default Megatron-LM saves the distributed optimizer's state as its DDP buckets
(``dp_reshardable``): one flat range per bucket, whose parameter boundaries only the
running model knows (its parameter order, padding and bucket sizes). The converter works
on parameters, so for such a source it has Megatron-LM load the checkpoint and save the
same iteration fully reshardable (parameter by parameter): ``tools/pretrain_gpt.py`` with
the run's own arguments (stored in the checkpoint), as many ranks as the run had, and no
training step (``--train-iters`` is the iteration reached). Nothing here decodes buckets.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Set

from megatron_muon.checkpoint.errors import CheckpointError

from .checkpoint_dirs import iteration_dir_name
from .process_lifetime import die_with_this_process

NOT_CARRIED = frozenset(
    {
        # Where this job reads and writes, and how long it runs: the re-save sets its own.
        "load", "save", "ckpt_step", "save_interval", "train_iters", "train_samples", "exit_interval",
        "exit_duration_in_mins", "eval_iters", "no_load_optim", "no_load_rng", "finetune",
        "use_checkpoint_args", "use_checkpoint_opt_param_scheduler", "override_opt_param_scheduler",
        "start_over", "recipe", "optimizer", "dist_ckpt_optim_fully_reshardable",
        # The run's data (it trains nothing here: --mock-data) and logging targets.
        "data_path", "split", "train_data_path", "valid_data_path", "test_data_path", "data_args_path",
        "per_split_data_args_path", "data_cache_path", "mock_data", "tensorboard_dir", "wandb_project",
        "wandb_exp_name", "wandb_save_dir",
        # Set by the launcher.
        "rank", "world_size", "local_rank",
    }
)  # fmt: skip
"""Arguments of the saved run that the re-save does not repeat."""

RESAVE_FLAGS = ["--optimizer", "adam", "--mock-data", "--eval-iters", "0"]


def world_size(saved: argparse.Namespace) -> int:
    """How many ranks the saved run had."""
    return int(getattr(saved, "world_size", 1) or 1)


def run_flags(saved: argparse.Namespace) -> List[str]:
    """Command-line flags under which Megatron-LM's parsed and validated arguments equal
    ``saved`` (a run's arguments, as Megatron-LM stores them in its checkpoints), except
    :data:`NOT_CARRIED`: the flags of every argument whose value differs, repeated until
    what validation derives from them (kv channels, padded sizes, ...) agrees too."""
    import megatron.training.arguments as arguments

    from . import recipes
    from .launch import extra_args_provider, install_argument_layers, validated_args

    install_argument_layers()  # --optimizer muon and the --muon-* flags
    parser = extra_args_provider(arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in NOT_CARRIED}  # noqa: SLF001
    world = world_size(saved)
    # Every value that is not its flag's default, less what validation derives when it is
    # unset (Megatron-LM refuses e.g. --encoder-num-layers beside --num-layers); then each
    # value that validation does not reproduce, until it reproduces them all.
    derived = _set_by_validation()
    carried: Dict[str, Any] = {}
    for dest, action in actions.items():
        value = getattr(saved, dest, None)
        if dest not in derived and value not in (action.default, None):
            carried[dest] = _as_flag_value(action, value)
    differ: Dict[str, Any] = {}
    for _ in range(4):
        flags = recipes.recipe_to_argv({d: v for d, v in carried.items() if v is not None}, parser)
        try:
            now = validated_args(flags + RESAVE_FLAGS, world)
        except SystemExit as e:  # Megatron-LM refused them (one line on stderr)
            raise CheckpointError(f"Megatron-LM refuses the run's own arguments: {' '.join(flags)}") from e
        differ = {
            d: getattr(saved, d) for d in actions if hasattr(saved, d) and getattr(now, d, None) != getattr(saved, d)
        }
        if not differ or any(carried.get(d, 0) is None for d in differ):
            break
        carried.update({d: _as_flag_value(actions[d], v) for d, v in differ.items()})
    if differ:
        raise CheckpointError(f"the run's arguments {sorted(differ)} cannot be given again as flags")
    return flags


def _set_by_validation() -> Set[str]:
    """The arguments Megatron-LM's validation may derive from others: those its argument
    module assigns (``args.X = ...``), less those Megatron-LM itself restores from a
    checkpoint as the model's definition (``--use-checkpoint-args``: ``--num-layers``
    where it derives ``--encoder-num-layers``)."""
    import ast
    import inspect

    import megatron.training.arguments as arguments
    import megatron.training.checkpointing as checkpointing

    assigned: Set[str] = set()
    for node in ast.walk(ast.parse(inspect.getsource(arguments))):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        )
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "args":
                assigned.add(t.attr)
    model = {
        node.args[0].value
        for node in ast.walk(ast.parse(inspect.getsource(checkpointing.load_args_from_checkpoint)))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_set_arg"
        and node.args and isinstance(node.args[0], ast.Constant)
    }  # fmt: skip
    return assigned - model


def _as_flag_value(action: argparse.Action, value: Any) -> Any:
    """``value`` as :func:`recipes.recipe_to_argv` takes it for ``action``: a number, string or
    bool, a list for a many-valued flag, a list written out for a one-valued flag that
    parses one (``--moe-layer-freq [0,1]``); None where a flag cannot give it (a dtype)."""
    scalar = (bool, int, float, str)
    if isinstance(value, scalar):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, scalar) for v in value):
        many = action.nargs in ("*", "+") or isinstance(action.nargs, int)
        return list(value) if many else "[" + ",".join(map(str, value)) + "]"
    return None


def pretrain_command(saved: argparse.Namespace, flags: List[str]) -> List[str]:
    """torchrun of ``tools/pretrain_gpt.py`` with ``saved``'s flags then ``flags``, on the
    run's world size (a free rendezvous port)."""
    from .launch import pretrain_script

    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(world_size(saved)),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"]  # fmt: skip
    return launcher + [str(pretrain_script()), *run_flags(saved), *flags]


def resave_fully_reshardable(source: str, iteration: int, saved: argparse.Namespace, into: str) -> str:
    """Load iteration ``iteration`` of ``source`` (a ``--save`` directory) with Megatron-LM,
    as the run was configured (``saved``), and save it fully reshardable under ``into``;
    returns the new ``iter_XXXXXXX`` directory. The learning-rate schedule is the
    checkpoint's. Runs on the GPUs when there are enough for the run's ranks, else on the CPU."""
    import torch

    cmd = pretrain_command(
        saved,
        [*RESAVE_FLAGS, "--load", source, "--ckpt-step", str(iteration), "--save", into,
         "--dist-ckpt-optim-fully-reshardable", "--train-iters", str(iteration), "--save-interval",
         str(iteration + 1), "--use-checkpoint-opt_param-scheduler"],
    )  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if torch.cuda.device_count() < world_size(saved):
        env["CUDA_VISIBLE_DEVICES"] = ""
    print(f"re-saving {source} iteration {iteration} fully reshardable with Megatron-LM: {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, preexec_fn=die_with_this_process())
    out = Path(into) / iteration_dir_name(iteration)
    if proc.returncode != 0 or not out.is_dir():
        said = ((proc.stderr or proc.stdout).strip().splitlines() or [""])[-1]
        raise CheckpointError(
            f"Megatron-LM could not re-save {source} iteration {iteration} fully reshardable (exit {proc.returncode}: "
            f"{said}); run `{' '.join(cmd)}` to see why, then convert its --save directory"
        )
    return str(out)
