#!/usr/bin/env python
"""PNG charts of the benchmark results (read from the JSON files in ``--out``).

* ``optimizer_step_time.png``: optimizer-step time of every peer relative to AdamW;
* ``optimizer_step_bytes.png``: bytes per step and rank inside ``optimizer.step()``, by
  collective;
* ``optimizer_step_error.png``: orthogonalization error against the polar factor and
  against full-matrix Newton–Schulz;
* ``optimizer_step_gpu_time.png``: the step-time chart of the GPU run, when there is one;
* ``newton_schulz.png``: Newton–Schulz TFLOP/s per implementation and shape;
* ``scale_model.png``: predicted optimizer-step time and extra bytes per GPU, per model;
* ``checkpoint_memory.png``: a checkpoint save's and load's extra memory and bytes sent per
  rank against the data-parallel size, ours beside Megatron's AdamW saves.

A chart whose JSON is missing is skipped. matplotlib is needed (``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Sequence

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench import common

KIND_COLORS = {
    "all_gather": "#4c72b0",
    "all_to_all": "#c44e52",
    "all_reduce": "#55a868",
    "reduce_scatter": "#8172b2",
    "broadcast": "#ccb974",
}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def step_time(data: Dict[str, Any], path: Path) -> Path:
    plt = _plt()
    peers = data["peers"]
    labels = [p["label"] for p in peers.values()]
    ratios = [p["ratio"] for p in peers.values()]
    fig, ax = plt.subplots(figsize=(7.5, 0.45 * len(labels) + 1.2))
    colors = ["#888888" if n == "megatron_adamw" else "#c44e52" if n.startswith("ours") else "#4c72b0" for n in peers]
    ax.barh(labels, ratios, color=colors)
    for y, (r, p) in enumerate(zip(ratios, peers.values())):
        ax.text(r, y, f" {r:.2f}x ({p['step_ms']:.1f} ms)", va="center", fontsize=8)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("optimizer.step() time / Megatron DistOpt + AdamW")
    lay = data["layout"]
    ax.set_title(f"{data['model']} model, TP{lay['tp']} x DP{lay['dp']}, {data['env']['device_name']}", fontsize=9)
    ax.set_xlim(0, max(ratios) * 1.35)
    return _save(fig, path)


def step_bytes(data: Dict[str, Any], path: Path) -> Path:
    plt = _plt()
    peers = data["peers"]
    labels = [p["label"] for p in peers.values()]
    fig, ax = plt.subplots(figsize=(7.5, 0.45 * len(labels) + 1.2))
    left = [0.0] * len(labels)
    for kind, color in KIND_COLORS.items():
        values = [p["step_bytes"]["per_rank_mean"].get(kind, 0) / 1024 for p in peers.values()]
        if any(values):
            ax.barh(labels, values, left=left, color=color, label=kind.replace("_single", ""))
            left = [a + b for a, b in zip(left, values)]
    ax.invert_yaxis()
    ax.set_xlabel("KiB sent per rank in optimizer.step() (mean over ranks)")
    ax.legend(fontsize=8)
    return _save(fig, path)


def step_error(data: Dict[str, Any], path: Path) -> Path:
    plt = _plt()
    errors = data["errors"]
    names = list(errors)
    labels = [data["peers"][n]["label"] for n in names]
    fig, ax = plt.subplots(figsize=(7.5, 0.45 * len(labels) + 1.2))
    ys = range(len(names))
    ax.barh(
        [y - 0.2 for y in ys],
        [errors[n]["vs_polar_mean"] for n in names],
        height=0.38,
        color="#4c72b0",
        label="vs polar factor U V^T (mean over matrices)",
    )
    ax.barh(
        [y + 0.2 for y in ys],
        [errors[n]["vs_ns_mean"] for n in names],
        height=0.38,
        color="#c44e52",
        label="vs fp32 Newton–Schulz of the full matrix",
    )
    ax.set_yticks(list(ys), labels)
    ax.invert_yaxis()
    ax.set_xlabel("distance of the update's direction (unit Frobenius norm)")
    ax.legend(fontsize=8)
    return _save(fig, path)


def newton_schulz(data: Dict[str, Any], path: Path) -> Path:
    plt = _plt()
    rows = [r for r in data["rows"] if r["tflops"] is not None]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    width = 0.8 / len(impls)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for k, impl in enumerate(impls):
        values = [next((r["tflops"] for r in rows if r["shape"] == s and r["impl"] == impl), 0) for s in shapes]
        ax.bar([i + k * width for i in range(len(shapes))], values, width=width, label=impl)
    ax.set_xticks([i + width * (len(impls) - 1) / 2 for i in range(len(shapes))], shapes, fontsize=8)
    ax.set_ylabel("TFLOP/s")
    if data.get("peak_tflops"):
        ax.axhline(data["peak_tflops"], color="black", lw=0.8, ls="--")
        ax.text(0, data["peak_tflops"], f" peak: {data['peak_note']}", fontsize=7, va="bottom")
    ax.set_title(data["env"]["device_name"], fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path)


def scale_model(data: Dict[str, Any], path: Path) -> Path:
    plt = _plt()
    preds = data["predictions"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.35 * 7 * len(preds) + 1.5))
    schemes = list(next(iter(preds.values()))["schemes"])
    height = 0.8 / len(preds)
    for k, (name, p) in enumerate(preds.items()):
        ys = [i + k * height for i in range(len(schemes))]
        axes[0].barh(ys, [p["schemes"][s]["step_ms"] for s in schemes], height=height, label=name)
        axes[1].barh(
            ys,
            [
                (p["schemes"][s]["intra_bytes_max_rank"] + p["schemes"][s]["inter_bytes_max_rank"]) / 2**20
                for s in schemes
            ],
            height=height,
            label=name,
        )
    labels = [next(iter(preds.values()))["schemes"][s]["label"] for s in schemes]
    for ax in axes:
        ax.set_yticks([i + height * (len(preds) - 1) / 2 for i in range(len(schemes))], labels, fontsize=8)
        ax.invert_yaxis()
        ax.legend(fontsize=8)
    axes[1].set_yticklabels([])
    axes[0].set_xlabel("predicted optimizer step, ms (slowest GPU)")
    axes[1].set_xlabel("optimizer communication beyond DDP, MiB per step (busiest GPU)")
    return _save(fig, path)


CHECKPOINT_COLORS = {"adamw_dp_reshardable": "#888888", "adamw_fully_reshardable": "#4c72b0", "ours": "#c44e52"}


def checkpoint_memory(data: Dict[str, Any], path: Path) -> Path:
    """Three panels against DP (log scales: the peers differ by two orders of magnitude):
    the largest rank's extra memory over the save, over the load, and its bytes sent in the save."""
    from tools.bench.checkpoint_memory import PEERS

    plt = _plt()
    dps = data["dp"]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    panels = (
        ("save_extra", 2**20, "extra MB over the save (dashed: copied by the writer)"),
        ("load_extra", 2**20, "extra MB over the load (largest rank)"),
        ("save_sent", 2**20, "MiB sent in the save (largest rank)"),
    )
    for ax, (key, unit, label) in zip(axes, panels):
        for peer, name in PEERS.items():
            values = [data["results"][f"{dp}/{peer}"][key] / unit for dp in dps]
            ax.plot(dps, values, marker="o", color=CHECKPOINT_COLORS[peer], label=name)
            if key == "save_extra":  # what Megatron's writer copied, counted exactly (dashed)
                copied = [data["results"][f"{dp}/{peer}"]["save_copied"] / unit for dp in dps]
                ax.plot(dps, copied, ls="--", lw=0.9, color=CHECKPOINT_COLORS[peer])
        ax.set_xscale("log", base=2)
        ax.set_xticks(dps, [str(d) for d in dps])
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("data-parallel size")
        ax.set_ylabel(label, fontsize=8)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8)
    spec = data["spec"]
    fig.suptitle(
        f"Checkpoint save / load per rank: {spec['num_layers']}-layer GPT, hidden {spec['hidden_size']}; "
        f"{data['environment']['device_name']}",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


CHARTS = {
    "optimizer_step": [
        ("optimizer_step_time.png", step_time),
        ("optimizer_step_bytes.png", step_bytes),
        ("optimizer_step_error.png", step_error),
    ],
    "optimizer_step_gpu": [("optimizer_step_gpu_time.png", step_time)],
    "newton_schulz": [("newton_schulz.png", newton_schulz)],
    "scale_model": [("scale_model.png", scale_model)],
    "checkpoint_memory": [("checkpoint_memory.png", checkpoint_memory)],
}


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def make_all(out: Path, sources: Sequence[str] = tuple(CHARTS)) -> List[Path]:
    """Every chart of ``sources`` whose JSON exists in ``out`` (none, with a message, without
    matplotlib)."""
    if not have_matplotlib():
        print("matplotlib is not installed (pip install matplotlib): no charts")
        return []
    written = []
    for source in sources:
        charts = CHARTS[source]
        path = Path(out) / f"{source}.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        for filename, fn in charts:
            if filename.endswith("error.png") and not data.get("errors"):
                continue
            written.append(fn(data, Path(out) / filename))
    return written


def main(argv=None) -> List[Path]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="accepted for run_all")
    p.add_argument("--out", type=Path, default=common.DEFAULT_OUT, help="where the JSON files are and the PNGs go")
    args = p.parse_args(argv)
    written = make_all(args.out)
    for path in written:
        print(f"wrote {path}")
    return written


if __name__ == "__main__":
    from tools.bench.plots import main as _main

    _main()
