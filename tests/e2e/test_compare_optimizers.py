"""``tools/compare_optimizers.py``: the optimizer study (peers x learning rates x seeds).

End to end (the tool's tiny configuration: two peers, two learning rates each, one seed, a
few iterations of tiny_gqa on the CPU): interrupted after two runs, started again, it runs
only the other two; the tables, the plots and ``--replot``; a finished run of another command
is refused. Unit tests: the pass rule and the statistics on made-up runs, the reader
of Megatron-LM's log lines, every peer's flags through Megatron-LM's validation.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO
from tests.helpers.jobs import tagged_processes
from tools.compare_optimizers import (
    PEERS,
    Cell,
    decayed_to,
    driver_command,
    lr_grid,
    main,
    parse_args,
    plan,
    read_back,
    read_log,
    remove_logs,
)
from tools.study_report import iterations_to_reach, summarize, tables

TOOL = [sys.executable, str(REPO / "tools" / "compare_optimizers.py")]


def _study(out, cache, *more):
    return TOOL + [
        "--out", str(out), "--peers", "adamw", "muon", "--lr", "adamw=0.001,0.002", "--lr", "muon=0.005,0.01",
        "--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1", "--data-cache-path", str(cache), *more,
    ]  # fmt: skip


@pytest.mark.timeout(300)
def test_tiny_study_resumes_after_an_interruption(tmp_path):
    out, cache = tmp_path / "study", tmp_path / "cache"
    tag = f"study-{os.getpid()}-{time.monotonic_ns()}"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", MEGATRON_MUON_TEST_TAG=tag)
    cmd = _study(out, cache, "--keep-runs")
    # SIGINT as a terminal delivers it (a shell that started pytest in the background left it ignored)
    first = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    try:
        deadline = time.monotonic() + 200
        while len(list(out.glob("cells/*/*.json"))) < 2 and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        # Ctrl-C to the tool alone, in the middle of its third run: that run ends with it
        first.send_signal(signal.SIGINT)
        _, said = first.communicate(timeout=30)
        assert first.returncode == 130 and len(said.strip().splitlines()) == 1, said[-3000:]
        assert said.startswith("compare_optimizers.py: interrupted;"), said
        deadline = time.monotonic() + 10
        while tagged_processes(tag) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not tagged_processes(tag), "a run of the killed study is still running"
    finally:
        with contextlib.suppress(ProcessLookupError):  # whatever is left, if the assertion failed
            os.killpg(first.pid, signal.SIGKILL)
    finished = {p: p.read_bytes() for p in out.glob("cells/*/*.json")}
    assert len(finished) == 2, sorted(finished)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[study] 2 of 4 runs read back" in proc.stdout
    assert proc.stdout.count("[study] python tools/pretrain_gpt.py") == 2 and "[study] 4/4 done" in proc.stdout
    assert all(p.read_bytes() == data for p, data in finished.items())  # read back, not run again
    # the table: each peer at its best learning rate, the grid, the commands
    md = (out / "study.md").read_text()
    assert "| AdamW | 0.00" in md and "| Muon, exact (ours) | 0.0" in md and "lr 0.005" in md
    assert md.count("python tools/pretrain_gpt.py") == 4 and "--seed 1234" in md
    data = json.loads((out / "study.json").read_text())
    peers = data["study"]["peers"]
    assert set(peers) == {"adamw", "muon"} and data["study"]["target"] == peers["adamw"]["final_valid_mean"]
    for s in peers.values():
        assert len(s["grid"]) == 2 and s["seeds"] == 1 and s["iterations"] == 4
        assert [it for it, _ in s["valid"]] == [2, 4] and s["tokens_per_iteration"] > 0
    for png in ("curves.png", "lr_sweep.png"):
        assert (out / png).read_bytes().startswith(b"\x89PNG"), png
        (out / png).unlink()
    assert main(["--out", str(out), "--replot"]) == 0  # from study.json alone
    assert (out / "lr_sweep.png").is_file() and (out / "curves.png").is_file()
    # a finished cell of another command (the study's settings changed): refused, left as it was
    cell = sorted(finished)[0]
    with pytest.raises(SystemExit, match="holds a run of another command"):
        read_back(cell, json.loads(finished[cell])["command"] + " --micro-batch-size 2")
    assert all(p.read_bytes() == data for p, data in finished.items())


def _run(peer, lr, seed, valid, tokens=1000):
    return dict(peer=peer, lr=lr, seed=seed, valid=valid, train=[(i, v) for i, v in valid], tokens_per_s=1.0,
                tokens_per_iteration=tokens)  # fmt: skip


def test_pass_rule_and_best_learning_rate():
    """Three seeds each; AdamW's best lr sets the target (its mean final loss, 3.0). Muon's
    best lr (0.02) reaches target - 0.004 / sqrt(3) between its evaluations at 20 and 30."""
    runs = []
    for seed, d in ((1, -0.01), (2, 0.0), (3, 0.01)):
        runs.append(_run("adamw", 0.001, seed, [(10, 4.0 + d), (20, 3.5 + d), (30, 3.2 + d)]))
        runs.append(_run("adamw", 0.002, seed, [(10, 3.8 + d), (20, 3.3 + d), (30, 3.0 + d)]))
        runs.append(_run("muon", 0.02, seed, [(10, 3.5 + d), (20, 3.1 + d), (30, 2.9 + d)]))
        runs.append(_run("muon", 0.04, seed, [(10, 3.6), (20, math.nan), (30, math.nan)]))  # diverged
    study = summarize(runs, reference="adamw", target=None)
    adamw, muon = study["peers"]["adamw"], study["peers"]["muon"]
    assert study["target"] == pytest.approx(3.0) and adamw["best_lr"] == 0.002 and muon["best_lr"] == 0.02
    assert muon["final_valid_mean"] == pytest.approx(2.9) and muon["final_valid_spread"] == pytest.approx(0.01)
    assert muon["grid"][0.04]["mean"] == math.inf  # a diverged run loses, it is not left out
    level = 3.0 - 0.004 / math.sqrt(3)
    assert muon["tokens_to_target"] == pytest.approx((20 + (3.1 - level) / (3.1 - 2.9) * 10) * 1000)
    assert adamw["tokens_to_target"] is None  # its own final mean is the target: not beaten by the margin
    text = tables(study, {"adamw": "AdamW", "muon": "Muon"})
    assert "| Muon | 0.02 (grid edge) | 2.9000 ± 0.0100 (3) | 25,115 | 0.84 |" in text and "**3.0000 ± 0.0100**" in text
    # a target given: one seed needs the whole margin
    one = summarize([r for r in runs if r["seed"] == 2], reference="adamw", target=3.2)
    assert one["peers"]["adamw"]["tokens_to_target"] == pytest.approx((20 + (3.3 - 3.196) / 0.3 * 10) * 1000)


def test_iterations_to_reach_interpolates():
    valid = [(0, 6.0), (10, 4.0), (20, 3.0), (30, 2.5)]
    assert iterations_to_reach(valid, 3.5) == pytest.approx(15.0)  # halfway between 4.0 at 10 and 3.0 at 20
    assert iterations_to_reach(valid, 3.0) == pytest.approx(20.0)  # met exactly at an evaluation
    assert iterations_to_reach(valid, 6.5) == 0.0  # already there at the first evaluation
    assert iterations_to_reach(valid, 2.0) is None  # never reached
    # The first crossing counts, even if the loss rises again afterwards.
    assert iterations_to_reach([(0, 5.0), (10, 3.0), (20, 4.0), (30, 2.0)], 4.0) == pytest.approx(5.0)


def test_read_log():
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
    got = read_log("\n".join(lines))
    assert [it for it, _ in got["train"]] == list(range(1, 13)) and got["valid"] == [(6, 6.0), (12, 5.0)]
    assert got["peak_lr"] == 0.01 and got["tokens_per_s"] == pytest.approx(8 * 64 / 0.08)
    assert got["tokens_per_iteration"] == 8 * 64


def _peer_configs(flags_by_name: dict) -> dict:
    """In a fresh process: each peer's flags through Megatron-LM's parser and validation."""
    from megatron_muon.megatron_lm.integration import muon_config_from_megatron
    from megatron_muon.megatron_lm.launch import validated_args

    out = {}
    for name, flags in flags_by_name.items():
        args = validated_args(["--recipe", "tiny_gqa", "--bf16", "--tensor-model-parallel-size", "2", *flags], 2)
        cfg = muon_config_from_megatron(args) if args.optimizer == "muon" else None
        # ours reads the TP mode from MuonConfig (exact unless given); Megatron-core's from its flag
        tp_mode = cfg.muon_tp_mode if cfg and args.muon_impl == "megatron_muon" else args.muon_tp_mode
        out[name] = (args.optimizer, args.muon_impl, tp_mode, cfg and cfg.muon_variance_reduction,
                     cfg and cfg.muon_cautious_weight_decay)  # fmt: skip
    return out


def test_peers_are_driver_flags():
    """Every peer's flags pass Megatron-LM's validation and mean what the peer's name says."""
    from megatron_muon.testing import run_distributed

    got = run_distributed(_peer_configs, 1, {n: list(p.flags) for n, p in PEERS.items()}, timeout_s=200)[0]
    assert got["adamw"][0] == "adam"
    assert got["muon"][1:3] == ("megatron_muon", "exact") and got["muon_blockwise"][2] == "blockwise"
    for mode in ("blockwise", "duplicated", "distributed"):
        name = "megatron_muon" if mode == "blockwise" else f"megatron_muon_{mode}"
        assert got[name][1:3] == ("megatron", mode), (name, got[name])
    assert got["muon_vr"][3] == 0.95 and got["muon_cautious"][4] is True


def test_plan_grid_and_port(tmp_path):
    """Seeds outermost, each peer's first run early; --lr per peer or for all; --master-port
    reaches torchrun with --nproc 2 (other jobs may hold torchrun's default port)."""
    grid = lr_grid(["adamw=0.001,0.002", "0.01"], ["adamw", "muon"], recipe_lr=None)
    assert grid == {"adamw": [0.01], "muon": [0.01]}  # a later --lr for every peer wins
    grid = lr_grid(["adamw=0.001,0.002"], ["adamw", "muon"], recipe_lr=0.01)
    assert grid == {"adamw": [0.001, 0.002], "muon": [0.01]}
    cells = plan(["adamw", "muon"], grid, [1, 2])
    assert [c.name for c in cells[:3]] == ["adamw/lr0.001_seed1", "muon/lr0.01_seed1", "adamw/lr0.002_seed1"]
    assert len(cells) == 6
    with pytest.raises(SystemExit):
        lr_grid(["sgd=0.1"], ["adamw"], recipe_lr=0.01)
    args, _ = parse_args(["--out", str(tmp_path), "--nproc", "2", "--master-port", "29871"])
    cmd = driver_command(Cell("muon", 0.01, 1), "tiny_gqa", nproc=args.nproc, master_port=args.master_port)
    assert "--standalone" not in cmd and cmd[cmd.index("--master-port") + 1] == "29871"
    assert "--standalone" in driver_command(Cell("muon", 0.01, 1), "tiny_gqa", nproc=2)
    # Each lr decays to a tenth of itself, as the recipe's (lr 0.01, min-lr 0.001) does.
    low = driver_command(Cell("adamw", 0.0005, 7), "tiny_gqa")
    assert low[low.index("--min-lr") + 1] == "5e-05" and low[low.index("--seed") + 1] == "7"
    assert "--min-lr" not in driver_command(Cell("muon", 0.01, 1), "tiny_gqa")  # the recipe's own
    assert decayed_to(0.02, 0.01, 0.001) == pytest.approx(0.002) and decayed_to(0.02, None, 0.001) is None
    assert decayed_to(0.0005, None, 0.001) == 0.0005 and decayed_to(0.02, 0.01, None) is None


def test_removing_logs_keeps_what_the_study_did_not_write(tmp_path):
    """Without --keep-runs the study removes its runs' logs, never the rest of OUT/runs/ (a
    user's --out may hold a runs/ folder of their own)."""
    cells = plan(["adamw", "muon"], {"adamw": [0.001], "muon": [0.01]}, [1])
    for cell in cells:
        log = tmp_path / "runs" / f"{cell.name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("a run's output")
    (tmp_path / "runs" / "muon" / "notes.txt").write_text("a user's notes")
    (tmp_path / "runs" / "theirs.log").write_text("another job's log")
    remove_logs(tmp_path, cells)
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert left == ["runs", "runs/muon", "runs/muon/notes.txt", "runs/theirs.log"], left
    (tmp_path / "runs" / "muon" / "notes.txt").unlink()
    (tmp_path / "runs" / "theirs.log").unlink()
    remove_logs(tmp_path, cells)  # nothing of the study's left: its folders go
    assert not (tmp_path / "runs").exists()


SWALLOWED_CTRL_C = """
import os, signal, sys
from pathlib import Path
from tools import compare_optimizers
compare_optimizers.catch_every_interrupt()
def ctrl_c_now():  # as a terminal's Ctrl-C landing just as a run is forked
    os.kill(os.getpid(), signal.SIGINT)
    sum(range(100000))  # Python runs the handler here, inside the at-fork handler, which swallows its raise
os.register_at_fork(after_in_parent=ctrl_c_now)
try:
    compare_optimizers.run_driver([sys.executable, "-c", "import time; time.sleep(60)"], Path(sys.argv[1]))
except KeyboardInterrupt:
    sys.exit(130)
"""


def test_a_ctrl_c_python_swallowed_still_ends_the_run(tmp_path):
    """A Ctrl-C that lands while a run is being forked raises its KeyboardInterrupt inside
    the fork's at-fork handlers, where Python swallows it ("Exception ignored in ..."): the
    study went on and finished every run with exit code 0 (seen once in the suite). The
    tool's handler remembers it: the run is killed, the interrupt raised within the
    driver's half-second poll, and nothing is printed for the swallowed one."""
    tag = f"driver-{os.getpid()}-{time.monotonic_ns()}"
    env = dict(os.environ, MEGATRON_MUON_TEST_TAG=tag, PYTHONPATH=str(REPO))
    started = time.monotonic()
    # Ctrl-C as a terminal delivers it (pytest-xdist's workers leave SIGINT ignored, and a
    # process started so keeps it ignored: the tool then installs no handler)
    proc = subprocess.run([sys.executable, "-c", SWALLOWED_CTRL_C, str(tmp_path / "run.log")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    assert proc.returncode == 130, proc.stdout + proc.stderr
    assert proc.stderr == "", proc.stderr
    assert time.monotonic() - started < 50  # not the run's 60 s
    assert not tagged_processes(tag), "the run outlived the interrupt"
