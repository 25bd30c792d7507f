#!/usr/bin/env python
"""Optimizer step of the peers, side by side: same model, same process layout, same run.

For every peer of ``tools/bench/peers.py`` (Megatron DistOpt + AdamW, Megatron-core's own
Muon in its TP modes, ours in each TP mode) on one bf16 GPT:

* **step time**: ``optimizer.step()`` alone (median over steps of the slowest rank) and
  its ratio to AdamW's; the whole train step too;
* **bytes per step** per collective kind, counted around ``optimizer.step()`` only and
  around the whole train step (forward/backward, DDP's reduce-scatter, step);
* **optimizer state per rank**: optimizer state tensors + fp32 master weights;
* **Muon state on the device** (ours): bytes of the Muon matrices' optimizer state
  (momentum, fp32 masters) on the compute device between steps and at most during a step,
  and in the CPU offload pools (``ours_exact_offload``), with the step-time ratio of
  offload on to off. On a CPU-only
  machine the "device" bytes are those not in the offload pool (what a GPU would hold);
* **orthogonalization error**: one step from the same weights with momentum 0, lr 1, no
  weight decay and no clipping, so every matrix changes by -scale * NS(full gradient).
  The change (gathered over TP and DP) is compared per logical matrix (Q, K, V apart) with
  the exact polar factor U V^T of the full gradient (SVD), and with Newton–Schulz of the
  full matrix in fp32; both are compared as directions (each normalised), so different
  scale conventions do not count. Blockwise modes show their cost here.

CPU default: the tiny GQA model on 4 gloo ranks, DP2 x TP2 (about a minute). On a GPU box
the device is picked automatically; one GPU runs a larger model at TP1, more GPUs run
under ``torchrun --nproc-per-node N ... --world N --tp T``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench import common, peers, step_overhead

MODELS: Dict[str, Dict[str, Any]] = {
    # The CPU model: the project's tiny GQA SwiGLU GPT.
    "tiny": dict(kind="gqa"),
    # GPU sizes (Llama-like proportions: GQA with 4 query groups, SwiGLU 2.75x).
    "small": dict(
        kind="gqa",
        num_layers=4,
        hidden_size=1024,
        ffn_hidden_size=2816,
        num_attention_heads=16,
        num_query_groups=4,
        vocab_size=8192,
        seq_length=256,
    ),
    "medium": dict(
        kind="gqa",
        num_layers=8,
        hidden_size=2048,
        ffn_hidden_size=5632,
        num_attention_heads=16,
        num_query_groups=4,
        vocab_size=32000,
        seq_length=1024,
    ),
}
KINDS = ("reduce_scatter", "all_gather", "all_to_all", "all_reduce", "broadcast")
GROUP_KINDS = ("dp", "expert_dp", "tp", "ep", "pp")


def describe_model(spec_kwargs: Dict[str, Any]) -> str:
    from megatron_muon.testing.models import TinyModelSpec

    s = TinyModelSpec(**spec_kwargs)
    return (
        f"{s.num_layers} layers, hidden {s.hidden_size}, {s.num_attention_heads} heads in "
        f"{s.num_query_groups or s.num_attention_heads} query groups, SwiGLU ffn {s.ffn_hidden_size}, "
        f"vocab {s.vocab_size}, sequence {s.seq_length}"
    )


# ---------------------------------------------------------------------------------------
# In every rank
# ---------------------------------------------------------------------------------------


def _now(device: str) -> float:
    common.synchronize(device)
    return time.perf_counter()


def _forward_backward(model, opt, tokens, mbs, spec) -> None:
    from megatron_muon.testing import models as M

    for chunk in model:
        chunk.zero_grad_buffer()
    opt.zero_grad()
    M.forward_backward(model, tokens, mbs, spec)


def _train_step(name, built, tokens, mbs, spec, device) -> tuple:
    """One train step of a built peer: (seconds in step(), seconds for the whole step)."""
    import torch.distributed as dist

    _, model, opt, sched = built
    t0 = _now(device)
    _forward_backward(model, opt, tokens, mbs, spec)
    dist.barrier()  # all ranks enter step() together: its time is the step's, not a wait
    t1 = _now(device)
    ok, _, _ = opt.step()
    t2 = _now(device)
    sched.step(1)
    if not ok:
        raise RuntimeError(f"{name}: an optimizer step was skipped (inf/nan)")
    return t2 - t1, t2 - t0


def _time_peers(
    names: List[str],
    spec,
    tokens,
    mbs: int,
    steps: int,
    warmup: int,
    device: str,
    interleave: bool,
    hyper,
    trace_dir: Optional[str] = None,
) -> Dict[str, Dict[str, Any]]:
    """Step times, bytes per step and optimizer memory of every peer. Interleaved, every
    peer is built first and the peers take turns step by step, so load from other
    processes on a shared machine falls on all of them alike."""
    import torch

    results: Dict[str, Dict[str, Any]] = {n: dict(step_s=[], train_s=[]) for n in names}
    groups = [names] if interleave else [[n] for n in names]
    for group in groups:
        started = time.perf_counter()
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        built = {n: peers.build(n, spec, hyper) for n in group}
        _progress(f"built {', '.join(group)} in {time.perf_counter() - started:.1f} s")
        for i in range(warmup + steps):
            for n in group:
                step, train = _train_step(n, built[n], tokens, mbs, spec, device)
                if i >= warmup:
                    results[n]["step_s"].append(step)
                    results[n]["train_s"].append(train)
        for n in group:
            _, model, opt, _ = built[n]
            # Traffic of one more step, counted around step() only, then around the whole step.
            _forward_backward(model, opt, tokens, mbs, spec)
            with peers.count_traffic() as step_traffic:
                opt.step()
            with peers.count_traffic() as train_traffic:
                _forward_backward(model, opt, tokens, mbs, spec)
                opt.step()
            # What the step runs besides Newton–Schulz, one more step each way.
            _forward_backward(model, opt, tokens, mbs, spec)
            results[n]["overhead"] = step_overhead.count_ops(opt.step)
            if device == "cuda":
                _forward_backward(model, opt, tokens, mbs, spec)
                kernels = step_overhead.profile_kernels(opt.step)
                trace = kernels.pop("trace")
                if trace_dir and common.is_main_process():
                    Path(trace_dir).mkdir(parents=True, exist_ok=True)
                    trace.export_chrome_trace(str(Path(trace_dir) / f"step_{n}.json"))
                results[n]["kernels"] = kernels
            results[n].update(
                step_bytes=dict(step_traffic.bytes),
                train_bytes=dict(train_traffic.bytes),
                train_groups=dict(train_traffic.by_group),
                memory=peers.optimizer_state_bytes(opt),
                held=peers.held_bytes(model, opt),
                residency=peers.muon_state_residency(opt),
                # Peak device memory of the peer's whole run (model, activations, optimizer;
                # one peer at a time when not interleaved).
                peak_bytes=torch.cuda.max_memory_allocated() if device == "cuda" else None,
                ns_tflop=ns_tflop(opt),
                offload_bytes=offload_bytes(opt),
            )
        _progress(f"timed {', '.join(group)} ({time.perf_counter() - started:.1f} s with the build)")
        del built
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


def ns_tflop(opt) -> Optional[float]:
    """Newton–Schulz TFLOP of one step of ours (each logical matrix once, by the iteration
    the config runs), and of the standard iteration on the same matrices: the floor's work."""
    from megatron_muon.newton_schulz import newton_schulz_flops

    muon = getattr(opt, "muon_optimizers", None)
    if muon is None:
        return None
    jobs = [job for o in muon for job in o.plan.jobs]
    steps = muon[0].config.muon_num_ns_steps
    standard = sum(newton_schulz_flops(*j.matrix.ns_shape, steps, batch=j.matrix.column_groups) for j in jobs)
    return dict(planned=sum(j.flops for j in jobs) / 1e12, standard=standard / 1e12)


def offload_bytes(opt) -> Optional[Dict[str, int]]:
    """Bytes the CPU offload moves per step on this rank, each way: every offloaded state
    (variance reduction's second moments too: kept on the CPU with the offload, moved to
    the device for each stack) and the offloaded fp32 masters, staged to the device and
    written back (they are updated and written into the model's parameters there); where
    the storage gives no model ranges (FP8 / FP4 parameter gathers), also the masters
    rounded to the model's 16-bit dtype on the host, which Megatron's master -> model copy
    copies to the device."""
    from megatron_muon.state import SECOND_MOMENT

    muon = getattr(opt, "muon_optimizers", None)
    if not muon or not any(o.muon.shard_states.offload for o in muon):
        return None
    h2d = d2h = 0
    for o in muon:
        moments = o.muon.owner_states.values.get(SECOND_MOMENT, {}).values()  # kept on the CPU, used on the device
        moved = o.muon.shard_states.pool_bytes + sum(t.numel() * t.element_size() for t in moments)
        h2d += moved
        d2h += moved
        offload = o.masters_offload
        if offload is not None:
            h2d += offload.pool_bytes
            d2h += offload.pool_bytes
            h2d += sum(v.numel() * 2 for r, v in zip(offload.model_ranges, offload.views) if r is None)  # 16-bit
    return dict(h2d=h2d, d2h=d2h)


def host_device_gbps() -> Dict[str, float]:
    """Pinned host <-> device copy rate (GB/s) of a 1 GiB buffer, each way, median of 5."""
    import torch

    n = 1 << 28
    host = torch.empty(n, dtype=torch.float32, pin_memory=True)
    dev = torch.empty(n, dtype=torch.float32, device="cuda")
    out = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        times = []
        for _ in range(6):
            torch.cuda.synchronize()
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        out[name] = 4 * n / common.median(times[1:]) / 1e9
    return out


def _progress(message: str) -> None:
    """A line on the main rank's output as each stage ends (a time box that stops the run
    shows how far it got)."""
    if common.is_main_process():
        print(f"[optimizer_step] {message}", flush=True)


def _probe_peer(
    name: str, spec, tokens, mbs: int, probe_layers: Optional[int], want_grads: bool, chunk_numel: Optional[int] = None
) -> Dict[str, Any]:
    """One step with ``peers.PROBE`` settings: the change of every matrix (this rank's
    TP piece) and, if asked, this rank's gradient before DDP's reduction."""
    from dataclasses import replace

    chunks, model, opt, _ = peers.build(name, spec, replace(peers.PROBE, chunk_numel=chunk_numel))
    mats = peers.matrix_params(chunks[0])
    if probe_layers is not None:
        mats = {n: p for n, p in mats.items() if _layer_of(n) < probe_layers}
    before = {n: p.detach().float().cpu().clone() for n, p in mats.items()}
    with peers.capture_local_grads(mats) as grads:
        _forward_backward(model, opt, tokens, mbs, spec)
    ok, _, _ = opt.step()
    if not ok:
        raise RuntimeError(f"{name}: the probe step was skipped")
    out = {
        "change": {n: p.detach().float().cpu() - before[n] for n, p in mats.items()},
        "dim": {
            n: (int(p.partition_dim) if getattr(p, "tensor_model_parallel", False) else None) for n, p in mats.items()
        },
    }
    if want_grads:
        out["grad"] = dict(grads)
    del chunks, model, opt
    return out


def _layer_of(name: str) -> int:
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else 0


def rank_main(
    spec_kwargs: Dict[str, Any],
    names: List[str],
    steps: int,
    warmup: int,
    gbs: int,
    mbs: int,
    probe_layers: Optional[int],
    interleave: bool = True,
    chunk_numel: Optional[int] = None,
    trace_dir: Optional[str] = None,
) -> Dict[str, Any]:
    """Everything this rank measures, for every peer in ``names``."""
    import torch
    from megatron.core import parallel_state

    from megatron_muon.testing import models as M

    common.quiet()
    device = "cuda" if torch.cuda.is_available() and torch.cuda.current_device() != "cpu" else "cpu"
    spec = M.TinyModelSpec(bf16=True, **spec_kwargs)
    tokens = M.synthetic_batches(spec, gbs, 1)[0].to(device)
    out: Dict[str, Any] = dict(
        tp=parallel_state.get_tensor_model_parallel_rank(),
        dp=parallel_state.get_data_parallel_rank(),
        timing=_time_peers(
            names, spec, tokens, mbs, steps, warmup, device, interleave, peers.Hyper(chunk_numel=chunk_numel), trace_dir
        ),
        probe={},
        attention=peers.attention_dims(M.transformer_config(spec)),
    )
    if device == "cuda":  # the rates the floor and the offload's copy time are taken at
        from tools.bench.newton_schulz import measured_matmul_tflops

        out["bf16_tflops"] = measured_matmul_tflops(device, 8192, reps=10, stat="median")
        out["host_device_gbps"] = host_device_gbps()
    want_grads = True
    for name in names if probe_layers != 0 else []:
        if peers.is_muon_peer(name) and not peers.is_fsdp_peer(name):  # the probe reads whole TP pieces
            out["probe"][name] = _probe_peer(name, spec, tokens, mbs, probe_layers, want_grads, chunk_numel)
            want_grads = False  # the same model and batch: the gradient is the same for all
            gc.collect()
    return out


# ---------------------------------------------------------------------------------------
# In the parent: combine the ranks
# ---------------------------------------------------------------------------------------


def _full(pieces: Dict[int, Any], dim: Optional[int]):
    import torch

    if dim is None:
        return pieces[0]
    return torch.cat([pieces[t] for t in sorted(pieces)], dim=dim)


def orthogonalization_errors(ranks: List[Dict[str, Any]], device: str) -> Dict[str, Dict[str, Any]]:
    """Per peer and logical matrix: distance of the applied change's direction from the
    polar factor's and from fp32 Newton–Schulz's, both of the full gradient."""
    import torch

    from megatron_muon.rule import newton_schulz

    grad_rank = next(r for r in ranks if any("grad" in p for p in r["probe"].values()))
    grad_peer = next(n for n, p in grad_rank["probe"].items() if "grad" in p)
    attention = ranks[0]["attention"]
    # Full gradient: sum over DP ranks of the local gradients, TP pieces joined.
    names = list(grad_rank["probe"][grad_peer]["grad"])
    dims = grad_rank["probe"][grad_peer]["dim"]
    grads = {}
    for n in names:
        by_tp: Dict[int, Any] = {}
        for r in ranks:
            g = r["probe"][grad_peer]["grad"][n]
            by_tp[r["tp"]] = g if r["tp"] not in by_tp else by_tp[r["tp"]] + g
        grads.update(peers.logical_parts(n, _full(by_tp, dims[n]), attention))
    targets = {}
    for key, g in grads.items():
        g = g.to(device)
        u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
        targets[key] = ((u @ vh).float(), newton_schulz(g, 5, "quintic", torch.float32))

    def direction_error(change, target) -> float:
        norm = change.norm()
        if norm == 0:
            return float("nan")
        return float((-change / norm - target / target.norm()).norm())

    out = {}
    for peer in ranks[0]["probe"]:
        changes = {}
        for n in names:
            by_tp = {r["tp"]: r["probe"][peer]["change"][n] for r in ranks if r["dp"] == 0}
            changes.update(peers.logical_parts(n, _full(by_tp, dims[n]), attention))
        per = {
            k: (direction_error(changes[k].to(device), p), direction_error(changes[k].to(device), ns))
            for k, (p, ns) in targets.items()
        }
        polar = [v[0] for v in per.values()]
        ns = [v[1] for v in per.values()]
        out[peer] = dict(
            vs_polar_mean=sum(polar) / len(polar),
            vs_polar_max=max(polar),
            vs_ns_mean=sum(ns) / len(ns),
            vs_ns_max=max(ns),
            matrices={k: dict(vs_polar=a, vs_ns=b) for k, (a, b) in per.items()},
        )
    return out


def summarize(ranks: List[Dict[str, Any]], names: List[str]) -> Dict[str, Dict[str, Any]]:
    """Step times (slowest rank per step, median over steps), bytes, memory per peer."""
    world = len(ranks)
    out = {}
    for name in names:
        per_rank = [r["timing"][name] for r in ranks]
        steps = len(per_rank[0]["step_s"])
        step = common.median([max(r["step_s"][i] for r in per_rank) for i in range(steps)])
        train = common.median([max(r["train_s"][i] for r in per_rank) for i in range(steps)])

        def bytes_of(which: str) -> Dict[str, Dict[str, float]]:
            kinds = sorted({k for r in per_rank for k in r[which]})
            totals = {k: sum(r[which].get(k, 0) for r in per_rank) for k in kinds}
            return {
                "per_rank_mean": {k: totals[k] / world for k in kinds},
                "total": totals,
                "per_rank": [dict(r[which]) for r in per_rank],
            }

        memory = [r["memory"]["total"] for r in per_rank]
        train_bytes = bytes_of("train_bytes")
        # Bytes per rank per train step by process-group kind (traffic.GROUP_KINDS, + 'other').
        train_bytes["per_group_mean"] = {
            k: sum(r["train_groups"].get(k, 0) for r in per_rank) / world
            for k in sorted({k for r in per_rank for k in r["train_groups"]} | set(GROUP_KINDS))
        }
        out[name] = dict(
            label=peers.LABELS[name],
            overhead=step_overhead.merge_counts([r["overhead"] for r in per_rank]),
            kernels=per_rank[0].get("kernels"),
            ns_tflop=per_rank[0].get("ns_tflop"),
            offload_bytes=per_rank[0].get("offload_bytes"),
            step_ms=step * 1e3,
            train_step_ms=train * 1e3,
            step_bytes=bytes_of("step_bytes"),
            train_bytes=train_bytes,
            memory_per_rank=[r["memory"] for r in per_rank],
            held_per_rank=[r["held"] for r in per_rank],
            held_max={k: max(r["held"][k] for r in per_rank) for k in per_rank[0]["held"]},
            memory_max=max(memory),
            memory_mean=sum(memory) / world,
            peak_bytes_max=max((r.get("peak_bytes") or 0) for r in per_rank) or None,
        )
        residency = [r.get("residency") for r in per_rank]
        if all(x is not None for x in residency):
            out[name]["muon_state_per_rank"] = residency
            out[name]["muon_state_max"] = {k: max(x[k] for x in residency) for k in residency[0]}
    base = out.get(peers.BASELINE)
    for row in out.values():
        row["ratio"] = row["step_ms"] / base["step_ms"] if base else float("nan")
    for name, row in out.items():
        off = out.get(name[: -len("_offload")]) if name.endswith("_offload") else None
        if off is not None:
            row["step_ratio_to_offload_off"] = row["step_ms"] / off["step_ms"]
    return out


def residency_table(results: Dict[str, Any]) -> str:
    """Muon optimizer state on the compute device per rank (max over ranks), ours only."""
    rows = []
    for r in results.values():
        m = r.get("muon_state_max")
        if m is None:
            continue
        rows.append(
            [
                r["label"],
                common.human_bytes(m["device_idle"]),
                common.human_bytes(m["device_step_peak"]),
                common.human_bytes(m["largest_chunk"]),
                common.human_bytes(m["offloaded"]),
                r.get("step_ratio_to_offload_off"),
            ]
        )
    return (
        common.md_table(
            [
                "optimizer",
                "on device, idle",
                "on device, step peak",
                "one chunk",
                "offloaded (CPU pool)",
                "step / offload off",
            ],
            rows,
        )
        if rows
        else ""
    )


def markdown(data: Dict[str, Any]) -> str:
    results, errors = data["peers"], data["errors"]
    lay = data["layout"]
    head = (
        f"Model `{data['model']}` ({data['model_description']}), bf16 with fp32 master weights, "
        f"{lay['world']} ranks (TP{lay['tp']} x DP{lay['dp']}), {data['steps']} timed steps after "
        f"{data['warmup']} warm-up steps{' (peers taking turns step by step)' if data['interleaved'] else ''}, "
        f"global batch {data['gbs']}.\n\n" + common.provenance(data["env"])
    )
    rows = []
    for name, r in results.items():
        e = errors.get(name, {})
        rows.append(
            [
                r["label"],
                r["step_ms"],
                r["ratio"],
                r["train_step_ms"],
                common.human_bytes(r["memory_max"]),
                e.get("vs_polar_mean"),
                e.get("vs_polar_max"),
                e.get("vs_ns_mean"),
                e.get("vs_ns_max"),
            ]
        )
    main = common.md_table(
        [
            "optimizer",
            "step ms",
            "step / AdamW",
            "train step ms",
            "opt. state / rank (max)",
            "err vs polar (mean)",
            "err vs polar (max)",
            "err vs full NS (mean)",
            "err vs full NS (max)",
        ],
        rows,
    )
    byte_rows = []
    for r in results.values():
        for which, label in (("step_bytes", "step()"), ("train_bytes", "train step")):
            mean = r[which]["per_rank_mean"]
            byte_rows.append([r["label"], label] + [int(mean.get(k, 0)) for k in KINDS] + [int(sum(mean.values()))])
    traffic = common.md_table(
        ["optimizer", "counted around"] + [k.replace("_single", "") for k in KINDS] + ["total"], byte_rows
    )
    group_rows = []
    for r in results.values():
        groups = r["train_bytes"].get("per_group_mean", {})
        total = sum(r["train_bytes"]["per_rank_mean"].values())
        group_rows.append(
            [r["label"], int(groups.get("dp", 0) + groups.get("expert_dp", 0)), int(total)]
            + [int(groups.get(k, 0)) for k in GROUP_KINDS + ("other",)]
        )
    by_group = common.md_table(
        ["optimizer", "DP-group bytes", "total bytes"] + list(GROUP_KINDS) + ["other"], group_rows
    )
    held = common.md_table(
        ["optimizer", "parameters", "gradients", "optimizer state", "total"],
        [
            [r["label"]] + [common.human_bytes(r["held_max"][k]) for k in ("params", "grads", "optimizer", "total")]
            for r in results.values()
        ],
    )
    targets = targets_table(results, lay["dp"])
    residency = residency_table(results)
    overhead = overhead_tables(data)
    return (
        f"{head}\n\n{main}\n\nErrors are distances between unit-norm directions, "
        "‖−Δ/‖Δ‖ − T/‖T‖‖_F for the change Δ of each logical matrix (Q, K, V apart), T the polar factor "
        "U V^T (SVD) or fp32 Newton–Schulz of the full gradient (5 quintic steps, the same "
        "iteration every peer runs here)"
        + (f", over the matrices of the first {data['probe_layers']} layer(s)" if data.get("probe_layers") else "")
        + ". Where a gradient has fewer tokens behind it than its matrix's smaller side, U V^T also lifts the "
        "near-zero directions to one, and every peer's distance to it grows alike.\n\n"
        f"Bytes sent per step per rank (mean over ranks), by collective:\n\n{traffic}\n"
        "\nBytes sent per train step per rank (mean over ranks), by the process group they travel in "
        "(DP-group bytes = dp + expert_dp):\n\n"
        + by_group
        + "\n"
        + "\nHeld per rank between steps (max over ranks): model parameters, gradients, optimizer state "
        "(fp32 masters + moments):\n\n"
        + held
        + "\n"
        + (f"\nThe project's targets, from this run:\n\n{targets}\n" if targets else "")
        + overhead
        + (
            f"\nMuon matrices' optimizer state (momentum, second moments, fp32 masters) per rank, max over ranks; "
            "'on device' counts tensors outside the CPU offload pool (on a CPU-only machine, what a GPU "
            f"would hold):\n\n{residency}\n"
            if residency
            else ""
        )
    )


def overhead_tables(data: Dict[str, Any]) -> str:
    """What each step runs besides Newton–Schulz (ops, copies and casts, host syncs: every
    device); on a GPU also its kernels' time and the step against the Newton–Schulz FLOP
    floor and the offload's copy time, at the rates measured in the same run."""
    results = data["peers"]
    rows = [
        row
        for r in results.values()
        if r.get("overhead")
        for row in step_overhead.overhead_rows(r["label"], r["overhead"])
    ]
    out = (
        "\nWhat one step runs besides Newton–Schulz, summed over the ranks (`tools/bench/step_overhead.py`: every "
        "aten op, Newton–Schulz's inside the implementation's NS call; views not counted; bytes read plus "
        "written; per matrix: over the logical matrices orthogonalized, each once):\n\n"
        + common.md_table(step_overhead.OVERHEAD_HEADERS, rows)
        + "\n"
    )
    kernels = [(r["label"], r["step_ms"], r["kernels"]) for r in results.values() if r.get("kernels")]
    if kernels:
        out += (
            "\nOne profiled step on the device (rank 0): kernel time in GEMMs and in the rest, the device idle, launches and host-device syncs:\n\n"
            + common.md_table(
                [
                    "optimizer",
                    "step ms",
                    "profiled wall ms",
                    "GEMM ms",
                    "other kernels ms",
                    "device idle ms",
                    "launches",
                    "syncs",
                ],
                [
                    [
                        label,
                        ms,
                        k["wall_ms"],
                        k["gemm_ms"],
                        k["other_kernels_ms"],
                        k["idle_ms"],
                        k["launches"],
                        k["syncs"],
                    ]
                    for label, ms, k in kernels
                ],
            )
            + "\n"
        )
    rate = data.get("bf16_tflops")
    work = next((r["ns_tflop"] for r in results.values() if r.get("ns_tflop")), None)
    if rate and work:
        floor_ms = work["standard"] / rate * 1e3
        out += (
            f"\nNewton–Schulz FLOP floor: {work['standard']:.2f} TFLOP (standard iteration, every logical matrix once) "
            f"at the measured bf16 GEMM rate {rate:.0f} TFLOP/s = {floor_ms:.1f} ms.\n\n"
            + common.md_table(
                ["optimizer", "step ms", "step / floor", "its NS TFLOP"],
                [
                    [r["label"], r["step_ms"], r["step_ms"] / floor_ms, (r.get("ns_tflop") or {}).get("planned")]
                    for n, r in results.items()
                    if peers.is_muon_peer(n)
                ],
            )
            + "\n"
        )
    rates = data.get("host_device_gbps")
    moved = [(r["label"], r["step_ms"], r["offload_bytes"]) for r in results.values() if r.get("offload_bytes")]
    if rates and moved:
        rows = []
        for label, ms, b in moved:
            copy_ms = common.copy_ms(b, rates)
            rows.append([label, common.human_bytes(b["h2d"]), common.human_bytes(b["d2h"]), copy_ms, ms, ms / copy_ms])
        out += (
            f"\nCPU offload against its copies at the measured pinned host-device rates ({rates['h2d']:.1f} GB/s to the device, "
            f"{rates['d2h']:.1f} GB/s back; copy time = the longer direction, both directions overlapping):\n\n"
            + common.md_table(["optimizer", "to device", "to host", "copy ms", "step ms", "step / copy"], rows)
            + "\n"
        )
    return out


# (ours, peer, what, limit): ours / peer must not exceed limit.
TARGETS = (
    ("ours_exact", "megatron_adamw", "train_bytes", 1.1),
    ("ours_exact", "megatron_adamw", "dp_bytes", 1.0),
    ("ours_exact", "megatron_muon_duplicated", "train_bytes", 1.0),
    ("ours_exact", "megatron_muon_blockwise", "step_ms", 1.2),
)


def targets_table(results: Dict[str, Any], dp: int = 1) -> str:
    """The targets (bytes per train step vs AdamW and vs Megatron's duplicated Muon; step
    time vs Megatron's blockwise Muon) as measured ratios, met or not."""

    def value(r, what):
        if what == "dp_bytes":
            groups = r["train_bytes"].get("per_group_mean", {})
            return groups.get("dp", 0) + groups.get("expert_dp", 0)
        return sum(r[what]["per_rank_mean"].values()) if what.endswith("bytes") else r[what]

    rows = []
    for ours, peer, what, limit in TARGETS:
        if ours not in results or peer not in results:
            continue
        ratio = value(results[ours], what) / max(value(results[peer], what), 1e-12)
        label = {"train_bytes": "bytes per train step", "dp_bytes": "DP-group bytes per train step"}.get(
            what, "optimizer-step time"
        )
        rows.append(
            [
                f"{label}: {results[ours]['label']} / {results[peer]['label']}",
                ratio,
                f"<= {limit}",
                "met" if ratio <= limit else "NOT met",
            ]
        )
    rows += _fsdp_target_rows(results, dp)
    return common.md_table(["measure", "ratio", "target", ""], rows) if rows else ""


def _fsdp_target_rows(results: Dict[str, Any], dp: int) -> List[list]:
    """Megatron-FSDP's targets (issue 26): what ours holds and sends on Megatron-FSDP against
    Megatron-FSDP + AdamW, and against the DistributedOptimizer path."""
    ours, adamw = results.get("ours_exact_fsdp"), results.get("megatron_adamw_fsdp")
    if ours is None or adamw is None:
        return []

    def dp_bytes(r):
        groups = r["train_bytes"].get("per_group_mean", {})
        return groups.get("dp", 0) + groups.get("expert_dp", 0)

    def row(label, ratio):
        return [label, ratio, "<= 1", "met" if ratio <= 1 else "NOT met"]

    out = [
        row(
            f"parameters + gradients + optimizer state per rank: {ours['label']} / {adamw['label']}",
            ours["held_max"]["total"] / adamw["held_max"]["total"],
        )
    ]
    ddp = results.get("ours_exact")
    if ddp is not None:
        held = lambda r: r["held_max"]["params"] + r["held_max"]["grads"]  # noqa: E731
        out.append(
            row(
                f"parameters + gradients per rank: {ours['label']} / ({ddp['label']} / DP{dp})",
                held(ours) * dp / held(ddp),
            )
        )
    base = results.get(peers.BASELINE)
    if ddp is not None and base is not None:
        tp = lambda r: r["train_bytes"].get("per_group_mean", {}).get("tp", 0)  # noqa: E731
        bound = tp(ddp) - tp(base)  # the exact update's TP bytes on the owner-aligned DDP path
        out.append(
            row(
                f"DP-group bytes per train step: {ours['label']} / ({adamw['label']} + TP lower bound {int(bound)})",
                dp_bytes(ours) / (dp_bytes(adamw) + bound),
            )
        )
    return out


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer steps (and the small model on a GPU)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--model", choices=sorted(MODELS), help="default: tiny on the CPU, medium (quick: small) on a GPU")
    p.add_argument("--world", type=int, help="ranks (default: 4 on the CPU, $WORLD_SIZE or 1 on a GPU)")
    p.add_argument("--tp", type=int, help="tensor-parallel size (default: 2 on the CPU, 1 on a GPU)")
    p.add_argument("--peers", help="comma-separated (default: all), from: " + ", ".join(peers.PEERS))
    p.add_argument("--steps", type=int, help="timed steps (default 10; quick 5)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gbs", type=int, default=8, help="global batch size")
    p.add_argument("--mbs", type=int, default=2, help="micro-batch size")
    p.add_argument(
        "--probe-layers", type=int, help="orthogonalization error on the first N layers (default: all; 0: no probe)"
    )
    p.add_argument(
        "--interleave",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="build all peers, then let them take turns step by step (default: on the CPU, where "
        "other processes add noise; off on a GPU, where all peers may not fit at once)",
    )
    p.add_argument(
        "--muon-chunk-numel",
        type=int,
        help="our pipeline's chunk size in matrix elements (default: MuonConfig's); small chunks show "
        "the offload's per-chunk bound on the device-resident momentum",
    )
    p.add_argument(
        "--trace-dir", type=Path, help="CUDA: write each peer's profiled step as a Chrome trace (step_PEER.json) here"
    )
    p.add_argument("--out", type=Path, default=common.DEFAULT_OUT)
    p.add_argument("--name", default="optimizer_step", help="output file name (without extension)")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> Dict[str, Any]:
    import os

    device = common.pick_device(args.device)
    on_gpu = device == "cuda"
    world = args.world or (int(os.environ.get("WORLD_SIZE", "1")) if on_gpu else 4)
    tp = args.tp or (1 if on_gpu else 2)
    model = args.model or ("tiny" if not on_gpu else "small" if args.quick else "medium")
    steps = args.steps or (5 if args.quick else 10)
    names = [n.strip() for n in (args.peers or ",".join(peers.PEERS)).split(",") if n.strip()]
    for n in names:
        if n not in peers.PEERS:
            raise SystemExit(f"unknown peer {n!r}; use names from {peers.PEERS}")
    if args.peers is None and not peers.have_megatron_muon():
        print(
            "emerging-optimizers is not installed: Megatron-core's own Muon is left out (pip install "
            "emerging-optimizers)"
        )
        names = [n for n in names if not n.startswith("megatron_muon")]
    probe_layers = args.probe_layers if args.probe_layers is not None else (None if model == "tiny" else 1)
    started = time.perf_counter()
    interleave = args.interleave if args.interleave is not None else not on_gpu
    ranks = common.launch(
        rank_main,
        world,
        MODELS[model],
        names,
        steps,
        args.warmup,
        args.gbs,
        args.mbs,
        probe_layers,
        interleave,
        args.muon_chunk_numel,
        str(args.trace_dir) if args.trace_dir else None,
        device=device,
        tp=tp,
    )
    data: Dict[str, Any] = dict(
        env=common.environment(device),
        layout=dict(world=world, tp=tp, dp=world // tp),
        model=model,
        model_spec=MODELS[model],
        model_description=describe_model(MODELS[model]),
        interleaved=interleave,
        probe_layers=probe_layers,
        steps=steps,
        warmup=args.warmup,
        gbs=args.gbs,
        mbs=args.mbs,
        muon_chunk_numel=args.muon_chunk_numel,
        peers=summarize(ranks, names),
        bf16_tflops=ranks[0].get("bf16_tflops"),
        host_device_gbps=ranks[0].get("host_device_gbps"),
        errors=orthogonalization_errors(ranks, device) if any(r["probe"] for r in ranks) else {},
    )
    data["wall_s"] = time.perf_counter() - started
    return data


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    data = run(args)
    if not common.is_main_process():
        return data
    md = markdown(data)
    paths = common.write_outputs(args.out, args.name, data, md)
    rows = [
        [
            r["label"],
            r["step_ms"],
            r["ratio"],
            common.human_bytes(r["memory_max"]),
            data["errors"].get(n, {}).get("vs_polar_mean"),
            data["errors"].get(n, {}).get("vs_ns_mean"),
        ]
        for n, r in data["peers"].items()
    ]
    print(common.text_table(["optimizer", "step ms", "/ AdamW", "state/rank", "err polar", "err NS"], rows))
    print(f"\nwrote {paths['json']} and {paths['markdown']} ({data['wall_s']:.0f} s)")
    return data


if __name__ == "__main__":
    from tools.bench.optimizer_step import main as _main  # ranks import the module by name

    _main()
