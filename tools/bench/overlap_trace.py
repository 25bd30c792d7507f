#!/usr/bin/env python
"""Evidence of the overlap: a timeline of one MoE optimizer step, exported as a PNG.

A tiny MoE GPT on 2 ranks, dense weights TP2 and experts EP2 (gloo on the CPU; NCCL under
``torchrun`` on GPUs). With ``muon_overlap_expert_ns`` the dense pipeline launches its
first all-to-all gathers and, before waiting for them, runs the expert optimizer's step
(its stacked per-expert Newton–Schulz); only then does it wait for chunk 0's pieces.

The step records nothing itself: ``megatron_muon.testing.trace.trace_step`` watches it from
outside, recording when each stage of each chunk generator starts and ends and, from a
helper thread, when every all-to-all actually completed. The step runs twice, overlap on
and off, so the plot shows both schedules.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench import common

COLORS = {
    "launch_gather": "#4c72b0",
    "complete_gather": "#8172b2",
    "compute": "#c44e52",
    "complete_scatter": "#64b5cd",
}
"""The spans of ``trace_step``, drawn in this order (``compute`` on top of ``complete_gather``)."""


def rank_main(spec_kwargs: Dict[str, Any], chunk_numel: int) -> Dict[str, Any]:
    """One warm-up step, then one traced step, with the expert overlap on and off."""
    import torch
    import torch.distributed as dist

    from megatron_muon import MuonConfig, get_muon_optimizer
    from megatron_muon.testing import models as M
    from megatron_muon.testing.trace import trace_step

    common.quiet()
    device = "cuda" if torch.cuda.is_available() and torch.cuda.current_device() != "cpu" else "cpu"
    spec = M.TinyModelSpec(kind="moe", **spec_kwargs)
    tokens = M.synthetic_batches(spec, 8, 1)[0].to(device)
    out: Dict[str, Any] = {"rank": dist.get_rank()}
    for overlap in (True, False):
        chunks = M.build_model_chunks(spec)
        M.canonical_init_(chunks, seed=0)
        model = M.wrap_ddp(chunks, chunks[0].config)
        opt = get_muon_optimizer(
            MuonConfig(
                lr=0.01, weight_decay=0.1, clip_grad=1.0, muon_overlap_expert_ns=overlap, muon_chunk_numel=chunk_numel
            ),
            model,
        )
        M.train_step(model, opt, tokens, 2, spec)  # warm-up: plans, lazy state
        for chunk in model:
            chunk.zero_grad_buffer()
        opt.zero_grad()
        M.forward_backward(model, tokens, 2, spec)
        dist.barrier()
        common.synchronize(device)
        with trace_step(opt) as trace:
            t0 = time.perf_counter()
            opt.step()
            common.synchronize(device)
            t1 = time.perf_counter()
        spans, flights = trace.spans, trace.flights
        deadline = time.perf_counter() + 5
        while any(f["completed"] is None for f in flights) and time.perf_counter() < deadline:
            time.sleep(1e-3)
        for s in spans:
            s["start"], s["end"] = (s["start"] - t0) * 1e3, (s["end"] - t0) * 1e3
        for f in flights:
            f["launched"] = (f["launched"] - t0) * 1e3
            f["completed"] = (f["completed"] - t0) * 1e3 if f["completed"] is not None else None
        out["overlap" if overlap else "sequential"] = dict(
            trace=trace.events,
            spans=spans,
            flights=flights,
            step_ms=(t1 - t0) * 1e3,
            chunks={o.name: o.plan_statistics()["chunks"] for o in opt.muon_optimizers},
        )
    return out


def evidence(run: Dict[str, Any]) -> Dict[str, Any]:
    """When the dense pipeline's first gather was launched, completed and waited for,
    against when the expert Newton–Schulz ran (ms from the start of ``step()``)."""
    spans, flights = run["spans"], run["flights"]
    first = next(f for f in flights if f["pipeline"] == "dense" and f["kind"] == "gather")
    waited = next(s for s in spans if s["pipeline"] == "dense" and s["stage"] == "complete_gather" and s["chunk"] == 0)
    expert = [s for s in spans if s["pipeline"] == "expert" and s["stage"] == "compute"]
    e_start = min((s["start"] for s in expert), default=None)
    e_end = max((s["end"] for s in expert), default=None)
    return dict(
        gather0_launched_ms=first["launched"],
        gather0_completed_ms=first["completed"],
        gather0_waited_ms=waited["start"],
        gather0_bytes=first["bytes"],
        expert_ns_start_ms=e_start,
        expert_ns_end_ms=e_end,
        expert_ns_inside_gather0_window=bool(expert) and first["launched"] <= e_start and e_end <= waited["start"],
        gather0_in_flight_during_expert_ns=bool(expert)
        and first["completed"] is not None
        and first["launched"] <= e_start < first["completed"],
        step_ms=run["step_ms"],
    )


def plot(ranks: List[Dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(2, 1, figsize=(11, 5.5), sharex=True)
    for ax, mode in zip(axes, ("overlap", "sequential")):
        labels = []
        y = 0
        for r in ranks:
            run = r[mode]
            for pipeline in ("dense", "expert"):
                for f in run["flights"]:
                    if f["pipeline"] == pipeline and f["completed"] is not None:
                        ax.broken_barh(
                            [(f["launched"], max(f["completed"] - f["launched"], 1e-3))],
                            (y + 0.55, 0.35),
                            facecolors="#dddddd",
                            edgecolors="#555555",
                            hatch="///",
                        )
                for s in sorted(run["spans"], key=lambda s: list(COLORS).index(s["stage"])):
                    if s["pipeline"] == pipeline:
                        ax.broken_barh(
                            [(s["start"], max(s["end"] - s["start"], 1e-3))],
                            (y + 0.05, 0.45),
                            facecolors=COLORS[s["stage"]],
                        )
                labels.append(f"rank {r['rank']} {pipeline}")
                y += 1
        ax.set_yticks([i + 0.5 for i in range(y)], labels)
        ax.set_title(
            f"muon_overlap_expert_ns={mode == 'overlap'}: step {ranks[0][mode]['step_ms']:.1f} ms (rank 0)", fontsize=10
        )
        ax.invert_yaxis()
    axes[-1].set_xlabel("ms since optimizer.step() began")
    handles = [Patch(color=c, label=s) for s, c in COLORS.items()]
    handles.append(Patch(facecolor="#dddddd", edgecolor="#555555", hatch="///", label="all-to-all in flight"))
    fig.legend(handles=handles, loc="lower center", ncol=7, fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(data: Dict[str, Any]) -> str:
    rows = []
    for r in data["ranks"]:
        for mode in ("overlap", "sequential"):
            e = r["evidence"][mode]
            rows.append(
                [
                    r["rank"],
                    mode,
                    e["step_ms"],
                    e["gather0_bytes"],
                    e["gather0_launched_ms"],
                    e["expert_ns_start_ms"],
                    e["expert_ns_end_ms"],
                    e["gather0_completed_ms"],
                    e["gather0_waited_ms"],
                    "yes" if e["expert_ns_inside_gather0_window"] else "no",
                    "yes" if e["gather0_in_flight_during_expert_ns"] else "no",
                ]
            )
    table = common.md_table(
        [
            "rank",
            "schedule",
            "step ms",
            "gather 0 bytes",
            "gather 0 launched",
            "expert NS start",
            "expert NS end",
            "gather 0 completed",
            "gather 0 waited for",
            "expert NS before the wait",
            "gather 0 still in flight at expert NS start",
        ],
        rows,
    )
    return (
        f"Tiny MoE GPT (2 layers, 4 experts top-2, hidden {data['model_spec']['hidden_size']}, expert ffn "
        f"{data['model_spec']['moe_ffn_hidden_size']}), dense TP2 with sequence parallelism and experts EP2 on 2 ranks, dense pipeline chunks of about "
        f"{data['chunk_numel']} elements. "
        "Times in ms from the start of `optimizer.step()`.\n\n"
        f"{common.provenance(data['env'])}\n\n{table}\n"
        + (f"\n![timeline]({data['png_name']})\n" if data["png_name"] else "")
    )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="accepted for run_all; the trace is always small")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--hidden", type=int, default=128, help="hidden size (bigger: longer transfers)")
    p.add_argument("--chunk-numel", type=int, default=16384, help="muon_chunk_numel of the dense pipeline")
    p.add_argument("--out", type=Path, default=common.DEFAULT_OUT)
    p.add_argument("--name", default="overlap_trace")
    return p.parse_args(argv)


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    device = common.pick_device(args.device)
    spec = dict(
        hidden_size=args.hidden,
        ffn_hidden_size=2 * args.hidden,
        moe_ffn_hidden_size=args.hidden,
        sequence_parallel=True,
    )
    # Dense weights TP2, experts EP2 x expert-TP1 (Megatron's MoE parallel folding): every dense
    # matrix is split over both ranks, so the dense pipeline's gathers always carry pieces (with
    # DP only, the planner keeps whole matrices where they are and chunk 0 may move nothing).
    ranks = common.launch(rank_main, 2, spec, args.chunk_numel, device=device, tp=2, ep=2, etp=1)
    for r in ranks:
        r["evidence"] = {mode: evidence(r[mode]) for mode in ("overlap", "sequential")}
    data = dict(
        env=common.environment(device),
        model_spec=spec,
        chunk_numel=args.chunk_numel,
        png_name=f"{args.name}.png",
        ranks=ranks,
    )
    if not common.is_main_process():
        return data
    from tools.bench.plots import have_matplotlib

    if have_matplotlib():
        plot(ranks, Path(args.out) / data["png_name"])
    else:
        print("matplotlib is not installed (pip install matplotlib): no timeline PNG")
        data["png_name"] = None
    paths = common.write_outputs(args.out, args.name, data, markdown(data))
    for r in ranks:
        e = r["evidence"]["overlap"]
        print(
            f"rank {r['rank']}: gather 0 launched {e['gather0_launched_ms']:.2f} ms, expert NS "
            f"{e['expert_ns_start_ms']:.2f}-{e['expert_ns_end_ms']:.2f} ms, gather 0 completed "
            f"{e['gather0_completed_ms']:.2f} ms, waited for at {e['gather0_waited_ms']:.2f} ms"
        )
    print(
        f"wrote {paths['json']} and {paths['markdown']}"
        + (f" and {Path(args.out) / data['png_name']}" if data["png_name"] else "")
    )
    return data


if __name__ == "__main__":
    from tools.bench.overlap_trace import main as _main

    _main()
