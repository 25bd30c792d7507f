"""Run real Megatron-core models on the CPU with gloo: for our tests and for laptop debugging.

Importing this package changes nothing; ``install_cpu_patches()`` (called for you in every
rank that ``run_distributed`` starts) applies the CPU stand-ins.
"""

from ..megatron_lm.cpu import cpu_patches, install_cpu_patches, patches_installed, uninstall_cpu_patches
from .launcher import DistributedTestError, ParallelLayout, run_distributed

__all__ = [
    "DistributedTestError",
    "ParallelLayout",
    "cpu_patches",
    "install_cpu_patches",
    "patches_installed",
    "run_distributed",
    "uninstall_cpu_patches",
]
