#!/usr/bin/env python
"""Newton–Schulz accuracy on real model shapes: standard vs Gram, fp32 vs a 16-bit compute
dtype, each against the same quintic iteration in float64.

For each shape (real matrices of Llama-3 8B and DeepSeek-V3, aspect ratios 1 to 16) and input (gaussian, and
ill-conditioned: singular values log-spaced over four decades, like a momentum of low
effective rank) it prints the relative Frobenius distance of ``newton_schulz(method=...)``
in fp32 and in bf16 (Gram NS computes in fp16 for it) to the float64 iteration, and the
time of each fp32 call on this machine.

On a CPU, fp16 GEMMs can be orders of magnitude slower than bf16 ones (no fp16 matrix
instructions; the script prints both rates). There the fp16 products of Gram NS are
emulated as a GPU runs them: fp16 operands, fp32 accumulation, the result rounded to fp16
(``--emulate-fp16``, the default on a CPU), so the distances are the GPU's, and the bf16
times are not reported. Results go to ``--out`` (default ``runs/bench``).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch.overrides import TorchFunctionMode

from tools.bench import common

# (label, rows, cols): the logical (out, in) matrices Muon sees.
SHAPES = [
    ("Llama-3 8B attention out 4096x4096", 4096, 4096),
    ("DeepSeek-V3 expert fc1 4096x7168", 4096, 7168),
    ("DeepSeek-V3 expert fc2 7168x2048", 7168, 2048),
    ("DeepSeek-V3 MLA q up 24576x1536", 24576, 1536),
]
QUICK_SHAPES = [
    (" ".join(label.split()[:-1]) + f" {m // 16}x{n // 16} (sides / 16)", m // 16, n // 16) for label, m, n in SHAPES
]
_PRODUCTS = {"matmul", "__matmul__", "mm", "bmm", "addmm", "baddbmm"}


class Fp16GemmAsOnGpu(TorchFunctionMode):
    """Products of fp16 tensors computed in fp32 and rounded to fp16 once: what a GPU's
    fp16 GEMM with fp32 accumulation returns (up to the order of the sums)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if getattr(func, "__name__", "") in _PRODUCTS and tensors and all(t.dtype == torch.float16 for t in tensors):
            up = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
            return func(*up, **kwargs).half()
        return func(*args, **kwargs)


def float64_iteration(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The quintic iteration in float64, written out here (independent of our kernels)."""
    from megatron_muon.newton_schulz import resolve_coefficients

    X = G.double()
    tall = X.size(0) > X.size(1)
    X = X.mT if tall else X
    X = X / X.norm()
    for a, b, c in resolve_coefficients("quintic").schedule(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


def ill_conditioned(m: int, n: int, gen: torch.Generator) -> torch.Tensor:
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=gen, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=torch.float64))
    s = torch.logspace(0, -4, k, dtype=torch.float64)
    return ((U * s) @ V.mT).float()


def gemm_rate(dtype: torch.dtype, size: int = 1024) -> float:
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    t = time.perf_counter()
    a @ b
    return 2 * size**3 / (time.perf_counter() - t) / 1e9


def measure(shapes, emulate: bool, device: str) -> List[Dict[str, Any]]:
    from megatron_muon.rule import newton_schulz

    gen = torch.Generator().manual_seed(0)
    rows = []
    for label, m, n in shapes:
        for kind in ("gaussian", "ill-conditioned"):
            G = torch.randn(m, n, generator=gen) if kind == "gaussian" else ill_conditioned(m, n, gen)
            exact = float64_iteration(G)
            row: Dict[str, Any] = dict(shape=label, aspect=round(max(m, n) / min(m, n), 2), input=kind)
            Gd = G.to(device)
            for method in ("standard", "gram"):
                for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
                    fp16_inside = emulate and dtype != torch.float32 and method == "gram"
                    common.synchronize(device)
                    t = time.perf_counter()
                    with Fp16GemmAsOnGpu() if fp16_inside else contextlib.nullcontext():
                        X = newton_schulz(Gd, compute_dtype=dtype, method=method)
                    common.synchronize(device)
                    row[f"{method} {tag}"] = float((X.double().cpu() - exact).norm() / exact.norm())
                    if tag == "fp32" or device != "cpu":
                        row[f"{method} {tag} s"] = round(time.perf_counter() - t, 3)
            print(row, flush=True)
            rows.append(row)
    return rows


def markdown(data: Dict[str, Any]) -> str:
    rows = data["rows"]
    cols = ["standard fp32", "gram fp32", "standard bf16", "gram bf16", "standard fp32 s", "gram fp32 s"]
    table = common.md_table(
        ["shape", "aspect", "input", *cols],
        [[r["shape"], r["aspect"], r["input"], *[r.get(c, "") for c in cols]] for r in rows],
    )
    rates = ", ".join(f"{k} {v:.1f}" for k, v in data["gemm_gflops"].items())
    note = " (Gram's fp16 products emulated as on a GPU)" if data["emulated"] else ""
    return (
        f"{common.provenance(data['env'])}\n\nRelative distance to the float64 iteration{note}; "
        f"times of the fp32 calls. GEMM GFLOP/s here: {rates}.\n\n{table}\n"
    )


def main(argv=None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="every side divided by 16 (seconds)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--emulate-fp16", choices=["auto", "yes", "no"], default="auto", help="default: on a CPU")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=common.DEFAULT_OUT)
    p.add_argument("--name", default="ns_accuracy")
    args = p.parse_args(argv)
    device = common.pick_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    emulate = args.emulate_fp16 == "yes" or (args.emulate_fp16 == "auto" and device == "cpu")
    rates = {str(d).replace("torch.", ""): gemm_rate(d) for d in (torch.float64, torch.float32, torch.bfloat16)}
    rates["float16"] = gemm_rate(torch.float16, 256)
    data = dict(env=common.environment(device), gemm_gflops=rates, emulated=emulate)
    data["rows"] = measure(QUICK_SHAPES if args.quick else SHAPES, emulate, device)
    common.write_outputs(args.out, args.name, data, markdown(data))
    print(markdown(data))
    return data


if __name__ == "__main__":
    main()
