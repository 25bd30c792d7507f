"""What Megatron-LM's training code (the ``megatron.training`` of the megatron-core wheel)
needs to run where it did not expect to: with no GPU, and from a wheel.

One small function per patch, applied by :func:`install` (idempotent), next to
:func:`megatron_muon.cpu.install_cpu_patches` for Megatron-core's own CUDA calls. Megatron-LM
features that need a GPU (transformer-engine, FP8, CUDA graphs, NCCL-only options, fused
kernels) stay unavailable on the CPU: docs/usage.md lists them.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from typing import Any, Dict

import torch

_APPLIED: Dict[str, Any] = {}


def use_cuda() -> bool:
    """True when this process should run on a GPU."""
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def helpers_compiled() -> bool:
    """Whether Megatron-core's compiled dataset index helpers import."""
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def skip_helpers_build() -> None:
    """``initialize_megatron`` runs ``compile_helpers()`` (``make``) on rank 0, but the wheel
    ships the compiled ``helpers_cpp`` without its Makefile: skip the build when it imports."""
    import megatron.core.datasets.utils as dataset_utils

    if "compile_helpers" in _APPLIED or not helpers_compiled():
        return
    original = dataset_utils.compile_helpers
    _APPLIED["compile_helpers"] = original

    @functools.wraps(original)
    def compile_helpers() -> None:
        if not helpers_compiled():
            original()

    dataset_utils.compile_helpers = compile_helpers


def allow_cpu_initialization() -> None:
    """``pretrain`` calls ``initialize_megatron(allow_no_cuda=True)`` (Megatron's own switch
    past its ``torch.cuda.is_available()`` assert)."""
    import megatron.training.training as training

    if "initialize_megatron" in _APPLIED:
        return
    original = training.initialize_megatron
    _APPLIED["initialize_megatron"] = original
    training.initialize_megatron = functools.wraps(original)(functools.partial(original, allow_no_cuda=True))


def no_device_architecture() -> None:
    """``validate_args`` asks the GPU's architecture (``get_device_arch_version``) with TP or
    CP > 1, only to choose a performance warning; without a GPU the answer is 0. The same
    check then requires ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (an ordering of GPU kernels, moot
    here): set it unless set."""
    import megatron.training.arguments as arguments

    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if "get_device_arch_version" not in _APPLIED:
        _APPLIED["get_device_arch_version"] = arguments.get_device_arch_version
        arguments.get_device_arch_version = lambda: 0


def quiet_cpu_rng_warning() -> None:
    """On the CPU the "CUDA" RNG is the CPU generator, and Megatron's tracker warns about it
    at every tensor-parallel fork: silence that logger only."""
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)


def quiet_missing_extension_notices() -> None:
    """Megatron-core warns at import, once per module, that transformer-engine / Apex are
    absent (and torch that CUDA is): expected without a GPU, so not repeated on every run."""
    for text in (".*Transformer Engine and Apex are not installed", ".*Apex is not installed",
                 ".*transformer-engine>=1.7.0 supports MoE experts"):
        warnings.filterwarnings("ignore", message=text)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)


def install() -> bool:
    """Apply the patches this machine needs. Returns whether the CPU path is in use."""
    if not use_cuda():
        quiet_missing_extension_notices()
    skip_helpers_build()
    if use_cuda():
        return False
    from megatron_muon.cpu import install_cpu_patches

    install_cpu_patches()
    allow_cpu_initialization()
    no_device_architecture()
    quiet_cpu_rng_warning()
    # Megatron's jit_fuser compiles each fused function: seconds each on the CPU, no gain.
    if os.environ.get("MEGATRON_MUON_CPU_COMPILE", "0") != "1":
        torch._dynamo.config.disable = True
    return True
