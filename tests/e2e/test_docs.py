"""The documentation is executable: every fenced shell block in docs/*.md runs (from the
repository root, with this interpreter's environment first on PATH) and must succeed,
unless the line right before it is ``<!-- not-tested: reason -->`` (installs, GPU
clusters, long runs). The static checks (python blocks compile, links, the config table)
are in ``tests/unit/test_docs_static.py``.

Benchmark scripts in the docs write to a temporary directory ($MEGATRON_MUON_BENCH_OUT),
never over the committed results in docs/bench.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.helpers.docs import SHELL


@pytest.mark.timeout(240)
@pytest.mark.parametrize("block", SHELL, ids=lambda b: b.id)
def test_shell_block_runs(block, tmp_path):
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["MEGATRON_MUON_BENCH_OUT"] = str(tmp_path / "bench")
    env.setdefault("PYTHONWARNINGS", "ignore")
    result = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", block.text],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=230,
    )
    assert result.returncode == 0, (
        f"{block.id} failed ({result.returncode}):\n{block.text}\n--- stdout\n{result.stdout[-3000:]}\n"
        f"--- stderr\n{result.stderr[-3000:]}"
    )
