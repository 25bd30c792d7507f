"""The optimizer and the learning-rate / weight-decay scheduler.

``--optimizer adam|sgd``: Megatron-core's own ``get_megatron_optimizer`` (the
DistributedOptimizer; for SGD, which it rejects, Megatron's non-distributed optimizer). ``--optimizer muon``: :func:`megatron_muon.get_muon_optimizer` with a
:class:`megatron_muon.MuonConfig` built from the same arguments plus the generated
``--muon-*`` flags. The scheduler is Megatron-core's ``OptimizerParamScheduler``, stepped
in samples as Megatron-LM does.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Dict, List

import torch

from . import muon_args

# Arguments that share a name with an OptimizerConfig field but are not passed to it.
_NOT_PASSED = {"overlap_param_gather"}


def optimizer_config(args: argparse.Namespace):
    """``OptimizerConfig`` (adam / sgd) or ``MuonConfig`` (muon) from the arguments."""
    from megatron.core.optimizer import OptimizerConfig

    from megatron_muon import MuonConfig

    cls = MuonConfig if args.optimizer == "muon" else OptimizerConfig
    kw: Dict[str, Any] = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(cls)
        if hasattr(args, f.name) and not f.name.startswith("muon_") and f.init and f.name not in _NOT_PASSED
    }
    kw.update(
        optimizer=args.optimizer, use_distributed_optimizer=args.use_distributed_optimizer,
        params_dtype=args.params_dtype,
    )
    if args.optimizer == "muon":
        kw.update(muon_args.muon_kwargs(args))
    return cls(**kw)


def build_optimizer(args: argparse.Namespace, model: List[torch.nn.Module]):
    """The optimizer over the DDP-wrapped model chunks."""
    config = optimizer_config(args)
    if args.optimizer == "muon":
        from megatron_muon import get_muon_optimizer

        return get_muon_optimizer(config, model)
    from megatron.core.optimizer import get_megatron_optimizer

    return get_megatron_optimizer(config, model)


def build_scheduler(args: argparse.Namespace, optimizer):
    """Megatron-LM's ``OptimizerParamScheduler`` for iteration-based training (in samples)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    gbs = args.global_batch_size
    wsd = args.lr_wsd_decay_iters * gbs if args.lr_wsd_decay_iters is not None else None
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay,
        wd_incr_steps=args.train_iters * gbs,
        wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=True,
        override_opt_param_scheduler=False,
        wsd_decay_steps=wsd,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
    )


def current_lr(optimizer) -> float:
    """The learning rate of the first parameter group (what Megatron-LM logs)."""
    for group in optimizer.param_groups:
        return float(group["lr"])
    return 0.0
