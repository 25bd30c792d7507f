"""The driver's checkpoints, in Megatron-LM's directory layout, written atomically.

Two formats (``--ckpt-format``), one directory layout::

    SAVE/latest_checkpointed_iteration.txt      the iteration to resume from
    SAVE/iter_0000100/...                       one checkpoint

* ``torch`` (default with adam / sgd): ``iter_XXXXXXX/rank_00000.pt ...`` (model chunks, optimizer,
  scheduler, RNG per rank) and ``metadata.json``; resumes at the same parallel layout.
* ``torch_dist`` (Muon only, its default): ``megatron_muon.checkpoint``'s reshardable checkpoint (model
  and optimizer state in model coordinates, scheduler and arguments in its common state,
  RNG states per rank); loads into any TP / PP / EP / DP layout. The RNG states come back
  only at the same world size.

A save writes everything into ``iter_XXXXXXX.tmp`` first; only when every rank has
written does rank 0 rename the directory into place and then (atomically, via
``os.replace``) point the tracker file at it. A crash at any point leaves the previous
checkpoint and tracker intact. Loading detects the format from the directory.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from .distributed import print_rank_0, use_cuda

TRACKER = "latest_checkpointed_iteration.txt"
LAYOUT_KEYS = (
    "world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size", "context_parallel_size", "expert_model_parallel_size",
    "expert_tensor_parallel_size", "optimizer",
)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or was written with another layout."""


def iteration_dir(root: Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def rank_file(directory: Path, rank: int) -> Path:
    return Path(directory) / f"rank_{rank:05d}.pt"


def latest_iteration(root: Path) -> Optional[int]:
    """The iteration the tracker points at (``None`` when there is no checkpoint)."""
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker} does not hold an iteration number: {text!r}")
    return int(text)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def publish(tmp: Path, final: Path, root: Path, iteration: int) -> None:
    """Move a complete ``tmp`` checkpoint directory to ``final``, then update the tracker."""
    if final.exists():  # re-saving the same iteration: keep the old one until the new is in place
        old = final.with_name(final.name + f".old-{os.getpid()}")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _atomic_write_text(Path(root) / TRACKER, f"{iteration}\n")


# ---------------------------------------------------------------------------------------
# What each rank saves
# ---------------------------------------------------------------------------------------


def _sub_optimizers(optimizer) -> List[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _master_groups(opt) -> List[List[torch.Tensor]]:
    """fp32 master copies of bf16/fp16 params (this rank's shards for the distributed optimizer)."""
    groups = getattr(opt, "shard_fp32_from_float16_groups", None)
    return groups if groups is not None else getattr(opt, "fp32_from_float16_groups", [])


def optimizer_state(optimizer) -> List[Dict[str, Any]]:
    """Per sub-optimizer: Muon's own ``state_dict()``; for Megatron's optimizers (adam / sgd)
    the inner torch optimizer's state and this rank's fp32 master copies (the
    DistributedOptimizer's ``state_dict()`` leaves the parameter state out)."""
    from megatron_muon import MuonDistributedOptimizer

    out = []
    for opt in _sub_optimizers(optimizer):
        if isinstance(opt, MuonDistributedOptimizer):
            out.append({"kind": "muon", "state": opt.state_dict()})
            continue
        entry: Dict[str, Any] = {"kind": "megatron", "inner": opt.optimizer.state_dict()}
        entry["master"] = [[t.detach().clone() for t in group] for group in _master_groups(opt)]
        if getattr(opt, "grad_scaler", None):
            entry["grad_scaler"] = opt.grad_scaler.state_dict()
        out.append(entry)
    return out


def load_optimizer_state(optimizer, saved: List[Dict[str, Any]]) -> None:
    subs = _sub_optimizers(optimizer)
    if len(subs) != len(saved):
        raise CheckpointError(f"checkpoint has {len(saved)} optimizer parts, this run has {len(subs)}")
    for opt, entry in zip(subs, saved):
        if entry["kind"] == "muon":
            opt.load_state_dict(entry["state"])
            continue
        opt.optimizer.load_state_dict(entry["inner"])
        for group, values in zip(_master_groups(opt), entry["master"]):
            for tensor, value in zip(group, values):
                tensor.data.copy_(value)
        if getattr(opt, "grad_scaler", None) and "grad_scaler" in entry:
            opt.grad_scaler.load_state_dict(entry["grad_scaler"])


def rng_state() -> Dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if use_cuda() else None,
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state: Dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if use_cuda() and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def layout(args: argparse.Namespace) -> Dict[str, Any]:
    return {k: getattr(args, k) for k in LAYOUT_KEYS}


def _plain_args(args: argparse.Namespace) -> Dict[str, Any]:
    return {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, list, tuple, type(None)))}


# ---------------------------------------------------------------------------------------
# Save / load
# ---------------------------------------------------------------------------------------


def is_distributed_checkpoint(directory: Path) -> bool:
    """A torch_dist checkpoint (torch.distributed.checkpoint writes ``.metadata``)."""
    return (Path(directory) / ".metadata").is_file()


def _save_distributed(args, iteration: int, consumed_samples: int, model, optimizer, scheduler) -> None:
    from megatron_muon import checkpoint as dist_ckpt

    root = Path(args.save)
    if torch.distributed.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
    extra = {"iteration": iteration, "consumed_samples": consumed_samples, "layout": layout(args),
             "args": _plain_args(args), "scheduler": scheduler.state_dict()}
    # save_checkpoint writes iter_XXXXXXX.tmp and renames it into place when all ranks are done.
    dist_ckpt.save_checkpoint(str(iteration_dir(root, iteration)), model, optimizer, extra=extra, per_rank=rng_state())
    if torch.distributed.get_rank() == 0:
        _atomic_write_text(root / TRACKER, f"{iteration}\n")
    torch.distributed.barrier()


def _load_distributed(args, directory: Path, model, optimizer, scheduler) -> Tuple[int, int]:
    from megatron_muon import checkpoint as dist_ckpt

    weights_only = args.finetune or args.no_load_optim
    try:
        extra = dist_ckpt.load_checkpoint(str(directory), model, optimizer, load_optimizer=not weights_only,
                                          per_rank=not args.no_load_rng)
    except dist_ckpt.CheckpointError as e:
        raise CheckpointError(str(e)) from e
    if args.finetune:
        print_rank_0(f"  loaded weights of iteration {extra['iteration']} from {directory} (--finetune: starting at 0)")
        return 0, 0
    if not weights_only:
        scheduler.load_state_dict(extra["scheduler"])
    if not args.no_load_rng:
        if extra.get("per_rank") is not None:
            set_rng_state(extra["per_rank"])
        else:
            print_rank_0("  (RNG states not restored: the checkpoint was saved by a different number of ranks)")
    if extra["layout"] != layout(args):
        print_rank_0(f"  resharded from {extra['layout']}")
    saved_vocab = extra.get("args", {}).get("padded_vocab_size")
    if saved_vocab is not None and saved_vocab != getattr(args, "padded_vocab_size", saved_vocab):
        # Megatron loads the overlap of the embedding and output layer; the other rows keep
        # their fresh initialisation and the padded logits enter the softmax.
        print_rank_0(
            f"WARNING: padded vocab size {args.padded_vocab_size} differs from the checkpoint's {saved_vocab} "
            "(it is padded to a multiple of --make-vocab-size-divisible-by x TP); rows past the smaller size are "
            "freshly initialised. Choose --make-vocab-size-divisible-by so both layouts pad alike."
        )
    torch.distributed.barrier()
    print_rank_0(f"  loaded checkpoint of iteration {extra['iteration']} from {directory.parent}")
    return extra["iteration"], extra["consumed_samples"]


def save_checkpoint(args, iteration: int, consumed_samples: int, model, optimizer, scheduler) -> None:
    """Collective: every rank writes its part, rank 0 publishes the directory."""
    if args.ckpt_format == "torch_dist":
        _save_distributed(args, iteration, consumed_samples, model, optimizer, scheduler)
        print_rank_0(f"  saved checkpoint at iteration {iteration:7d} to {args.save} (torch_dist)")
        return
    rank = torch.distributed.get_rank()
    root = Path(args.save)
    final, tmp = iteration_dir(root, iteration), root / f"{iteration_dir(root, iteration).name}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    torch.distributed.barrier()
    state = {
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "layout": layout(args),
        "model": [chunk.state_dict() for chunk in model],
        "optimizer": None if args.no_save_optim else optimizer_state(optimizer),
        "scheduler": scheduler.state_dict(),
        "rng": rng_state(),
    }
    _atomic_torch_save(state, rank_file(tmp, rank))
    torch.distributed.barrier()
    if rank == 0:
        meta = {"iteration": iteration, "consumed_samples": consumed_samples, "layout": layout(args),
                "args": _plain_args(args)}
        _atomic_write_text(tmp / "metadata.json", json.dumps(meta, indent=1, default=str))
        publish(tmp, final, root, iteration)
    torch.distributed.barrier()
    print_rank_0(f"  saved checkpoint at iteration {iteration:7d} to {args.save}")


def load_checkpoint(args, model, optimizer, scheduler) -> Tuple[int, int]:
    """Load ``--load`` (``--ckpt-step`` or the latest). Returns ``(iteration, consumed_samples)``;
    ``(0, 0)`` with a message when there is no checkpoint (as Megatron-LM)."""
    root = Path(args.load)
    iteration = args.ckpt_step if args.ckpt_step is not None else latest_iteration(root)
    if iteration is None:
        print_rank_0(f"WARNING: no checkpoint found at {root} ({TRACKER} missing); training from scratch.")
        return 0, 0
    if is_distributed_checkpoint(iteration_dir(root, iteration)):
        return _load_distributed(args, iteration_dir(root, iteration), model, optimizer, scheduler)
    rank = torch.distributed.get_rank()
    path = rank_file(iteration_dir(root, iteration), rank)
    if not path.is_file():
        raise CheckpointError(
            f"{path} does not exist: the checkpoint of iteration {iteration} is missing or was saved by a "
            "different number of ranks (same-layout resume only)."
        )
    # On the CPU: RNG states must stay CPU tensors; parameters and optimizer state are
    # copied to their devices by the load_state_dict calls.
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state["layout"] != layout(args) and not args.finetune:
        raise CheckpointError(
            f"checkpoint layout {state['layout']} differs from this run's {layout(args)}; these per-rank "
            "checkpoints resume only at the same parallel layout and optimizer."
        )
    if len(state["model"]) != len(model):
        raise CheckpointError(f"checkpoint has {len(state['model'])} model chunks, this run {len(model)}")
    for chunk, sd in zip(model, state["model"]):
        chunk.load_state_dict(sd, strict=True)
    if args.finetune:
        optimizer.reload_model_params()
        print_rank_0(f"  loaded weights of iteration {iteration} from {root} (--finetune: starting at 0)")
        return 0, 0
    if args.no_load_optim or state["optimizer"] is None:
        optimizer.reload_model_params()
    else:
        load_optimizer_state(optimizer, state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    if not args.no_load_rng:
        set_rng_state(state["rng"])
    torch.distributed.barrier()
    print_rank_0(f"  loaded checkpoint of iteration {iteration} from {root}")
    return state["iteration"], state["consumed_samples"]
