#!/usr/bin/env python
"""What a checkpoint save costs in memory, measured as a user would see it.

``tools/pretrain_gpt.py`` (Megatron-LM's loop) under torchrun, ``--nproc`` CPU ranks of
data parallelism, ``--iters`` iterations on the tiny_gqa recipe widened to ``--hidden``
(4 layers, GQA, SwiGLU), once without a save and once with a save at the last iteration,
for Megatron's AdamW (its distributed optimizer) and for Muon. The figure is the peak
resident memory of the largest process of the job (``getrusage(RUSAGE_CHILDREN)``: the
kernel's high-water mark of each descendant, the largest of them), and a save's cost is
the difference between the two runs. Prints one table; ``--json`` writes it too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def _peak_mb(cmd, env) -> float:
    """Peak RSS (MB) of the largest process of ``cmd``, run in a fresh child that reports it."""
    probe = (
        "import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, p.returncode)"
    )
    out = subprocess.run([sys.executable, "-c", probe, *cmd], env=env, capture_output=True, text=True)
    kb, code = out.stdout.strip().splitlines()[-1].split()
    if code != "0":
        raise SystemExit(f"{' '.join(cmd)} failed ({code}):\n{out.stderr[-4000:]}")
    return int(kb) / 1024


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=2304)
    p.add_argument("--repeats", type=int, default=1, help="runs per cell; the table shows the smallest peak")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1", WANDB_MODE="offline")
    rows = {}
    with tempfile.TemporaryDirectory() as work:
        for optimizer in ("adam", "muon"):
            for save in (False, True):
                cmd = [
                    TORCHRUN, "--nnodes", "1", "--nproc-per-node", str(args.nproc), "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", "127.0.0.1:0", str(ROOT / "tools" / "pretrain_gpt.py"),
                    "--recipe", "tiny_gqa", "--optimizer", optimizer, "--num-layers", "4",
                    "--hidden-size", str(args.hidden), "--ffn-hidden-size", str(args.ffn),
                    "--num-attention-heads", "8", "--num-query-groups", "2", "--train-iters", str(args.iters),
                    "--lr-warmup-iters", "0", "--eval-iters", "0", "--micro-batch-size", "1",
                    "--global-batch-size", str(args.nproc), "--data-cache-path", os.path.join(work, "cache"),
                ]  # fmt: skip
                if save:
                    target = os.path.join(work, f"ckpt_{optimizer}")
                    cmd += ["--save", target, "--save-interval", str(args.iters)]
                peaks = []
                for _ in range(args.repeats):
                    if save:
                        subprocess.run(["rm", "-rf", target], check=True)
                    peaks.append(_peak_mb(cmd, env))
                rows[(optimizer, save)] = min(peaks)
    table = {
        opt: dict(
            without=rows[(opt, False)], with_save=rows[(opt, True)], save_cost=rows[(opt, True)] - rows[(opt, False)]
        )
        for opt in ("adam", "muon")
    }
    print(
        f"DP{args.nproc}, hidden {args.hidden}, ffn {args.ffn}, {args.iters} iterations; peak RSS of the largest process (MB)"
    )
    print(f"{'optimizer':<10}{'no save':>10}{'save':>10}{'save costs':>12}")
    for opt, r in table.items():
        print(f"{opt:<10}{r['without']:>10.1f}{r['with_save']:>10.1f}{r['save_cost']:>+12.1f}")
    print(f"Muon's save minus AdamW's: {table['muon']['save_cost'] - table['adam']['save_cost']:+.1f} MB")
    if args.json:
        args.json.write_text(json.dumps(dict(args=vars(args) | {"json": str(args.json)}, table=table), indent=1))


if __name__ == "__main__":
    main()
