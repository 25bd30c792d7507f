"""Smoke tests of tools/bench at their smallest sizes (CPU, gloo): every script runs and
writes its JSON and markdown, the measured ratios are positive numbers, and the scale
model's bytes for the tiny model agree with the bytes counted in the measured run.

No timing is asserted anywhere: benchmarks report ratios, they do not gate tests.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from tools.bench import (
    checkpoint_memory,
    newton_schulz,
    ns_accuracy,
    optimizer_step,
    overlap_trace,
    plots,
    run_all,
    scale_model,
)

PEERS = (
    "megatron_adamw,megatron_muon_duplicated,ours_exact,ours_blockwise,ours_exact_offload,"
    "megatron_adamw_fsdp,ours_exact_fsdp"
)


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bench")


@pytest.fixture(scope="module")
def measured(out) -> dict:
    """One optimizer_step.py run: 4 gloo ranks (DP2 x TP2), 4 peers, 1 timed step."""
    optimizer_step.main(["--device", "cpu", "--peers", PEERS, "--steps", "1", "--warmup", "1", "--out", str(out)])
    return json.loads((out / "optimizer_step.json").read_text())


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.timeout(300)
def test_megatron_fsdp_holds_and_sends_what_issue_26_allows(measured):
    """Bytes (not times): on Megatron-FSDP (optim_grads_params, DP2 x TP2) ours holds no more
    parameters + gradients + optimizer state than Megatron-FSDP + AdamW; its parameters +
    gradients are 1/DP of the DistributedOptimizer path's; its DP-group bytes per train step
    exceed Megatron-FSDP + AdamW's by at most the exact update's TP lower bound."""
    peers = measured["peers"]
    ours, adamw, ddp = peers["ours_exact_fsdp"], peers["megatron_adamw_fsdp"], peers["ours_exact"]
    assert ours["held_max"]["total"] <= adamw["held_max"]["total"]
    held = lambda r: r["held_max"]["params"] + r["held_max"]["grads"]  # noqa: E731
    assert held(ours) * 2 <= held(ddp)
    groups = lambda r: r["train_bytes"]["per_group_mean"]  # noqa: E731
    bound = groups(ddp)["tp"] - groups(peers["megatron_adamw"])["tp"]
    assert bound > 0 and groups(ours)["dp"] <= groups(adamw)["dp"] + bound


@pytest.mark.timeout(300)
def test_optimizer_step_outputs(out, measured):
    assert (out / "optimizer_step.md").read_text().count("|") > 20
    assert set(measured["peers"]) == set(PEERS.split(","))
    assert measured["layout"] == {"world": 4, "tp": 2, "dp": 2}
    for name, row in measured["peers"].items():
        assert _positive(row["step_ms"]) and _positive(row["ratio"]) and _positive(row["memory_max"]), name
        assert _positive(sum(row["step_bytes"]["per_rank_mean"].values())), name
    assert measured["peers"]["megatron_adamw"]["ratio"] == 1.0
    # Muon keeps one fp32 momentum per matrix element where AdamW keeps two moments.
    assert measured["peers"]["ours_exact"]["memory_max"] < measured["peers"]["megatron_adamw"]["memory_max"]
    errors = measured["errors"]  # the probe reads whole TP pieces: not on Megatron-FSDP
    assert set(errors) == {"megatron_muon_duplicated", "ours_exact", "ours_blockwise", "ours_exact_offload"}
    for name, e in errors.items():
        assert all(_positive(e[k]) for k in ("vs_polar_mean", "vs_polar_max", "vs_ns_mean", "vs_ns_max")), name
    # Exact methods match full-matrix Newton–Schulz up to bf16 rounding; blockwise does not.
    assert errors["ours_exact"]["vs_ns_max"] < 0.15 and errors["megatron_muon_duplicated"]["vs_ns_max"] < 0.15
    assert errors["ours_blockwise"]["vs_ns_mean"] > 5 * errors["ours_exact"]["vs_ns_mean"]
    # CPU offload: no Muon state on the device between steps, during a step at most one
    # chunk's momentum and two chunks' masters (tests/dist/test_variants.py checks those
    # bounds with many small chunks).
    off, on = measured["peers"]["ours_exact_offload"], measured["peers"]["ours_exact"]
    assert off["muon_state_max"]["device_idle"] == 0
    assert 0 < off["muon_state_max"]["device_step_peak"] <= off["muon_state_max"]["staging_bound"]
    assert off["muon_state_max"]["offloaded"] == on["muon_state_max"]["device_idle"]
    assert _positive(off["step_ratio_to_offload_off"])


@pytest.mark.timeout(300)
def test_scale_model_bytes_match_the_counted_bytes(out, measured):
    """The scale model of the tiny model, per collective kind, within TOLERANCE (1 %) of
    what count_collectives counted (it leaves out only the grad-norm all-reduces)."""
    check = scale_model.validate(measured)
    schemes = {r["scheme"] for r in check["rows"]}
    assert schemes == {"adamw", "megatron_duplicated", "ours_exact", "ours_blockwise", "adamw_fsdp", "ours_exact_fsdp"}
    assert check["ok"], [r for r in check["rows"] if r["checked"] and r["rel_err"] > scale_model.TOLERANCE]
    kinds = {(r["scheme"], r["what"]) for r in check["rows"] if r["checked"]}
    assert ("ours_exact", "step() all_to_all") in kinds
    # Megatron-FSDP's own index, modelled on meta tensors: our pieces and its reduce-scatters.
    assert {("ours_exact_fsdp", "step() all_to_all"), ("adamw_fsdp", "train step reduce_scatter")} <= kinds
    assert ("megatron_duplicated", "step() all_gather") in kinds
    # The command line, on one real-size scenario, with the same validation.
    data = scale_model.main(
        ["--scenario", "llama3_8b", "--validate", str(out / "optimizer_step.json"), "--out", str(out)]
    )
    rows = data["predictions"]["llama3_8b"]["schemes"]
    assert all(_positive(r["ratio"]) for r in rows.values())
    # Duplicated runs every TP-sharded matrix whole on each TP rank: more FLOPs than blockwise.
    assert rows["megatron_duplicated"]["ns_flops_total"] > 1.5 * rows["megatron_blockwise"]["ns_flops_total"]
    assert data["validation"]["ok"] and (out / "scale_model.md").exists()
    # Without a pipeline the whole step is exposed with "none"; "forward" hides no more than it.
    exposed = data["predictions"]["llama3_8b"]["exposed"]
    assert exposed["none_ms"] == pytest.approx(rows["ours_exact"]["step_ms"])
    assert 0 <= exposed["forward_concurrent_ms"] <= exposed["forward_ms"] <= exposed["none_ms"]
    assert "Exposed step" in (out / "scale_model.md").read_text()


@pytest.mark.timeout(200)
def test_scale_model_splits_only_where_it_shortens_the_step():
    """The planner's priced split rule, through the scale model: Llama 3 8B / 64 GPUs is
    predicted no slower than without split Newton–Schulz, Moonlight / 128 faster (by 5 % and
    more with standard NS)."""
    from dataclasses import replace

    from tools.bench import model_shapes

    for name in ("llama3_8b", "moonlight_16b_a3b"):
        recipe, cluster, _ = scale_model.SCENARIOS[name]
        m = model_shapes.from_recipe(recipe, cluster.gpus, cluster.tp, cluster.pp, cluster.ep, cluster.etp)
        # The default ('auto': Gram NS from aspect 3) and standard NS, whose larger FLOPs make
        # Moonlight's step bound by its largest matrices.
        for method in ("auto", "standard"):
            c = replace(cluster, muon=(("muon_ns_method", method),))
            split = scale_model.predict(m, c)["schemes"]["ours_exact"]["step_ms"]
            unsplit = scale_model.predict(m, replace(c, muon=(*c.muon, ("muon_ns_max_ranks", 1))))
            assert split <= unsplit["schemes"]["ours_exact"]["step_ms"], (name, method, split, unsplit)
            if name == "moonlight_16b_a3b" and method == "standard":
                assert split < 0.95 * unsplit["schemes"]["ours_exact"]["step_ms"]


def test_stream_concurrency_runs_its_plumbing_on_the_cpu():
    """stream_concurrency.py on the CPU (no streams: serially, a small model): both the
    whole model's and one layer's Newton-Schulz are timed against the forward."""
    from tools.bench import stream_concurrency

    rows = stream_concurrency.main(["--reps", "1"])
    assert [r["ns_layers"] for r in rows] == [2, 1] and all(r["device"] == "cpu" for r in rows)
    assert all(_positive(r[k]) for r in rows for k in ("forward_ms", "ns_ms", "both_ms"))


@pytest.mark.timeout(120)
def test_newton_schulz_quick(out):
    # One timed call each: a smoke test (fp16 GEMMs, inside Gram NS, are slow on some CPUs).
    data = newton_schulz.main(["--quick", "--device", "cpu", "--warmup", "0", "--reps", "1", "--out", str(out)])
    assert (out / "newton_schulz.md").exists()
    timed = [r for r in data["rows"] if r["ms"] is not None]
    assert {r["impl"] for r in timed} >= {"megatron_muon", "torch.optim.Muon", "emerging_optimizers"}
    for r in timed:
        assert _positive(r["tflops"]) and _positive(r["speedup_of_ours"]) and _positive(r["peak_fraction"]), r
        assert r["rel_err"] < 0.05, r  # every implementation computes the same iteration


def test_ns_accuracy_quick(out):
    """Distances to the float64 iteration: fp32 at rounding level for both methods; with a
    16-bit compute dtype Gram NS (fp16 inside) is closer than standard NS (bf16)."""
    data = ns_accuracy.main(["--quick", "--device", "cpu", "--out", str(out)])
    assert (out / "ns_accuracy.md").exists() and len(data["rows"]) == 2 * len(ns_accuracy.SHAPES)
    for r in data["rows"]:
        assert r["standard fp32"] < 1e-4 and r["gram fp32"] < 1e-4, r
        assert 0 < r["gram bf16"] < r["standard bf16"] < 0.2, r


@pytest.mark.timeout(200)
def test_overlap_trace(out):
    data = overlap_trace.main(["--device", "cpu", "--hidden", "64", "--out", str(out)])
    assert (out / "overlap_trace.md").exists()
    if plots.have_matplotlib():
        assert (out / "overlap_trace.png").stat().st_size > 1000
    for rank in data["ranks"]:
        # Order, not time: the expert step runs inside the dense pipeline's first gather
        # window with the overlap on, and after it without.
        assert rank["evidence"]["overlap"]["expert_ns_inside_gather0_window"]
        assert not rank["evidence"]["sequential"]["expert_ns_inside_gather0_window"]


@pytest.mark.timeout(120)
def test_plots_and_docs_regeneration(out, measured, tmp_path):
    pytest.importorskip("matplotlib")
    written = plots.make_all(out)
    assert {p.name for p in written} >= {
        "optimizer_step_time.png",
        "optimizer_step_bytes.png",
        "optimizer_step_error.png",
    }
    assert all(p.stat().st_size > 1000 for p in written)
    docs = tmp_path / "benchmarks.md"
    shutil.copy(run_all.DOCS, docs)
    run_all.main(["--docs-only", "--out", str(out), "--docs", str(docs)])
    text = docs.read_text()
    block = text.split("<!-- BEGIN generated: optimizer_step -->", 1)[1].split(
        "<!-- END generated: optimizer_step -->"
    )[0]
    assert "Megatron DistOpt + AdamW" in block and "optimizer_step_time.png" in block


@pytest.mark.timeout(600)
def test_checkpoint_memory_quick(out):
    """Bytes (not memory, which the allocator blurs at this size): our save sends nothing
    beyond what Megatron's own dp_reshardable save sends (no gather), and less than its
    fully_reshardable save, which gathers on every rank."""
    data = checkpoint_memory.main(["--dp", "1", "2", "--hidden", "64", "--ffn", "128", "--out", str(out)])
    assert (out / "checkpoint_memory.md").read_text().count("ours / ") == 4
    r = data["results"]
    assert r["2/ours"]["save_sent"] <= r["2/adamw_dp_reshardable"]["save_sent"] + 64
    assert r["2/ours"]["save_sent"] * 100 < r["2/adamw_fully_reshardable"]["save_sent"]
    assert all(_positive(x["save_extra"]) for x in r.values())
    assert data["verdict"]["dp"] == 2 and "criterion" in (out / "checkpoint_memory.md").read_text()
    if plots.have_matplotlib():
        assert (out / "checkpoint_memory.png").stat().st_size > 1000


@pytest.mark.timeout(300)
def test_scripts_leave_tracked_files_alone(tmp_path):
    """docs/recipes.md's scale-model command, run as a user runs it (no --out): its results
    go to the untracked runs/bench, docs/bench and docs/benchmarks.md stay as they are."""
    import os
    import subprocess
    import sys

    from tests.helpers import REPO

    if not (REPO / ".git").exists():
        pytest.skip("needs the git checkout")
    status = ["git", "status", "--porcelain", "--", "docs"]
    before = subprocess.run(status, cwd=REPO, capture_output=True, text=True, check=True).stdout
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_MUON_BENCH_OUT"}
    cmd = [sys.executable, "tools/bench/scale_model.py", "--recipe", "moonlight_16b_a3b", "--gpus", "64", "--ep", "8"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "runs/bench/scale_model.json" in proc.stdout, proc.stdout[-500:]
    assert subprocess.run(status, cwd=REPO, capture_output=True, text=True, check=True).stdout == before
