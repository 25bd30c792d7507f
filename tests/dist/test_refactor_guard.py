"""The refactor guard: the step restructured around one generator and one shard map (issue
"The Muon step as one generator over one shard map") computes bitwise what the code before
it computed.

``tests/data/refactor_guard.json`` holds the fingerprints of short fp32 (and one bf16)
training runs recorded at commit a0738cf, the last commit before the redesign:
parameters, fp32 masters, Muon momentum, AdamW moments and second moments after three
steps, and the losses. The layouts cover DP2 x TP2 (GQA and MLA with QK-Clip; variance
reduction, cautious weight decay, CPU offload of momentum and masters, both buffer
layouts, all TP modes, Gram NS, finer logical matrices), DP2 x EP2 (MoE, with and
without the expert overlap) and DP4 with multi-rank Newton–Schulz. An offloaded run is held
to its run with the state on the device (``OFFLOAD_TWINS``). Regenerate only when a change
means to alter the numbers: ``python -m tests.dist.test_refactor_guard --record``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from megatron_muon.testing import run_distributed
from tests.helpers.guard import OFFLOAD_TWINS, RUNS, fingerprints, guard_runs

RECORD = Path(__file__).resolve().parents[1] / "data" / "refactor_guard.json"


def _measure(layout: str) -> dict:
    world, kwargs, _ = RUNS[layout]
    return fingerprints(run_distributed(guard_runs, world, layout, timeout_s=600, **kwargs))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", list(RUNS))
def test_step_is_bitwise_what_it_was(layout):
    recorded = json.loads(RECORD.read_text())["runs"]
    measured = _measure(layout)
    for name, tensors in measured.items():
        # Offloaded momentum computes what the device path does now (tests.helpers.guard).
        expected = recorded[OFFLOAD_TWINS.get(name, name)]
        assert sorted(tensors) == sorted(expected), f"{name}: other tensors than recorded"
        changed = [
            f"{key} (sum {tensors[key][1]:.9g} vs {expected[key][1]:.9g}, abs sum {tensors[key][2]:.9g} vs "
            f"{expected[key][2]:.9g})" if key != "losses" else f"losses {tensors[key]} vs {expected[key]}"
            for key in tensors
            if tensors[key] != expected[key] and (key == "losses" or tensors[key][0] != expected[key][0])
        ]
        assert not changed, f"{name}: {len(changed)} tensors changed, e.g. " + "; ".join(changed[:4])


if __name__ == "__main__" and "--record" in sys.argv:
    import subprocess

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    runs = {}
    for layout in RUNS:
        runs.update(_measure(layout))
    RECORD.write_text(json.dumps({"commit": commit, "runs": runs}, indent=1, sort_keys=True) + "\n")
    print(f"recorded {len(runs)} runs at {commit} into {RECORD}")
