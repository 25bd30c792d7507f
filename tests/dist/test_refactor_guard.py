"""The refactor guard: the step restructured around one generator and one shard map (issue
"The Muon step as one generator over one shard map"), and its storage split into one
backend per data-parallel engine (issue "One storage backend per data-parallel engine"),
compute bitwise what the code before them computed; so must every restructuring after them.

``tests/data/refactor_guard.json`` holds, per run, the fingerprints of short fp32 (and bf16)
training runs: parameters, fp32 masters, Muon momentum, AdamW moments and second moments
after three steps, and the losses (``tests.helpers.guard``). The layouts cover DP2 x TP2
(GQA and MLA with QK-Clip; variance reduction, cautious weight decay, CPU offload of
momentum and masters, both buffer layouts, all TP modes, Gram NS, finer logical matrices),
DP2 x EP2 (MoE, with and without the expert overlap), DP4 with multi-rank Newton–Schulz, and
Megatron-FSDP at DP2 and DP2 x TP2. An offloaded run is held to its run with the state on
the device (``OFFLOAD_TWINS``).

Bits depend on the kernels torch runs, not on the CPU's name (``tests.helpers.kernels``).
A run is recorded bitwise under the kernels of the recording machine and under those it
runs with ``ATEN_CPU_CAPABILITY=avx2`` and ``=default`` (keys that name the machine's MKL
and oneDNN paths too, so only that kind of CPU has them). Where this environment's kernels
match a recording, the run must equal it bit for bit. Elsewhere it is compared with the
recording machine's own within ``MARGIN`` times the noise measured at recording: how far
the same code lands when the recording machine runs other kernels (``VARIANTS``).

Recorded at 7d1d1fe on an Intel Xeon with AVX-512 and AMX, whose native runs equal the
recording made before the redesign of the step (a0738cf, same kind of Xeon) bit for bit.
Noise: fp32 runs move a tensor's sum by at most 1.1e-5 of its absolute sum (Megatron-FSDP
MLA's LayerNorm moments under MKL's AVX2 path; most runs 1e-7 to 2e-6), a loss by at most
2e-7 (two ulps); the bf16 run, whose cautious masks flip with rounding, by 3.4e-3 and
1.8e-4 (oneDNN's AVX2 path). ATen's avx2 kernels change no bit of these runs here, its
default kernels all. The recording made before the storage backends (1aa3f41, on an AMD
EPYC, whose MKL computes unlike any path it takes on this Xeon) lies at most 1.25x the
noise from this one's native runs (losses 1.6x). A one-ulp change of the fp32 update scale
moves sums by 0.8e-7 to 4.8e-7, inside the noise: the bitwise comparison sees it, the
comparison on other kernels catches only changes beyond ``MARGIN`` times the noise.

Regenerate only when a change means to alter the numbers:
``python -m tests.dist.test_refactor_guard --record [LAYOUT ...]`` (runs those layouts,
all by default, under every variant, a few minutes; their entries are replaced).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from megatron_muon.testing import run_distributed
from tests.helpers.guard import OFFLOAD_TWINS, RUNS, fingerprints, guard_runs
from tests.helpers.kernels import KERNEL_ENV, kernel_key

RECORD = Path(__file__).resolve().parents[1] / "data" / "refactor_guard.json"
MARGIN = 10.0
"""Off the recorded kernels: the tolerance of a run, as a multiple of the noise measured for
it at recording (an AMD EPYC's runs lay within 1.25x of it)."""
ULP = 2.0**-23
"""The least noise a tolerance assumes (a loss is quantized at one fp32 ulp: 1.2e-7)."""
VARIANTS = {
    "ATen avx2": dict(ATEN_CPU_CAPABILITY="avx2"),
    "ATen default": dict(ATEN_CPU_CAPABILITY="default"),
    "MKL avx2": dict(MKL_ENABLE_INSTRUCTIONS="AVX2"),
    "oneDNN avx2": dict(ONEDNN_MAX_CPU_ISA="AVX2"),
    "oneDNN avx512 bf16": dict(ONEDNN_MAX_CPU_ISA="AVX512_CORE_BF16"),
    "all avx2": dict(ATEN_CPU_CAPABILITY="avx2", MKL_ENABLE_INSTRUCTIONS="AVX2", ONEDNN_MAX_CPU_ISA="AVX2"),
}
"""The recording machine run as other CPUs: what the noise of every run is measured over."""
BITWISE = ("native", "ATen avx2", "ATen default")
"""Variants recorded bitwise (their keys name the recording machine's MKL and oneDNN paths,
so no other kind of CPU has them); the others only measure the noise."""


def distances(got: dict, want: dict) -> Dict[str, float]:
    """Tensor key -> how far ``got`` lies from ``want``: the change of the tensor's sum and of
    its absolute sum as a fraction of its absolute sum; for ``losses``, the largest relative
    change of a loss."""
    out = {}
    for key, g in got.items():
        w = want[key]
        if key == "losses":
            pairs = [(float.fromhex(a), float.fromhex(b)) for a, b in zip(g, w)]
            out[key] = max(abs(a - b) / abs(b) for a, b in pairs)
        else:
            out[key] = max(abs(g[1] - w[1]), abs(g[2] - w[2])) / w[2] if w[2] else float(g[1:] != w[1:])
    return out


def noise(got: dict, want: dict) -> List[float]:
    """[largest tensor distance, largest loss distance] of one run (:func:`distances`)."""
    d = distances(got, want)
    return [max(v for k, v in d.items() if k != "losses"), d["losses"]]


def _measure(layout: str) -> dict:
    world, kwargs, _ = RUNS[layout]
    return fingerprints(run_distributed(guard_runs, world, layout, timeout_s=600, **kwargs))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", list(RUNS))
def test_step_is_bitwise_what_it_was(layout):
    record = json.loads(RECORD.read_text())["runs"]
    kernels = kernel_key()
    measured = _measure(layout)
    for name, tensors in measured.items():
        entry = record[OFFLOAD_TWINS.get(name, name)]
        same = [r for r in entry["recordings"] if kernels in r["kernels"]]
        expected = (same or entry["recordings"])[0]["fingerprints"]
        assert sorted(tensors) == sorted(expected), f"{name}: other tensors than recorded"
        if same:
            changed = changed_tensors(tensors, expected)
            how = "bitwise, on the kernels that recorded it"
        else:
            tensor_noise, loss_noise = (max(max(v[i] for v in entry["noise"].values()), ULP) for i in (0, 1))
            changed = changed_tensors(tensors, expected, MARGIN * tensor_noise, MARGIN * loss_noise)
            how = f"beyond {MARGIN:g}x the noise recorded ({tensor_noise:.1e}, losses {loss_noise:.1e}) on {kernels}"
        detail = [f"{k} ({_moved(k, tensors[k], expected[k])})" for k in changed[:4]]
        assert not changed, f"{name}: {len(changed)} tensors changed {how}, e.g. " + "; ".join(detail)


def changed_tensors(got: dict, want: dict, tensor_limit: Optional[float] = None, loss_limit: float = 0.0) -> List[str]:
    """The keys of ``got`` that differ from ``want``: in any bit, or, given ``tensor_limit``,
    by more than it (losses: ``loss_limit``) in :func:`distances`."""
    if tensor_limit is None:
        return sorted(
            k for k, g in got.items() if (g if k == "losses" else g[0]) != (want[k] if k == "losses" else want[k][0])
        )
    return sorted(k for k, d in distances(got, want).items() if d > (loss_limit if k == "losses" else tensor_limit))


def _moved(key: str, got, want) -> str:
    if key == "losses":
        return f"{[float.fromhex(x) for x in got]} vs {[float.fromhex(x) for x in want]}"
    return f"sum {got[1]:.9g} vs {want[1]:.9g}, abs sum {got[2]:.9g} vs {want[2]:.9g}"


def _record(layouts: List[str]) -> None:
    """Measure ``layouts`` under the native kernels and every variant, each in its own process
    (the variables act at torch's start); replace their runs' entries in :data:`RECORD`."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    base = {k: v for k, v in os.environ.items() if k not in KERNEL_ENV}
    results = {}
    for variant, env in {"native": {}, **VARIANTS}.items():
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, "-m", "tests.dist.test_refactor_guard", "--measure", f.name, *layouts]
            subprocess.run(cmd, env={**base, **env}, check=True)
            results[variant] = json.loads(Path(f.name).read_text())
        print(f"{variant}: {results[variant]['kernels']}", flush=True)
    native = results["native"]["runs"]
    for name, twin in OFFLOAD_TWINS.items():
        if name in native:
            assert native[name] == native[twin], f"{name} differs from {twin}: the offload computes otherwise"
    record = json.loads(RECORD.read_text()) if RECORD.exists() else {"runs": {}}
    for name in sorted(set(native) - set(OFFLOAD_TWINS)):
        recordings = []
        for variant in BITWISE:
            kernels, fp = results[variant]["kernels"], results[variant]["runs"][name]
            same = next((r for r in recordings if r["fingerprints"] == fp), None)
            if same is None:
                recordings.append({"kernels": [kernels], "fingerprints": fp})
            elif kernels not in same["kernels"]:
                same["kernels"].append(kernels)
        spread = {v: noise(results[v]["runs"][name], native[name]) for v in VARIANTS}
        record["runs"][name] = {"commit": commit, "recordings": recordings, "noise": spread}
    RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"recorded {len(native)} runs at {commit} into {RECORD}")


if __name__ == "__main__" and "--measure" in sys.argv:
    out, *layouts = sys.argv[sys.argv.index("--measure") + 1 :]
    runs = {}
    for layout in layouts:
        runs.update(_measure(layout))
    Path(out).write_text(json.dumps({"kernels": kernel_key(), "runs": runs}))
elif __name__ == "__main__" and "--record" in sys.argv:
    _record([a for a in sys.argv[1:] if a != "--record"] or list(RUNS))
