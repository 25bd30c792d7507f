"""The refactor guard: the step restructured around one generator and one shard map (issue
"The Muon step as one generator over one shard map"), and its storage split into one
backend per data-parallel engine (issue "One storage backend per data-parallel engine"),
compute bitwise what the code before them computed.

``tests/data/refactor_guard.json`` holds recordings, each the fingerprints of short fp32
(and bf16) training runs at one commit on one machine: at a0738cf, the last commit before
the redesign of the step (Intel Xeon), and at 1aa3f41, the last before the storage backends
(AMD EPYC; every layout, Megatron-FSDP's first). A run is compared with its recording on
this machine where there is one, else with the oldest. A run holds
its parameters, fp32 masters, Muon momentum, AdamW moments and second moments after
three steps, and its losses. The layouts cover DP2 x TP2 (GQA and MLA with QK-Clip; variance
reduction, cautious weight decay, CPU offload of momentum and masters, both buffer
layouts, all TP modes, Gram NS, finer logical matrices), DP2 x EP2 (MoE, with and
without the expert overlap), DP4 with multi-rank Newton–Schulz, and Megatron-FSDP at DP2 and
DP2 x TP2 (GQA and MLA with QK-Clip, variance reduction, cautious weight decay). An
offloaded run is held to its run with the state on the device (``OFFLOAD_TWINS``).
Regenerate only when a change means to alter the numbers:
``python -m tests.dist.test_refactor_guard --record [LAYOUT ...]`` (a new recording of
those layouts on this machine, all by default; other machines' recordings are kept).

Bitwise holds only on the CPU model and torch build that recorded a run (another CPU's BLAS
kernels round differently: measured on an AMD EPYC against the Intel Xeon record, every
fp32 tensor's sum moved by at most 6.5e-7 of its absolute sum, a bf16 run with the
cautious mask by 1.2e-3). Elsewhere the fp32 runs are held to 1e-5 of each tensor's
absolute sum (and the losses to 1e-5 relative), 15x what was seen; the 16-bit runs, whose
cautious masks flip with rounding, are compared on the recording machine only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from megatron_muon.testing import run_distributed
from tests.helpers.guard import OFFLOAD_TWINS, RUNS, fingerprints, guard_runs
from tools.bench.common import cpu_model

RECORD = Path(__file__).resolve().parents[1] / "data" / "refactor_guard.json"
ELSEWHERE = 1e-5
"""Off the recording machine: largest change of a tensor's sum (and absolute sum) as a
fraction of its absolute sum, and of a loss, relative."""


def _recording_machine(recording: dict) -> bool:
    import torch

    return recording.get("machine") == cpu_model() and recording.get("torch") == torch.__version__


def _recording_of(record: dict, run: str) -> dict:
    """The recording of ``run`` made on this machine, else the oldest."""
    holding = [r for r in record["recordings"] if run in r["runs"]]
    return next((r for r in holding if _recording_machine(r)), holding[0])


def _changed(tensors: dict, expected: dict, bitwise: bool) -> list:
    """What differs from the record: any bit (``bitwise``), else beyond :data:`ELSEWHERE`."""
    out = []
    for key, got in tensors.items():
        want = expected[key]
        if key == "losses":
            a, b = [float.fromhex(x) for x in got], [float.fromhex(x) for x in want]
            if (got != want) if bitwise else any(abs(x - y) > ELSEWHERE * abs(y) for x, y in zip(a, b)):
                out.append(f"losses {a} vs {b}")
        elif (
            (got[0] != want[0]) if bitwise else max(abs(got[1] - want[1]), abs(got[2] - want[2])) > ELSEWHERE * want[2]
        ):
            out.append(f"{key} (sum {got[1]:.9g} vs {want[1]:.9g}, abs sum {got[2]:.9g} vs {want[2]:.9g})")
    return out


def _measure(layout: str) -> dict:
    world, kwargs, _ = RUNS[layout]
    return fingerprints(run_distributed(guard_runs, world, layout, timeout_s=600, **kwargs))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", list(RUNS))
def test_step_is_bitwise_what_it_was(layout):
    record = json.loads(RECORD.read_text())
    measured = _measure(layout)
    for name, tensors in measured.items():
        # Offloaded momentum computes what the device path does now (tests.helpers.guard).
        recording = _recording_of(record, OFFLOAD_TWINS.get(name, name))
        bitwise = _recording_machine(recording)
        if not bitwise and name.startswith("bf16"):
            continue
        expected = recording["runs"][OFFLOAD_TWINS.get(name, name)]
        assert sorted(tensors) == sorted(expected), f"{name}: other tensors than recorded"
        changed = _changed(tensors, expected, bitwise)
        assert not changed, f"{name}: {len(changed)} tensors changed, e.g. " + "; ".join(changed[:4])


if __name__ == "__main__" and "--record" in sys.argv:
    import subprocess

    import torch

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    layouts = [a for a in sys.argv[1:] if a != "--record"] or list(RUNS)
    runs = {}
    for layout in layouts:
        runs.update(_measure(layout))
    record = json.loads(RECORD.read_text()) if RECORD.exists() else {"recordings": []}
    for older in filter(_recording_machine, record["recordings"]):
        older["runs"] = {k: v for k, v in older["runs"].items() if k not in runs}
    record["recordings"] = [r for r in record["recordings"] if r["runs"]]
    record["recordings"].append({"commit": commit, "machine": cpu_model(), "torch": torch.__version__, "runs": runs})
    RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"recorded {len(runs)} runs at {commit} into {RECORD}")
