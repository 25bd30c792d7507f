"""``tools/compare_optimizers.py``: AdamW against Muon on one recipe.

End to end (a few iterations of tiny_gqa, CPU subprocesses): the PNG, markdown and JSON
are written and the table has both optimizers. Unit tests: the interpolated "iterations to
reach AdamW's final validation loss", the reader of Megatron-LM's log lines and the table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO
from tools.compare_optimizers import iterations_to_reach, read_log, summarize, table

ROOT = REPO


@pytest.mark.timeout(240)
def test_compare_tiny_gqa(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # CPU everywhere, as the other driver tests
    # --adam-lr below the recipe's min-lr (0.001): the tool lowers AdamW's min-lr to match.
    cmd = [
        sys.executable,
        str(ROOT / "tools" / "compare_optimizers.py"),
        "--recipe",
        "tiny_gqa",
        "--out",
        str(out),
        "--train-iters",
        "6",
        "--eval-interval",
        "3",
        "--eval-iters",
        "1",
        "--adam-lr",
        "0.0005",
        "--data-cache-path",
        str(tmp_path / "cache"),
        "--keep-runs",
        "--",
        "--seed",
        "7",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| AdamW |" in proc.stdout and "| Muon |" in proc.stdout
    png = (out / "loss_curves.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    md = (out / "compare.md").read_text()
    assert "| AdamW | 0.0005 |" in md and "| Muon | 0.01 |" in md and "loss_curves.png" in md
    assert "--optimizer adam" in md and "--optimizer muon" in md and "--seed 7" in md
    data = json.loads((out / "compare.json").read_text())
    assert set(data["summary"]) == {"adam", "muon"}
    for opt, s in data["summary"].items():
        assert s["iterations"] == 6 and s["tokens_per_s"] > 0
        assert [it for it, _ in data["curves"][opt]["valid"]] == [3, 6]
        assert len(data["curves"][opt]["train"]) == 6
    assert data["target_valid_loss"] == data["summary"]["adam"]["final_valid_loss"]
    assert data["summary"]["adam"]["iters_to_adam_final_valid"] is not None  # AdamW reaches its own final loss
    assert (out / "runs" / "adam.log").is_file() and "[after training is done]" in (
        out / "runs" / "muon.log"
    ).read_text()
    # --replot draws the picture again from compare.json alone (no run): the same axes' data
    (out / "loss_curves.png").unlink()
    again = subprocess.run(cmd[:6] + ["--replot"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and (out / "loss_curves.png").read_bytes().startswith(b"\x89PNG"), again.stderr
    assert "adam.log" not in again.stdout


def test_iterations_to_reach_interpolates():
    valid = [(0, 6.0), (10, 4.0), (20, 3.0), (30, 2.5)]
    assert iterations_to_reach(valid, 3.5) == pytest.approx(15.0)  # halfway between 4.0 at 10 and 3.0 at 20
    assert iterations_to_reach(valid, 3.0) == pytest.approx(20.0)  # met exactly at an evaluation
    assert iterations_to_reach(valid, 6.5) == 0.0  # already there at the first evaluation
    assert iterations_to_reach(valid, 2.0) is None  # never reached
    # The first crossing counts, even if the loss rises again afterwards.
    assert iterations_to_reach([(0, 5.0), (10, 3.0), (20, 4.0), (30, 2.0)], 4.0) == pytest.approx(5.0)


def test_read_log_summarize_and_table():
    line = (
        " [2026-11-23 21:36:29.672696] iteration {i:8d}/      12 | consumed samples: {c:12d} | elapsed time per "
        "iteration (ms): 80.0 | learning rate: {lr:.6E} | global batch size:     8 | lm loss: {loss:.6E} | "
        "loss scale: 1.0 | grad norm: 3.105 | number of skipped iterations: {skip:3d} | number of nan iterations:   0 |"
    )
    lines = ["  seq_length ...................................... 64"]
    lines += [line.format(i=i, c=8 * i, lr=0.01 * min(i, 2) / 2, loss=6.0 - 0.1 * i, skip=0) for i in range(1, 13)]
    lines += [line.format(i=12, c=96, lr=0.01, loss=float("nan"), skip=1)]  # skipped: left out
    lines += [
        " validation loss at iteration 6 | lm loss value: 6.000000E+00 | lm loss PPL: 4.0E+02 | ",
        " validation loss at iteration 12 | lm loss value: 5.000000E+00 | lm loss PPL: 1.4E+02 | ",
        " validation loss at iteration 12 on validation set | lm loss value: 5.000000E+00 | ",  # same point
        " validation loss at iteration 12 on test set | lm loss value: 1.000000E+00 | ",
    ]
    train, valid, peak_lr, speed = read_log("\n".join(lines))
    assert [it for it, _ in train] == list(range(1, 13)) and valid == [(6, 6.0), (12, 5.0)] and peak_lr == 0.01
    assert speed == [pytest.approx(8 * 64 / 0.08)] * 12
    valid = [(0, 6.0), (12, 5.0)]
    s = summarize(train, valid, [100.0, 300.0, 200.0], target=5.5, peak_lr=peak_lr)
    assert s["final_train_loss"] == pytest.approx(6.0 - 0.1 * 7.5)  # mean of iterations 3..12
    assert s["final_valid_loss"] == s["best_valid_loss"] == 5.0 and s["tokens_per_s"] == 200.0
    assert s["iters_to_adam_final_valid"] == pytest.approx(6.0)
    never = dict(s, iters_to_adam_final_valid=None)
    text = table({"adam": s, "muon": never}, eval_interval=12)
    assert "| AdamW | 0.01 | 5.2500 | 5.0000 | 5.0000 | 200 | 6 of 12 |" in text
    assert "| Muon |" in text and "not reached" in text and "every 12 iterations" in text


def _variant_configs(flags_by_name: dict) -> dict:
    """In a fresh process: each variant's flags through Megatron-LM's parser and validation."""
    from megatron_muon.megatron_lm.integration import muon_config_from_megatron
    from megatron_muon.megatron_lm.launch import validated_args

    out = {}
    for name, flags in flags_by_name.items():
        cfg = muon_config_from_megatron(validated_args(["--recipe", "tiny_gqa", *flags]))
        out[name] = (cfg.muon_variance_reduction, cfg.muon_cautious_weight_decay)
    return out


def test_variants_are_driver_flags(tmp_path):
    """Every --variants entry adds a Muon run whose extra flags the driver accepts."""
    from megatron_muon.testing import run_distributed
    from tools.compare_optimizers import VARIANTS, driver_command, parse_args

    args, _ = parse_args(["--out", str(tmp_path), "--variants", "vr", "cautious"])
    assert args.variants == ["vr", "cautious"]
    for _, _, flags in VARIANTS.values():
        cmd = driver_command("muon", tmp_path, "tiny_gqa", extra=flags)
        assert cmd[-len(flags) :] == flags
    got = run_distributed(_variant_configs, 1, {n: v[2] for n, v in VARIANTS.items()}, timeout_s=200)[0]
    assert got == {"vr": (0.95, False), "cautious": (None, True)}


def test_master_port_reaches_torchrun(tmp_path):
    """--master-port with --nproc 2 runs torchrun on that port instead of --standalone (other
    jobs on the machine may hold torchrun's default port)."""
    from tools.compare_optimizers import driver_command, parse_args

    args, _ = parse_args(["--out", str(tmp_path), "--nproc", "2", "--master-port", "29871"])
    cmd = driver_command("muon", tmp_path, "tiny_gqa", nproc=args.nproc, master_port=args.master_port)
    assert "--standalone" not in cmd and cmd[cmd.index("--master-port") + 1] == "29871"
    assert "--standalone" in driver_command("muon", tmp_path, "tiny_gqa", nproc=2)
