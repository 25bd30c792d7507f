#!/usr/bin/env python
"""Run every benchmark, then regenerate the tables and charts of ``docs/benchmarks.md``.

``--quick`` (a laptop or CI box, CPU only, a few minutes): the peers on the tiny model
(4 gloo ranks, DP2 x TP2), Newton–Schulz at small shapes, the MoE overlap trace, the scale
model (checked against the counted bytes) and charts. Without ``--quick``, on a GPU box: the same CPU peer run (it is the
one with TP and DP), plus the peers on a larger model on one GPU (``optimizer_step_gpu``),
Newton–Schulz at the real shapes with ``torch.compile``, and the overlap trace on two
GPUs when there are two (on gloo otherwise).

Each script runs in its own process. Results go to ``--out`` (default ``runs/bench``, not
tracked); ``docs/benchmarks.md`` is refreshed only when asked: ``--out docs/bench``, or
``--docs-only`` (rebuild from the JSON already in ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench import common

HERE = Path(__file__).resolve().parent
DOCS = common.REPO_ROOT / "docs" / "benchmarks.md"
SECTIONS = (
    "gpu_check",
    "optimizer_step",
    "optimizer_step_gpu",
    "newton_schulz",
    "overlap_trace",
    "scale_model",
    "run_all",
)
IMAGES = {
    "optimizer_step": ["optimizer_step_time.png", "optimizer_step_bytes.png", "optimizer_step_error.png"],
    "optimizer_step_gpu": ["optimizer_step_gpu_time.png"],
    "newton_schulz": ["newton_schulz.png"],
    "overlap_trace": [],  # its markdown embeds its own PNG
    "scale_model": ["scale_model.png"],
}


def _shown(path: Path) -> str:
    """A path as the commands (and so the recorded provenance) show it: relative to the
    repository when inside it, where every step runs."""
    try:
        return str(path.relative_to(common.REPO_ROOT))
    except ValueError:
        return str(path)


def steps(quick: bool, out: Path) -> List[Tuple[str, List[str]]]:
    """(name, command) of every run, in order; scripts relative to the repository root."""
    import torch

    gpu = torch.cuda.is_available() and not quick
    o = ["--out", _shown(out)]
    q = ["--quick"] if quick else []
    plan = [("optimizer_step", ["optimizer_step.py", "--device", "cpu", *q, *o])]
    if gpu:
        plan.append(
            ("optimizer_step_gpu", ["optimizer_step.py", "--device", "cuda", "--name", "optimizer_step_gpu", *o])
        )
    plan.append(("newton_schulz", ["newton_schulz.py", *q, *o]))
    trace_device = "cuda" if gpu and torch.cuda.device_count() >= 2 else "cpu"
    trace = ["overlap_trace.py", "--device", trace_device, *o]
    if trace_device == "cuda":
        trace = [
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            _shown(HERE / "overlap_trace.py"),
            "--device",
            "cuda",
            *o,
        ]
    plan.append(("overlap_trace", trace))
    plan.append(("scale_model", ["scale_model.py", "--validate", _shown(out / "optimizer_step.json"), *o]))
    plan.append(("plots", ["plots.py", *o]))
    return plan


def run_steps(plan: List[Tuple[str, List[str]]]) -> Dict[str, float]:
    """Run each command with this interpreter; wall seconds of each."""
    seconds = {}
    env = dict(os.environ, PYTHONWARNINGS=os.environ.get("PYTHONWARNINGS", "ignore"))
    for name, cmd in plan:
        argv = [sys.executable] + (cmd if cmd[0] == "-m" else [_shown(HERE / cmd[0]), *cmd[1:]])
        print(f"\n=== {name}: {' '.join(argv[1:])}", flush=True)
        start = time.perf_counter()
        subprocess.run(argv, check=True, cwd=common.REPO_ROOT, env=env)
        seconds[name] = time.perf_counter() - start
        print(f"=== {name}: {seconds[name]:.0f} s", flush=True)
    return seconds


def _block(name: str, out: Path, docs: Path) -> str:
    """The generated markdown of one section: the script's tables and its charts."""
    if name == "run_all":
        path = out / "run_all.json"
        if not path.exists():
            return "_not run yet_"
        data = json.loads(path.read_text())
        rows = [[k, v] for k, v in data["seconds"].items()] + [["total", data["total_s"]]]
        return f"{common.provenance(data['env'])}\n\n" + common.md_table(["step", "seconds"], rows)
    if name == "gpu_check":  # its own command (gpu_check.py), rendered from its JSON
        from tools.bench import gpu_check

        path = out / "gpu_check.json"
        return gpu_check.markdown(json.loads(path.read_text())).rstrip() if path.exists() else "_not run yet_"
    md = out / f"{name}.md"
    if not md.exists():
        return "_not run yet (GPU box only)_" if name.endswith("_gpu") else "_not run yet_"
    rel = os.path.relpath(out, docs.parent)
    text = md.read_text().rstrip()
    # Image links of a script's markdown are relative to --out; make them relative to the doc.
    text = text.replace("](overlap_trace.png)", f"]({rel}/overlap_trace.png)")
    images = [f"![{image}]({rel}/{image})" for image in IMAGES.get(name, []) if (out / image).exists()]
    return "\n\n".join([text] + images)


def render_docs(out: Path, docs: Path) -> str:
    """``docs`` with every generated block replaced from the results in ``out``."""
    text = docs.read_text()
    for name in SECTIONS:
        begin, end = f"<!-- BEGIN generated: {name} -->", f"<!-- END generated: {name} -->"
        if begin not in text:
            continue
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{begin}\n{_block(name, out, docs)}\n{end}{tail}"
    return text


def main(argv=None) -> Dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CPU sizes; a few minutes on 2 cores")
    p.add_argument("--out", type=Path, default=common.DEFAULT_OUT)
    p.add_argument(
        "--docs",
        type=Path,
        default=None,
        help="the markdown whose generated blocks to refresh (default: docs/benchmarks.md, only with "
        "--out docs/bench or --docs-only)",
    )
    p.add_argument("--docs-only", action="store_true", help="rebuild the documents from existing results")
    args = p.parse_args(argv)
    args.out = args.out.resolve()
    seconds: Dict[str, float] = {}
    if not args.docs_only:
        start = time.perf_counter()
        seconds = run_steps(steps(args.quick, args.out))
        total = time.perf_counter() - start
        device = "cpu" if args.quick else common.pick_device("auto")
        (args.out / "run_all.json").write_text(
            json.dumps(dict(env=common.environment(device), quick=args.quick, seconds=seconds, total_s=total), indent=1)
            + "\n"
        )
        print(f"\nall benchmarks: {total:.0f} s")
    if args.docs is None and (args.docs_only or args.out == common.DOCS_OUT.resolve()):
        args.docs = DOCS
    if args.docs is None:
        print(f"results in {args.out}; docs/benchmarks.md left as it is (refresh it with --out docs/bench)")
        return seconds
    args.docs.write_text(render_docs(args.out, args.docs))
    print(f"updated {args.docs}")
    return seconds


if __name__ == "__main__":
    from tools.bench.run_all import main as _main

    _main()
