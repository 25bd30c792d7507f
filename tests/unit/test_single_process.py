"""A plain ``python tools/pretrain_gpt.py`` (no launcher) meets only itself
(``cpu.set_single_process_rendezvous``): its store binds a port the kernel picks at that
moment, so no other process can take it in between (a port found free, then bound later by
the store, was taken once: ``EADDRINUSE``)."""

from __future__ import annotations

import subprocess
import sys

RENDEZVOUS = """
import os
import torch.distributed as dist
from megatron_muon.megatron_lm.cpu import set_single_process_rendezvous
for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
    os.environ.pop(name, None)
set_single_process_rendezvous()
print("port", os.environ["MASTER_PORT"], flush=True)
dist.init_process_group("gloo")
print("world", dist.get_world_size(), flush=True)
"""


def test_a_single_process_rendezvous_leaves_no_window_for_another_process():
    from tests.helpers import REPO

    done = subprocess.run([sys.executable, "-c", RENDEZVOUS], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "port 0" in done.stdout and "world 1" in done.stdout, done.stdout
