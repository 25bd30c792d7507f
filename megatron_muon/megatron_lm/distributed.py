"""Device, backend, process groups and seeds.

* With a CUDA device: NCCL, one GPU per local rank (``torchrun`` sets ``LOCAL_RANK``).
* Without one: the CPU/gloo harness of :mod:`megatron_muon.testing.cpu` (Megatron-core
  run on the CPU), so the same command works on a laptop. ``torch.compile`` (Megatron's
  ``jit_fuser``) is disabled there unless ``MEGATRON_MUON_CPU_COMPILE=1``.
* Launched by ``torchrun`` (``WORLD_SIZE`` etc. set) the default ``env://`` rendezvous is
  used; launched by plain ``python`` a one-rank group is created in-process.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import random
import numpy as np
import torch


def use_cuda() -> bool:
    """True when this process should run on a GPU."""
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(args: argparse.Namespace) -> str:
    """Pick the device, initialise ``torch.distributed`` and Megatron's ``parallel_state``.

    Returns the backend in use (``'nccl'`` or ``'gloo'``).
    """
    cuda = use_cuda()
    if not cuda:
        from megatron_muon.testing.cpu import install_cpu_patches

        install_cpu_patches()
        # On the CPU the "CUDA" RNG is the CPU generator, so this warning fires on every
        # tensor-parallel RNG fork; it says nothing there.
        logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
        if os.environ.get("MEGATRON_MUON_CPU_COMPILE", "0") != "1":
            # Megatron's jit_fuser is torch.compile: on the CPU its first-call compile costs
            # seconds per fused function (13 s for a tiny MLA MoE) and gains nothing here.
            torch._dynamo.config.disable = True
    backend = args.distributed_backend or ("nccl" if cuda else "gloo")
    timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
    if not torch.distributed.is_initialized():
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        if "RANK" in os.environ and "MASTER_ADDR" in os.environ:
            torch.distributed.init_process_group(backend, timeout=timeout)
        else:
            store = torch.distributed.HashStore()
            torch.distributed.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
    )
    return backend


def set_random_seed(seed: int) -> None:
    """Megatron-LM's seeding: a different seed per pipeline stage, the same across TP/DP
    (the TP RNG tracker gives tensor-parallel ranks their own streams)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def is_logging_rank() -> bool:
    """The first rank of the last pipeline stage (TP, CP and DP rank 0): it prints the log."""
    from megatron.core import parallel_state

    return (
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    )


def print_rank_0(message: str) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(message, flush=True)


def print_logging_rank(message: str) -> None:
    if is_logging_rank():
        print(message, flush=True)


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
