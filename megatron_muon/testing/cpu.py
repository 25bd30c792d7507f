"""The CPU patches, re-exported for the test harness (they live in :mod:`megatron_muon.cpu`)."""

from megatron_muon.cpu import (  # noqa: F401
    CudaToCpuMode,
    cpu_patches,
    install_cpu_patches,
    patches_installed,
    uninstall_cpu_patches,
)
