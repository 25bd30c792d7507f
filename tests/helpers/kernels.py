"""Which CPU kernels torch runs in this environment: what decides the bits of a CPU run.

A CPU's model name does not (two "AMD EPYC" machines rounded bf16 runs differently). What
does, measured on the refactor guard's runs (``tests/dist/test_refactor_guard.py``):

* the torch build (and the Megatron-core release, whose layers call the kernels);
* MKL's code path, which runs fp32 matrix products: ``MKL_ENABLE_INSTRUCTIONS=AVX2`` on an
  AVX-512 Xeon changes every fp32 run;
* oneDNN's instruction set, which runs bf16 matrix products where the CPU has bf16
  instructions: ``ONEDNN_MAX_CPU_ISA=AVX2`` changes the bf16 runs only;
* the CPU's vendor: MKL picks its kernels by it (an AMD EPYC's fp32 runs match none of the
  code paths that MKL can be told to take on an Intel Xeon);
* ATen's own vector kernels (``torch.backends.cpu.get_cpu_capability()``, which
  ``ATEN_CPU_CAPABILITY`` sets): ``default`` changes every run; ``avx2`` changed none of
  the guarded runs on an AVX-512 Xeon, but it is part of the key all the same.

Each rank of the test harness runs one thread, so the thread count is not part of it.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict

KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
"""The environment variables that make torch's libraries run another CPU's kernels."""

_PROBE = """
import importlib.metadata, json, torch
torch.set_num_threads(1)
x = torch.ones(64, 64)
with torch.backends.mkl.verbose(torch.backends.mkl.VERBOSE_ON):
    x @ x
with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
    x.bfloat16() @ x.bfloat16()
print("KERNELS " + json.dumps(dict(
    torch=torch.__version__,
    megatron_core=importlib.metadata.version("megatron-core"),
    aten=torch.backends.cpu.get_cpu_capability(),
)), flush=True)
"""
"""Runs one fp32 and one bf16 matrix product with MKL's and oneDNN's verbose logs on: the
first line of each names the code path the library chose (a library torch does not call
for that product prints nothing)."""


def _cpu_vendor() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.exists() else ""
    found = re.search(r"^vendor_id\s*:\s*(\S+)", text, re.M)
    return found.group(1) if found else "unknown"


@functools.lru_cache(maxsize=None)
def kernel_key() -> Dict[str, str]:
    """This environment's kernels (what a spawned rank inherits), read in a fresh process:
    the libraries print which code path they chose once, on their first call."""
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True).stdout
    key = json.loads(out.split("KERNELS ", 1)[1])
    mkl = re.search(r"^MKL_VERBOSE .*? architecture (.+?), (?:Lnx|Win|Mac|Osx)", out, re.M)
    onednn = re.search(r"^onednn_verbose,.*?info,cpu,isa:(.+)$", out, re.M)
    key["mkl"] = mkl.group(1) if mkl else "not used for fp32 matrix products"
    key["onednn"] = onednn.group(1).strip() if onednn else "not used for bf16 matrix products"
    key["vendor"] = _cpu_vendor()
    return key
