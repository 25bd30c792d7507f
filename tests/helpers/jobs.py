"""Launching the main job and the tools as a user does (subprocesses, on the CPU), and
finding what a job left running: shared by the e2e modules."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

from tests.helpers import REPO

PRETRAIN = [sys.executable, str(REPO / "tools" / "pretrain_gpt.py")]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
TWO_RANKS = [TORCHRUN, "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", "127.0.0.1:0", str(REPO / "tools" / "pretrain_gpt.py")]  # fmt: skip
CONVERT = [sys.executable, str(REPO / "tools" / "convert_checkpoint.py")]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|")
OFF_LAYOUT = "but DDP was built without megatron_muon.owner_aligned_param_layout()"


def job_env(**extra: str) -> Dict[str, str]:
    """The environment of a launched job: on the CPU everywhere (CI has no GPU; two ranks on
    a one-GPU machine would share it); W&B offline (a test never reaches the network)."""
    return dict(os.environ, PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="", WANDB_MODE="offline", **extra)


def launch(cmd: List[str], timeout: int = 200) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=timeout)


def run(cmd: List[str], timeout: int = 200) -> str:
    """stdout of a run that must succeed, with Muon on its owner-aligned DDP buffers (the default)."""
    proc = launch(cmd, timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)}\nexit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    assert OFF_LAYOUT not in proc.stdout + proc.stderr, "Megatron-LM built DDP without our buffer layout"
    return proc.stdout


def losses(stdout: str) -> Dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in LOSS.finditer(stdout)}


def tagged_processes(tag: str) -> List[int]:
    """Processes whose environment carries ``tag`` (a job and everything it started)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if tag.encode() in f.read():
                    found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


def kill_tagged(tag: str) -> None:
    """SIGKILL whatever of a tagged job is still running (a test's clean-up)."""
    for pid in tagged_processes(tag):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
