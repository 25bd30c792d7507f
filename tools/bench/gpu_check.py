#!/usr/bin/env python
"""The first GPU in minutes: every check and measurement only a CUDA device can give, in
one command, each part time-boxed.

    python tools/bench/gpu_check.py --out DIR

Parts, in order (each runs as its own process with a time box; a part that overruns is
stopped and keeps what it had finished, so a slow part cannot starve the rest):

1. ``cuda_tier``: ``pytest tests/cuda`` (Newton–Schulz eager and compiled against float64,
   the main job on one GPU against the same run on the CPU, the offload's side-stream
   copies, the step finished in the next forward against the whole step; transformer-engine's
   layer specs where it is installed).
2. ``newton_schulz``: Newton–Schulz throughput at the recipes' real logical-matrix shapes
   (``newton_schulz.py --shapes recipes``), standard and Gram, eager and compiled, bf16, as
   TFLOP/s and as a fraction of the bf16 GEMM rate measured in the same run.
3. ``optimizer_step``: the optimizer-step peers on one GPU (Megatron's AdamW, Megatron-core's
   Muon, ours) at a model large enough to matter: step time and optimizer memory.
4. ``main_job``: ``tools/pretrain_gpt.py`` on one GPU, bf16, Muon against AdamW on the same
   model and tokens: iteration time over the iterations after warm-up, peak memory, and
   that both losses fall.

Writes ``DIR/gpu_check.json`` (device, versions, every figure), ``DIR/gpu_check.md`` (the
summary, also printed), ``DIR/gpu_check.log`` (every part's output) and
``DIR/gpu_check_parts.tar.gz`` (each part's own files). Exit status 1 only when a check
failed (a test, a crash, a loss that does not fall); a part skipped (no CUDA device) or
stopped at its time box is reported as such and is not a failure. Without CUDA every part
is skipped and the command exits 0: the plumbing still runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench import common

ROOT = common.REPO_ROOT
PLAN_LIMIT_S = 480
"""The whole command's plan (the sum of the time boxes) stays under eight minutes."""

MAIN_JOB_MODEL = [
    "--num-layers", "8", "--hidden-size", "2048", "--ffn-hidden-size", "5632",
    "--num-attention-heads", "16", "--num-query-groups", "4", "--seq-length", "1024",
    "--max-position-embeddings", "1024", "--micro-batch-size", "4", "--global-batch-size", "8",
]  # fmt: skip
"""The main job's model: tiny_gqa's recipe at the optimizer-step benchmark's ``medium`` size
(8 layers, d2048, GQA 16/4 heads, SwiGLU 5632, 1024 tokens; two micro-batches a step)."""
MAIN_JOB_LRS = ("3e-4", "1e-3")
"""The learning rates both optimizers train at, sane for a hidden-2048 model with AdamW; the
same for Muon, whose default update scale (``moonlight``, 0.2 sqrt(max(m, n))) matches
AdamW's update RMS so that AdamW's learning rates carry over. Each decays to a tenth."""
STEP_IN_FORWARD = ("--muon-step-overlap", "forward")
MAIN_JOB_RUNS = tuple(
    run
    for lr in MAIN_JOB_LRS
    for run in (
        (f"adam, lr {lr}", "adam", lr, ()),
        (f"muon, lr {lr}", "muon", lr, ("--muon-step-overlap", "none")),
    )
) + ((f"muon, lr {MAIN_JOB_LRS[-1]}, step in the forward", "muon", MAIN_JOB_LRS[-1], STEP_IN_FORWARD),)
"""The main job's runs, one after another on the same model and tokens: (name, optimizer,
learning rate, flags). Every run overlaps DDP's gradient reduce and parameter all-gather;
the last one also finishes Muon's step in the next forward (from DDP's forward
pre-hooks), which must log the same losses as the step whole at that rate."""
MAIN_JOB_WARMUP = 5
MAIN_JOB_TIMED = 30
MEMORY = re.compile(r"max allocated: ([0-9.]+) \| reserved: ([0-9.]+) \| max reserved: ([0-9.]+)")
OUTCOMES = "PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS"
PYTEST_RESULT = re.compile(rf"(?:^(tests/cuda/\S+) ({OUTCOMES})\b)|(?:\b({OUTCOMES}) (tests/cuda/\S+))", re.MULTILINE)
"""A test's outcome as ``pytest -v`` prints it, alone (``name OUTCOME``) or under xdist
(``[gw0] [ 50%] OUTCOME name``)."""


@dataclass(frozen=True)
class Part:
    """One time-boxed part of the check: what it runs and how its result is read."""

    name: str
    box_s: int
    what: str


PARTS = (
    Part(
        "cuda_tier",
        125,
        "pytest tests/cuda: Newton–Schulz on CUDA vs float64, the main job GPU vs CPU, offload, step overlap",
    ),
    Part("newton_schulz", 70, "Newton–Schulz TFLOP/s at the recipes' shapes, fraction of the measured bf16 peak"),
    Part("optimizer_step", 100, "optimizer-step peers on one GPU: step time, overhead, NS floor, optimizer memory"),
    Part("main_job", 180, "tools/pretrain_gpt.py on one GPU, bf16: AdamW and Muon at two learning rates each"),
)


# ---------------------------------------------------------------------------------------
# Running a part inside its box
# ---------------------------------------------------------------------------------------


def run_boxed(cmd: Sequence[str], box_s: float, log: Path, env: Dict[str, str]) -> Optional[int]:
    """Run ``cmd`` from the repository root with its output appended to ``log``; its exit
    code, or None when it outran ``box_s`` (its whole process group is then killed). Nothing
    outlives this process: the part is killed when it ends (a kill included), and its
    process group when it is interrupted (Ctrl-C reaches only this process's group)."""
    from megatron_muon.megatron_lm.process_lifetime import die_with_this_process

    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(list(cmd), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=die_with_this_process())  # fmt: skip
        try:
            return proc.wait(timeout=max(box_s, 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            out.write(f"\n[gpu_check] stopped at its time box ({box_s:.0f} s)\n")
            return None
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise


def part_env(work: Path) -> Dict[str, str]:
    """The parts' environment: the repository importable, output unbuffered, one inductor
    cache for every part (the CUDA tier's compiled kernels serve the throughput part)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor")
    return env


# ---------------------------------------------------------------------------------------
# The parts
# ---------------------------------------------------------------------------------------


def cuda_tier(box_s: float, work: Path, log: Path, env: Dict[str, str]) -> Dict[str, Any]:
    """The CUDA tier's tests, one line each (read as they finish: a stopped run keeps them)."""
    part_log = work / "cuda_tier.log"
    # Four workers: the tests compare numbers, not times, and most of them wait on compiles
    # and process start-ups.
    rc = run_boxed([sys.executable, "-m", "pytest", "tests/cuda", "-v", "-p", "no:cacheprovider", "-n", "4"],
                   box_s, part_log, env)  # fmt: skip
    text = part_log.read_text(errors="replace")
    _append(log, text)
    tests = read_pytest_outcomes(text)
    failed = sorted(n for n, o in tests.items() if o in ("FAILED", "ERROR"))
    status = "failed" if failed or (rc not in (0, None)) else "timed_out" if rc is None else "passed"
    failures = _pytest_failures(text) if failed or rc not in (0, None) else ""
    return dict(status=status, tests=tests, failed=failed, failure_text=failures[-6000:])


def read_pytest_outcomes(text: str) -> Dict[str, str]:
    """Test id -> outcome, from ``pytest -v`` output (plain or under xdist)."""
    tests: Dict[str, str] = {}
    for name, outcome, outcome_x, name_x in PYTEST_RESULT.findall(text):
        tests[name or name_x] = outcome or outcome_x
    return tests


def _pytest_failures(text: str) -> str:
    """The failure section of a pytest report (or the end of the output when there is none)."""
    start = text.find("= FAILURES =")
    return text[start:] if start >= 0 else text[-4000:]


def newton_schulz(box_s: float, work: Path, log: Path, env: Dict[str, str]) -> Dict[str, Any]:
    """Newton–Schulz rates at the recipes' shapes; a stopped run keeps its finished shapes."""
    cmd = [sys.executable, "tools/bench/newton_schulz.py", "--device", "cuda", "--shapes", "recipes",
           "--impls", "megatron_muon compiled,megatron_muon gram compiled,emerging_optimizers",
           "--warmup", "2", "--reps", "5", "--out", str(work), "--name", "newton_schulz_gpu"]  # fmt: skip
    rc = run_boxed(cmd, box_s, log, env)
    done, partial = work / "newton_schulz_gpu.json", work / "newton_schulz_gpu.partial.json"
    data = (
        json.loads(done.read_text()) if done.exists() else json.loads(partial.read_text()) if partial.exists() else {}
    )
    status = "passed" if rc == 0 else "timed_out" if rc is None else "failed"
    rows = [
        dict(shape=r["shape"], impl=r["impl"], ms=r["ms"], tflops=r["tflops"], of_peak=r["peak_fraction"],
             rel_err=r["rel_err"])
        for r in data.get("rows", [])
    ]  # fmt: skip
    return dict(status=status, peak_tflops=data.get("peak_tflops"), peak_note=data.get("peak_note"), rows=rows,
                gram=data.get("gram", []), shapes_done=data.get("shapes_done"))  # fmt: skip


STEP_PEERS = (
    "megatron_adamw",
    "megatron_muon_blockwise",
    "ours_exact_standard",
    "ours_exact",
    "ours_exact_one_chunk",
    "ours_exact_offload",
)
"""On one GPU (TP1) Megatron-core's blockwise Muon is exact too; ours with standard
Newton–Schulz on every matrix (the same arithmetic as Megatron's), at its defaults (Gram NS
where the aspect ratio favours it), at its defaults as one pipeline chunk (every matrix of a
shape in one stack: how much of the gap to the Newton–Schulz floor the default chunks'
kernel launches cost) and with its CPU offload (the side-stream copies at size)."""


def optimizer_step(box_s: float, work: Path, log: Path, env: Dict[str, str]) -> Dict[str, Any]:
    """The optimizer-step peers on one GPU (the ``medium`` model, 5 timed steps)."""
    cmd = [sys.executable, "tools/bench/optimizer_step.py", "--device", "cuda", "--model", "medium",
           "--steps", "5", "--warmup", "2", "--probe-layers", "0", "--peers", ",".join(STEP_PEERS), "--out", str(work), "--name", "optimizer_step_gpu"]  # fmt: skip
    rc = run_boxed(cmd, box_s, log, env)
    path = work / "optimizer_step_gpu.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    status = "passed" if rc == 0 else "timed_out" if rc is None else "failed"
    rates = data.get("host_device_gbps")
    peers = {
        name: dict(label=r["label"], step_ms=r["step_ms"], vs_adamw=r["ratio"], state_bytes=r["memory_max"],
                   peak_bytes=r.get("peak_bytes_max"),
                   vs_copies=r["step_ms"] / common.copy_ms(r["offload_bytes"], rates)
                   if rates and r.get("offload_bytes") else None)
        for name, r in data.get("peers", {}).items()
    }  # fmt: skip
    return dict(status=status, model=data.get("model_description"), peers=peers)


def main_job_command(optimizer: str, lr: str, iterations: int, flags: Sequence[str] = ()) -> List[str]:
    """One GPU, bf16: the main job on :data:`MAIN_JOB_MODEL` with ``optimizer`` at ``lr``
    (decaying to a tenth), DDP's gradient reduce and parameter all-gather overlapped."""
    return [sys.executable, "tools/pretrain_gpt.py", "--recipe", "tiny_gqa", *MAIN_JOB_MODEL, "--bf16",
            "--optimizer", optimizer, "--lr", lr, "--min-lr", repr(float(lr) / 10),
            "--overlap-grad-reduce", "--overlap-param-gather",
            "--train-iters", str(iterations), "--lr-warmup-iters", "0", "--eval-iters", "0",
            "--log-interval", "1", *flags]  # fmt: skip


def read_iterations(text: str) -> Dict[str, Any]:
    """Iteration times (ms) and losses by iteration, and the peak memory, from Megatron-LM's log."""
    from tools.compare_optimizers import ITERATION, LOSS_KEY, log_field

    found = {}
    for m in ITERATION.finditer(text):
        ms, loss = log_field(m.group(2), "elapsed time per iteration (ms)"), log_field(m.group(2), LOSS_KEY)
        if ms is not None and loss is not None:
            found[int(m.group(1))] = (ms, loss)
    memory = MEMORY.search(text)
    return dict(
        ms={i: v[0] for i, v in sorted(found.items())},
        loss={i: v[1] for i, v in sorted(found.items())},
        max_allocated_mb=float(memory.group(1)) if memory else None,
        max_reserved_mb=float(memory.group(3)) if memory else None,
    )


def main_job(box_s: float, work: Path, log: Path, env: Dict[str, str]) -> Dict[str, Any]:
    """:data:`MAIN_JOB_RUNS` on the same model and tokens; the box is shared, each run gets
    what is left of it. Megatron's start-up compiles its fused bias-activation functions
    with torch.compile in every process (tens of seconds, the same for every run): dynamo
    is off here, so every run uses its eager functions."""
    env = dict(env, TORCHDYNAMO_DISABLE="1")
    iterations = MAIN_JOB_WARMUP + MAIN_JOB_TIMED
    deadline = time.monotonic() + box_s
    runs: List[Dict[str, Any]] = []
    status = "passed"
    for position, (name, optimizer, lr, flags) in enumerate(MAIN_JOB_RUNS):
        part_log = work / f"main_job_{position}_{optimizer}.log"
        rc = run_boxed(main_job_command(optimizer, lr, iterations, flags), deadline - time.monotonic(), part_log, env)
        text = part_log.read_text(errors="replace")
        _append(log, text)
        seen = read_iterations(text)
        timed = [ms for i, ms in seen["ms"].items() if i > MAIN_JOB_WARMUP]
        losses = seen["loss"]
        runs.append(dict(
            name=name,
            optimizer=optimizer,
            lr=lr,
            rc=rc,
            iterations=len(seen["ms"]),
            median_ms=common.median(timed) if timed else None,
            timed_iterations=len(timed),
            losses=[losses[i] for i in sorted(losses)],
            first_loss=losses.get(1),
            last_loss=losses[max(losses)] if losses else None,
            max_allocated_mb=seen["max_allocated_mb"],
            max_reserved_mb=seen["max_reserved_mb"],
        ))  # fmt: skip
        if rc is None:
            status = "timed_out"
            break
        falls = bool(losses) and losses[max(losses)] < losses[min(losses)]
        if rc != 0 or len(seen["ms"]) != iterations or not falls:
            runs[-1]["failure_text"] = text[-4000:]
            status = "failed"
    # Every place of Muon's step runs the same arithmetic: at one learning rate, the same
    # losses, as far as each run got.
    same = True
    for lr in MAIN_JOB_LRS:
        muon = [r["losses"] for r in runs if r["optimizer"] == "muon" and r["lr"] == lr]
        same &= all(losses == muon[0][: len(losses)] or muon[0] == losses[: len(muon[0])] for losses in muon)
    if not same:
        status = "failed"
    ms = {r["name"]: r["median_ms"] for r in runs if r["timed_iterations"] == MAIN_JOB_TIMED}
    over_adamw = {lr: ms[f"muon, lr {lr}"] / ms[f"adam, lr {lr}"] for lr in MAIN_JOB_LRS
                  if ms.get(f"muon, lr {lr}") and ms.get(f"adam, lr {lr}")}  # fmt: skip
    whole = ms.get(f"muon, lr {MAIN_JOB_LRS[-1]}")
    return dict(status=status, model=" ".join(MAIN_JOB_MODEL), warmup=MAIN_JOB_WARMUP, runs=runs, median_ms=ms,
                muon_over_adamw=over_adamw, muon_losses_same=same,
                over_step_whole={n: t / whole for n, t in ms.items() if n.endswith("step in the forward") and whole})  # fmt: skip


def _append(log: Path, text: str) -> None:
    with open(log, "a") as out:
        out.write(text)


RUNNERS: Dict[str, Callable[[float, Path, Path, Dict[str, str]], Dict[str, Any]]] = {
    "cuda_tier": cuda_tier,
    "newton_schulz": newton_schulz,
    "optimizer_step": optimizer_step,
    "main_job": main_job,
}


# ---------------------------------------------------------------------------------------
# The whole check
# ---------------------------------------------------------------------------------------


def run(parts: Sequence[Part], out: Path, cuda: bool) -> Dict[str, Any]:
    """Every part in order (each skipped without CUDA); the results as one dictionary."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "gpu_check.log"
    log.write_text("")
    results: Dict[str, Any] = {}
    env_info = common.environment("cuda" if cuda else "cpu")
    data: Dict[str, Any] = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        work = Path(tmp)
        env = part_env(work)
        for part in parts:
            t0 = time.monotonic()
            if not cuda:
                result: Dict[str, Any] = dict(status="skipped", reason="no CUDA device")
            else:
                _append(log, f"\n===== {part.name} (box {part.box_s} s) =====\n")
                print(f"[gpu_check] {part.name} (box {part.box_s} s) ...", flush=True)
                try:
                    result = RUNNERS[part.name](part.box_s, work, log, env)
                except Exception as exc:  # a bug in reading a part's result must not lose the others
                    result = dict(status="failed", error=f"{type(exc).__name__}: {exc}")
            result.update(box_s=part.box_s, seconds=round(time.monotonic() - t0, 1), what=part.what,
                          date=env_info["date"])  # fmt: skip
            results[part.name] = result
            data = dict(env=env_info, plan_s=sum(p.box_s for p in parts), wall_s=round(time.monotonic() - started, 1),
                        parts=results)  # fmt: skip
            common.write_outputs(out, "gpu_check", data, markdown(data))  # after every part: a killed run keeps it
            if cuda:
                print(f"[gpu_check] {part.name}: {result['status']} in {result['seconds']} s", flush=True)
        with tarfile.open(out / "gpu_check_parts.tar.gz", "w:gz") as tar:
            for path in sorted(work.iterdir()):
                if path.name != "inductor":
                    tar.add(path, arcname=path.name)
    return data


def merge(data: Dict[str, Any], earlier: Dict[str, Any]) -> Dict[str, Any]:
    """``data`` with the parts it did not run taken from an earlier run's results (each
    keeps its date and the run's device is checked): finish a check whose first try lost
    some parts, without spending device time on the parts that passed."""
    if earlier["env"]["device_name"] != data["env"]["device_name"]:
        raise SystemExit(
            f"--merge: that run was on {earlier['env']['device_name']}, this one on {data['env']['device_name']}"
        )
    parts = {}
    for part in PARTS:
        if part.name in data["parts"]:
            parts[part.name] = data["parts"][part.name]
        elif part.name in earlier["parts"]:
            parts[part.name] = dict(earlier["parts"][part.name])
            parts[part.name].setdefault("date", earlier["env"]["date"])
    return dict(data, parts=parts, merged_from=earlier["env"])


def exit_status(data: Dict[str, Any]) -> int:
    """1 when any part failed; skipped and timed-out parts are not failures."""
    return int(any(p["status"] == "failed" for p in data["parts"].values()))


def markdown(data: Dict[str, Any]) -> str:
    """The summary: one line per part, then each measured part's table."""
    parts = data["parts"]
    lines = [
        f"GPU check: plan {data['plan_s']} s by its time boxes, ran {data['wall_s']} s.",
        "",
        common.provenance(data["env"]),
    ]
    if data.get("merged_from"):
        lines += ["", f"Parts not run this time come from the run of {data['merged_from']['date']} on the same device "
                      f"(`{data['merged_from']['command']}`); each part's date is in the table."]  # fmt: skip
    lines += [
        "",
        common.md_table(
            ["part", "status", "seconds", "box (s)", "date", "what"],
            [
                [
                    n,
                    p["status"] + (f" ({p['reason']})" if p.get("reason") else ""),
                    p["seconds"],
                    p["box_s"],
                    p.get("date"),
                    p["what"],
                ]
                for n, p in parts.items()
            ],
        ),  # fmt: skip
    ]
    tier = parts.get("cuda_tier", {})
    if tier.get("tests"):
        lines += ["", "**CUDA tier**", "",
                  common.md_table(["test", "outcome"], [[n, o] for n, o in tier["tests"].items()])]  # fmt: skip
    ns = parts.get("newton_schulz", {})
    if ns.get("rows"):
        lines += ["", f"**Newton–Schulz, 5 steps, bf16** (peak: {ns['peak_tflops']:.0f} TFLOP/s, {ns['peak_note']})", "",
                  common.md_table(["shape", "implementation", "median ms", "TFLOP/s", "of peak", "rel. diff vs fp32 NS"],
                                  [[r["shape"], r["impl"], r["ms"], r["tflops"], r["of_peak"], r["rel_err"]]
                                   for r in ns["rows"]])]  # fmt: skip
    step = parts.get("optimizer_step", {})
    if step.get("peers"):
        lines += ["", f"**Optimizer step on one GPU** ({step['model']})", "",
                  common.md_table(["optimizer", "step ms", "/ AdamW", "optimizer state", "peak GPU memory",
                                   "/ its host-device copies (CPU offload; goal <= 1.5)"],
                                  [[r["label"], r["step_ms"], r["vs_adamw"], common.human_bytes(r["state_bytes"]),
                                    common.human_bytes(r["peak_bytes"]) if r["peak_bytes"] else None,
                                    r.get("vs_copies")]
                                   for r in step["peers"].values()])]  # fmt: skip
    job = parts.get("main_job", {})
    if job.get("runs"):
        runs = job["runs"] if isinstance(job["runs"], list) else [dict(r, name=n) for n, r in job["runs"].items()]
        lines += ["", f"**Main job on one GPU, bf16** (tiny_gqa's recipe with {job['model']}; median of the "
                      f"iterations after {job['warmup']}, runs in the order listed)", "",
                  common.md_table(["run", "iterations", "median ms / iteration", "loss first -> last",
                                   "max allocated MiB"],
                                  [[r["name"], r["iterations"], r["median_ms"], f"{r['first_loss']} -> {r['last_loss']}",
                                    r["max_allocated_mb"]] for r in runs])]  # fmt: skip
        over_adamw = job.get("muon_over_adamw")
        if isinstance(over_adamw, dict):
            for lr, ratio in over_adamw.items():
                lines += ["", f"Muon / AdamW iteration time at lr {lr}: {ratio:.3f}"]
        elif over_adamw:  # an older run's single ratio (--merge)
            lines += ["", f"Muon / AdamW iteration time: {over_adamw:.3f}"]
        for name, ratio in job.get("over_step_whole", {}).items():
            lines += ["", f"{name} / the step whole at that rate, iteration time: {ratio:.3f}"]
        if "muon_losses_same" in job:
            lines += ["", f"Muon's runs logged {'the same' if job['muon_losses_same'] else 'DIFFERENT'} losses."]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json / .md / .log")
    p.add_argument(
        "--parts",
        default=",".join(p.name for p in PARTS),
        help="comma-separated subset, in the plan's order (default: all): " + ", ".join(p.name for p in PARTS),
    )
    p.add_argument(
        "--merge",
        type=Path,
        metavar="JSON",
        help="an earlier gpu_check.json of this device: the parts not run now are taken from it",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    import torch

    args = parse_args(argv)
    wanted = [n.strip() for n in args.parts.split(",") if n.strip()]
    unknown = sorted(set(wanted) - set(RUNNERS))
    if unknown:
        raise SystemExit(f"--parts: unknown {unknown}; choose from {[p.name for p in PARTS]}")
    earlier = json.loads(args.merge.read_text()) if args.merge else None  # read before anything runs
    data = run([p for p in PARTS if p.name in wanted], args.out, torch.cuda.is_available())
    if earlier is not None:
        data = merge(data, earlier)
        common.write_outputs(args.out, "gpu_check", data, markdown(data))
    print(markdown(data))
    return exit_status(data)


if __name__ == "__main__":
    sys.exit(main())
