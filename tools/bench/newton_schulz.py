#!/usr/bin/env python
"""Newton–Schulz throughput: our kernel against the other implementations, in TFLOP/s.

Implementations (5 steps of Keller Jordan's quintic (3.4445, -4.7750, 2.0315) in bf16 in
all of them, fp32 input as the optimizers hand it over, output back in the input dtype):

* ``megatron_muon``: ``megatron_muon.newton_schulz.newton_schulz`` (stacks batched);
  ``megatron_muon gram``: the same with ``method="gram"`` (Gram Newton–Schulz, fp16
  inside); ``megatron_muon compiled``: ``compiled=True`` (GPU runs only, or ``--compile``);
* ``torch.optim.Muon``: torch's own iteration, ``torch.optim._muon._zeropower_via_newtonschulz``
  (the internal function ``torch.optim.Muon.step`` calls for every parameter; 2-D only,
  so a stack is looped);
* ``emerging_optimizers``: ``emerging_optimizers.orthogonalized_optimizers.muon_utils.newton_schulz``
  with ``coefficient_type="simple"`` under ``torch.set_float32_matmul_precision("medium")``
  (how Megatron-core's Muon runs it: bf16 compute), stacks batched.

Each call is timed from the fp32 input to the result (cast, normalisation, iterations,
cast back), after warm-up, with the device synchronised; the implementations take turns
call by call, so load from other processes does not favour one of them. Rates come from the
median call on a GPU and from the fastest call on a CPU (``--stat``), where other processes
otherwise decide the numbers. FLOPs are
``newton_schulz_flops`` (the three matmuls per step). The fraction of peak uses the
device's dense bf16 peak (H100 SXM / H200: 989 TFLOP/s); on the CPU it uses the bf16
matmul rate measured on this machine (a square GEMM, one thread like the rest of the CPU
run), labelled as measured.

Shapes: real model matrices (Llama-3 8B's 4096x4096 and 4096x14336, a stack of 64
DeepSeek-V3-style experts 2048x7168, DeepSeek-V3's dense fc1 7168x36864 and MLA query
up-projection 1536x24576) on a GPU; ``--quick`` (the CPU default) divides every side by 16
and the expert count by 8, since the real shapes take minutes per call on a CPU (plus a
256x1024, aspect ratio exactly 4). ``--shapes recipes``: the logical matrices Muon sees in
recipes' models (``--recipes``), as our layout rules split them (Q/K/V parts, per-expert
matrices, MLA parts), the shapes that carry most of each model's Newton–Schulz FLOPs;
experts as stacks, as the planner batches them.

On a GPU the fraction of peak is taken against the bf16 matrix-multiply rate measured in
the same run (an 8192-cube GEMM, median call); the datasheet peak is recorded beside it.

A second table puts Gram NS next to standard NS per shape: counted FLOPs
(``newton_schulz_flops(method=...)``), the ratio of the median call times (the two take
turns call by call) and each one's distance to fp32 standard NS, on a gaussian input and
on an ill-conditioned one (singular values log-spaced over four decades, like a momentum
matrix of low effective rank).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench import common

# (label, batch, rows, cols)
FULL_SHAPES = [
    ("4096x4096", 1, 4096, 4096),
    ("4096x14336", 1, 4096, 14336),
    ("64 x 2048x7168 (experts)", 64, 2048, 7168),
    ("7168x36864 (DeepSeek-V3 fc1)", 1, 7168, 36864),
    ("1536x24576 (MLA q up)", 1, 1536, 24576),
]
QUICK_SHAPES = [
    ("256x256", 1, 256, 256),
    ("256x896", 1, 256, 896),
    ("8 x 128x448 (experts)", 8, 128, 448),
    ("256x1024", 1, 256, 1024),
    ("448x2304 (DeepSeek-V3 fc1)", 1, 448, 2304),
    ("96x1536 (MLA q up)", 1, 96, 1536),
]

# Dense bf16 tensor-core peaks (no sparsity), TFLOP/s, by torch.cuda.get_device_name().
PEAKS = [("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4), ("GH200", 989.4), ("A100", 312.0)]
STEPS = 5
KJ = (3.4445, -4.7750, 2.0315)


RECIPES = ("llama3_8b", "moonlight_16b_a3b", "deepseek_v3")
STACK_BYTES = 1 << 30
"""The largest fp32 input stack a recipe shape is timed with (experts come in hundreds)."""


def recipe_shapes(recipes: Sequence[str], per_recipe: int = 2) -> List[Tuple[str, int, int, int]]:
    """(label, batch, rows, cols) of the logical matrices Muon sees in each recipe's model
    (TP1: our Newton–Schulz runs on whole matrices), the ``per_recipe`` shapes with the most
    Newton–Schulz FLOPs per model and, for MLA models, the MLA part with the most; a shape's stack is its count per layer (at most
    ``STACK_BYTES`` of fp32 input). Reads the recipes through Megatron-LM's own parser."""
    from collections import Counter

    from megatron_muon import MuonConfig
    from megatron_muon.newton_schulz import newton_schulz_flops
    from tools.bench import model_shapes, scale_model

    cfg = MuonConfig(lr=0.01)
    out = []
    for recipe in recipes:
        m = model_shapes.from_recipe(recipe, gpus=1, tp=1, pp=1, ep=1)
        count: Counter = Counter()
        mla = set()
        for sp in model_shapes.stage_params(m, 0, 1, 1, 1, 1):
            if sp.is_matrix:
                for lm in scale_model._logical(sp, m, cfg, 1).matrices:
                    count[(tuple(lm.ns_shape), sp.expert)] += 1
                    if sp.parent_kind == "mla":
                        mla.add((tuple(lm.ns_shape), sp.expert))
        flops = {key: n * newton_schulz_flops(*key[0], STEPS) for key, n in count.items()}
        ranked = sorted(flops, key=flops.get, reverse=True)
        chosen = ranked[:per_recipe] + [k for k in ranked if k in mla][:1]  # an MLA part, where there is one
        for (rows, cols), expert in dict.fromkeys(chosen):
            layers = sum(1 for n in m.moe_pattern if n) if expert else m.num_layers
            per_layer = max(1, count[((rows, cols), expert)] // max(layers, 1))
            batch = max(1, min(per_layer, STACK_BYTES // (4 * rows * cols)))
            what = f"{batch} experts" if expert else (f"{batch} per layer" if batch > 1 else "")
            if ((rows, cols), expert) in mla:
                what = ", ".join(filter(None, ["MLA", what]))
            out.append((f"{recipe} {rows}x{cols}" + (f" ({what})" if what else ""), batch, rows, cols))
    return out


def gpu_peak_tflops(name: str) -> Optional[float]:
    for key, peak in PEAKS:
        if key in name:
            return peak
    return None


def measured_matmul_tflops(device: str, size: int, reps: int = 5, stat: str = "best") -> float:
    """bf16 GEMM rate of this device over ``reps`` calls after three warm-up calls, from the
    fastest (``stat="best"``) or the median call: the peak the fractions are taken against."""
    import torch

    a = torch.randn(size, size, device=device).bfloat16()
    b = torch.randn(size, size, device=device).bfloat16()
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        common.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        common.synchronize(device)
        times.append(time.perf_counter() - t0)
    return 2 * size**3 / (min(times) if stat == "best" else common.median(times)) / 1e12


@contextlib.contextmanager
def _matmul_precision(value: str):
    import torch

    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(value)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


def implementations(device: str, compile_ours: bool) -> Dict[str, Tuple[Optional[Callable], str]]:
    """name -> (function of the fp32 input, note); function None when unavailable."""
    import torch

    from megatron_muon.rule import newton_schulz

    impls: Dict[str, Tuple[Optional[Callable], str]] = {
        "megatron_muon": (lambda g: newton_schulz(g, STEPS, "quintic", torch.bfloat16), "batched"),
        "megatron_muon gram": (
            lambda g: newton_schulz(g, STEPS, "quintic", torch.bfloat16, method="gram"),
            "Gram NS, fp16 inside, restart after 3 steps",
        ),
    }
    if compile_ours:
        impls["megatron_muon compiled"] = (
            lambda g: newton_schulz(g, STEPS, "quintic", torch.bfloat16, compiled=True),
            "batched, torch.compile",
        )
        impls["megatron_muon gram compiled"] = (
            lambda g: newton_schulz(g, STEPS, "quintic", torch.bfloat16, compiled=True, method="gram"),
            "Gram NS, torch.compile",
        )
    try:
        from torch.optim._muon import _zeropower_via_newtonschulz

        def torch_muon(g):
            if g.ndim == 2:
                return _zeropower_via_newtonschulz(g, KJ, STEPS, 1e-7)
            return torch.stack([_zeropower_via_newtonschulz(m, KJ, STEPS, 1e-7) for m in g])

        impls["torch.optim.Muon"] = (torch_muon, "2-D only: stacks looped")
    except ImportError as exc:
        impls["torch.optim.Muon"] = (None, f"not available: {exc}")
    try:
        from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz as eo_ns

        def emerging(g):
            with _matmul_precision("medium"):
                return eo_ns(g, STEPS, "simple")

        impls["emerging_optimizers"] = (emerging, "batched, bf16 via matmul precision 'medium'")
    except ImportError as exc:
        impls["emerging_optimizers"] = (None, f"not available: {exc}")
    return impls


def time_interleaved(fns: Dict[str, Callable], x, device: str, warmup: int, reps: int) -> Dict[str, List[float]]:
    """Seconds of every call of each function; the functions take turns, so a burst of
    load from other processes hits all of them rather than one."""
    for _ in range(warmup):
        for fn in fns.values():
            fn(x)
    times: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            common.synchronize(device)
            t0 = time.perf_counter()
            fn(x)
            common.synchronize(device)
            times[name].append(time.perf_counter() - t0)
    return times


def run(args: argparse.Namespace, progress: Optional[Callable[[Dict[str, Any]], None]] = None) -> Dict[str, Any]:
    """Every shape's timings; ``progress`` gets the rows so far after each shape."""
    import torch

    from megatron_muon.newton_schulz import newton_schulz_flops
    from megatron_muon.rule import newton_schulz

    device = common.pick_device(args.device)
    if device == "cpu":
        # One thread: OpenMP's spinning barriers make multi-threaded GEMMs erratic (10-100x)
        # as soon as another process wants the same cores.
        torch.set_num_threads(args.threads)
    quick = args.quick or (device == "cpu" and not args.full)
    if args.shapes == "recipes":
        shapes = recipe_shapes([r.strip() for r in args.recipes.split(",")])
    else:
        shapes = QUICK_SHAPES if quick else FULL_SHAPES
    warmup, reps = (2, 9) if quick else (3, 10)
    warmup, reps = args.warmup if args.warmup is not None else warmup, args.reps or reps
    datasheet = None
    if device == "cpu":
        peak = measured_matmul_tflops(device, 1024 if quick else 2048)
        peak_note = f"measured bf16 GEMM rate of this CPU, {args.threads} thread(s)"
    else:
        datasheet = args.peak_tflops or gpu_peak_tflops(torch.cuda.get_device_name())
        peak = measured_matmul_tflops(device, 8192, reps=10, stat="median")
        peak_note = f"measured bf16 GEMM rate of this {torch.cuda.get_device_name()}, 8192-cube, median call" + (
            f"; datasheet {datasheet:.0f} TFLOP/s" if datasheet else ""
        )
    wanted = [n.strip() for n in args.impls.split(",")] if args.impls else []
    compile_ours = (
        args.compile if args.compile is not None else device == "cuda" or any("compiled" in n for n in wanted)
    )
    impls = implementations(device, compile_ours)
    if wanted:
        unknown = sorted(set(wanted) - set(impls) - {"megatron_muon", "megatron_muon gram"})
        if unknown:
            raise SystemExit(f"--impls: unknown {unknown}; choose from {sorted(impls)}")
        # ours (standard and Gram, eager) stay: the speed-ups and the Gram table are taken against them
        impls = {n: v for n, v in impls.items() if n in wanted or n in ("megatron_muon", "megatron_muon gram")}
    # A shared CPU's other processes slow random calls down; the fastest call is the
    # undisturbed cost there. A GPU is ours alone: the median.
    stat = args.stat or ("best" if device == "cpu" else "median")
    gen = torch.Generator(device=device).manual_seed(0)
    rows: List[Dict[str, Any]] = []
    done = []
    for label, batch, m, n in shapes:
        shape = (batch, m, n) if batch > 1 else (m, n)
        x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        reference = newton_schulz(x, STEPS, "quintic", torch.float32)
        available = {name: fn for name, (fn, _) in impls.items() if fn is not None}
        seconds = time_interleaved(available, x, device, warmup, reps)
        for name, (fn, note) in impls.items():
            # Gram Newton–Schulz does fewer FLOPs for the same result: its rate counts its own.
            flops = newton_schulz_flops(m, n, STEPS, batch, "gram" if "gram" in name else "standard")
            row: Dict[str, Any] = dict(shape=label, batch=batch, m=m, n=n, impl=name, note=note, flops=flops)
            if fn is None:
                row.update(ms=None, best_ms=None, tflops=None, peak_fraction=None, rel_err=None)
            else:
                out = fn(x).float()
                median, best = common.median(seconds[name]), min(seconds[name])
                rate = flops / (best if stat == "best" else median) / 1e12
                row.update(
                    ms=median * 1e3,
                    best_ms=best * 1e3,
                    tflops=rate,
                    peak_fraction=rate / peak if peak else None,
                    rel_err=float((out - reference).norm() / reference.norm()),
                )
            rows.append(row)
        del x, reference
        done.append((label, batch, m, n))
        if progress is not None:
            progress(dict(rows=rows, shapes_done=len(done), shapes=len(shapes), peak_tflops=peak, peak_note=peak_note))
    key = "best_ms" if stat == "best" else "ms"
    gram = gram_rows(rows, done, device, gen)
    ours = {r["shape"]: r[key] for r in rows if r["impl"] == "megatron_muon"}
    for r in rows:
        r["speedup_of_ours"] = r[key] / ours[r["shape"]] if r[key] else None
    return dict(
        env=common.environment(device),
        quick=quick,
        steps=STEPS,
        peak_tflops=peak,
        peak_note=peak_note,
        datasheet_peak_tflops=datasheet,
        shape_set=args.shapes if args.shapes == "recipes" else ("quick" if quick else "full"),
        warmup=warmup,
        reps=reps,
        stat=stat,
        threads=torch.get_num_threads() if device == "cpu" else None,
        rows=rows,
        gram=gram,
    )


def _ill_conditioned(batch: int, m: int, n: int, device: str, gen) -> Any:
    """``U diag(s) V^T`` with ``s`` log-spaced from 1 to 1e-4 (per matrix of the stack)."""
    import torch

    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(batch, m, k, generator=gen, device=device))
    V, _ = torch.linalg.qr(torch.randn(batch, n, k, generator=gen, device=device))
    s = torch.logspace(0, -4, k, device=device)
    out = (U * s) @ V.mT
    return out[0] if batch == 1 else out


def gram_rows(rows: List[Dict[str, Any]], shapes, device: str, gen) -> List[Dict[str, Any]]:
    """Gram vs standard NS per shape: FLOPs, median-time ratio (from the interleaved calls
    above), distance to fp32 standard NS on a gaussian and an ill-conditioned input."""
    import torch

    from megatron_muon.newton_schulz import newton_schulz_flops
    from megatron_muon.rule import newton_schulz

    def dist(method: str, x) -> float:
        ref = newton_schulz(x, STEPS, "quintic", torch.float32)
        out = newton_schulz(x, STEPS, "quintic", torch.bfloat16, method=method).float()
        return float((out - ref).norm() / ref.norm())

    by = {(r["shape"], r["impl"]): r for r in rows}
    out = []
    for label, batch, m, n in shapes:
        std, gram = by[(label, "megatron_muon")], by[(label, "megatron_muon gram")]
        ill = _ill_conditioned(batch, m, n, device, gen)
        out.append(
            dict(
                shape=label,
                aspect=max(m, n) / min(m, n),
                flops_ratio=newton_schulz_flops(m, n, STEPS, batch, "gram") / newton_schulz_flops(m, n, STEPS, batch),
                time_ratio=gram["ms"] / std["ms"],
                best_time_ratio=gram["best_ms"] / std["best_ms"],
                dist_standard=std["rel_err"],
                dist_gram=gram["rel_err"],
                dist_standard_ill=dist("standard", ill),
                dist_gram_ill=dist("gram", ill),
            )
        )
        del ill
    return out


def markdown(data: Dict[str, Any]) -> str:
    rows = [
        [
            r["shape"],
            r["impl"],
            r["ms"],
            r["best_ms"],
            r["tflops"],
            r["peak_fraction"],
            r["speedup_of_ours"],
            r["rel_err"],
            r["note"],
        ]
        for r in data["rows"]
    ]
    stat = data["stat"]
    table = common.md_table(
        [
            "shape",
            "implementation",
            "median ms",
            "best ms",
            f"TFLOP/s ({stat})",
            "of peak",
            f"time / ours ({stat})",
            "rel. diff vs fp32 NS",
            "note",
        ],
        rows,
    )
    peak = f"{data['peak_tflops']:.3g} TFLOP/s ({data['peak_note']})" if data["peak_tflops"] else data["peak_note"]
    gram_table = common.md_table(
        [
            "shape",
            "aspect",
            "FLOPs gram / std",
            "median time gram / std",
            "best time gram / std",
            "dist. std (gaussian)",
            "dist. gram (gaussian)",
            "dist. std (ill-cond.)",
            "dist. gram (ill-cond.)",
        ],
        [
            [
                g["shape"],
                g["aspect"],
                g["flops_ratio"],
                g["time_ratio"],
                g["best_time_ratio"],
                g["dist_standard"],
                g["dist_gram"],
                g["dist_standard_ill"],
                g["dist_gram_ill"],
            ]
            for g in data["gram"]
        ],
    )
    sizes = (
        "the recipes' logical matrices (TP1)"
        if data.get("shape_set") == "recipes"
        else "quick sizes (every side / 16, experts / 8; the real shapes are for GPUs)"
        if data["quick"]
        else "real sizes"
    )
    return (
        f"{data['steps']} Newton–Schulz steps, bf16 compute, fp32 input, {sizes}; {data['reps']} calls per "
        f"implementation after {data['warmup']} warm-up calls, taking turns; rates from the "
        f"{'fastest call' if data['stat'] == 'best' else 'median call'}. Peak: {peak}.\n\n"
        f"{common.provenance(data['env'])}\n\n{table}\n"
        f"\n**Gram vs standard Newton–Schulz** (both bf16 compute; Gram computes in fp16 inside). "
        f"Time ratio: Gram's median call over standard's (interleaved calls); distance: relative "
        f"Frobenius distance to fp32 standard NS.\n\n{gram_table}\n"
    )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small shapes (the default on a CPU)")
    p.add_argument("--full", action="store_true", help="real shapes even on a CPU (slow)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time our torch.compile-d kernel (default: on a GPU)",
    )
    p.add_argument("--peak-tflops", type=float, help="dense bf16 peak of the GPU (default: known devices)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    p.add_argument("--warmup", type=int, help="warm-up calls per implementation (default 2 quick, 3 full)")
    p.add_argument("--reps", type=int, help="timed calls per implementation (default 9 quick, 10 full)")
    p.add_argument(
        "--stat",
        choices=["median", "best"],
        help="which call sets the rates (default: best on a CPU shared with other work, median on a GPU)",
    )
    p.add_argument(
        "--shapes",
        choices=["sizes", "recipes"],
        default="sizes",
        help="sizes: the fixed list (quick or full); recipes: the logical matrices of --recipes' models",
    )
    p.add_argument("--recipes", default=",".join(RECIPES), help="with --shapes recipes (comma-separated)")
    p.add_argument(
        "--impls", help="comma-separated implementations to time besides ours (default: all that are available)"
    )
    p.add_argument("--out", type=Path, default=common.DEFAULT_OUT)
    p.add_argument("--name", default="newton_schulz")
    return p.parse_args(argv)


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    partial = args.out / f"{args.name}.partial.json"

    def progress(so_far: Dict[str, Any]) -> None:  # what a time box that stops us keeps
        args.out.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(so_far, default=str) + "\n")

    data = run(args, progress)
    partial.unlink(missing_ok=True)
    paths = common.write_outputs(args.out, args.name, data, markdown(data))
    rows = [[r["shape"], r["impl"], r["ms"], r["tflops"], r["peak_fraction"]] for r in data["rows"]]
    print(common.text_table(["shape", "implementation", "ms", "TFLOP/s", "of peak"], rows))
    print()
    print(
        common.text_table(
            [
                "shape",
                "aspect",
                "FLOPs gram/std",
                "time gram/std",
                "dist std",
                "dist gram",
                "dist std ill",
                "dist gram ill",
            ],
            [
                [
                    g["shape"],
                    g["aspect"],
                    g["flops_ratio"],
                    g["time_ratio"],
                    g["dist_standard"],
                    g["dist_gram"],
                    g["dist_standard_ill"],
                    g["dist_gram_ill"],
                ]
                for g in data["gram"]
            ],
        )
    )
    print(f"\nwrote {paths['json']} and {paths['markdown']}")
    return data


if __name__ == "__main__":
    from tools.bench.newton_schulz import main as _main

    _main()
