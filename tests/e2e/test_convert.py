"""Checkpoint conversion (Megatron AdamW <-> Muon), inspection, atomic saves and clear
errors, on real Megatron-core checkpoints (CPU, gloo)."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from megatron_muon.checkpoint.integrity import write_manifest
from megatron_muon.checkpoint.save_lock import LOCK
from megatron_muon.testing import models as M
from megatron_muon.testing import run_distributed
from tests.helpers import REPO
from tests.helpers.training import GBS, MBS, build

ROOT = str(REPO)
SPEC = dict(kind="gqa")
FULLY_RESHARDABLE = {"distrib_optim_sharding_type": "fully_reshardable"}


def _megatron_adam(spec):
    """Megatron's DistributedOptimizer + AdamW with our tests' lr (param groups, which
    Megatron matches by their settings, then line up with converted checkpoints)."""
    from tests.helpers.training import BASE_CFG

    chunks = M.build_model_chunks(spec)
    M.canonical_init_(chunks, seed=0)
    model = M.wrap_ddp(chunks, chunks[0].config)
    opt = M.megatron_adam_optimizer(
        model, lr=BASE_CFG["lr"], min_lr=BASE_CFG["min_lr"], weight_decay=BASE_CFG["weight_decay"]
    )
    return chunks, model, opt


def _save_megatron_adam(path):
    """Megatron's own DistributedOptimizer + AdamW, 2 steps, saved fully reshardable."""
    from megatron.core import dist_checkpointing

    from megatron_muon.matrices import unwrap

    spec = M.TinyModelSpec(**SPEC)
    chunks, model, opt = _megatron_adam(spec)
    for tokens in M.synthetic_batches(spec, GBS, 2):
        M.train_step(model, opt, tokens, MBS, spec)
    model_sd = {"model0": unwrap(model[0]).sharded_state_dict()}
    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(
        {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, metadata=FULLY_RESHARDABLE)}, path
    )
    write_manifest(path)  # as Megatron-LM's save does under use_megatron_muon()
    return M.gather_canonical_state(chunks)


def _load_muon_and_train(path):
    from megatron_muon.checkpoint import load_checkpoint

    spec = M.TinyModelSpec(**SPEC)
    chunks, model, opt, sched = build(spec)
    load_checkpoint(path, model, opt)
    weights = M.gather_canonical_state(chunks)
    losses = []
    for tokens in M.synthetic_batches(spec, GBS, 3, seed=1):
        loss, ok = M.train_step(model, opt, tokens, MBS, spec)
        assert ok
        losses.append(loss)
    return dict(weights=weights, losses=losses, state=M.gather_canonical_optimizer_state(model, opt))


def _save_muon(path):
    from megatron_muon.checkpoint import save_checkpoint

    spec = M.TinyModelSpec(**SPEC)
    chunks, model, opt, sched = build(spec)
    for tokens in M.synthetic_batches(spec, GBS, 2):
        M.train_step(model, opt, tokens, MBS, spec)
    save_checkpoint(path, model, opt, extra={"iteration": 2})
    return M.gather_canonical_state(chunks)


def _load_megatron_adam_and_train(path):
    """Megatron-LM's own load path for its distributed optimizer."""
    from megatron.core import dist_checkpointing

    from megatron_muon.matrices import unwrap

    spec = M.TinyModelSpec(**SPEC)
    chunks, model, opt = _megatron_adam(spec)
    # Megatron's DistributedOptimizer with plain torch AdamW (no transformer-engine/Apex)
    # cannot build a loading state dict before its first step (its state_dict() asserts
    # on the missing 'step'); Megatron's own remedy, used by its FSDP path, is this.
    for sub in opt.chained_optimizers:
        sub._init_optimizer_states_with_dummy_values()
    model_sd = {"model0": unwrap(model[0]).sharded_state_dict()}
    state = {
        "model": model_sd,
        "optimizer": opt.sharded_state_dict(model_sd, is_loading=True, metadata=FULLY_RESHARDABLE),
    }
    loaded = dist_checkpointing.load(state, path)
    unwrap(model[0]).load_state_dict(loaded["model"]["model0"])
    opt.load_state_dict(loaded["optimizer"])
    weights = M.gather_canonical_state(chunks)
    losses = [M.train_step(model, opt, t, MBS, spec)[0] for t in M.synthetic_batches(spec, GBS, 3, seed=1)]
    return dict(weights=weights, losses=losses)


def _same(a, b):
    a, b = M.merge_canonical_states(a), M.merge_canonical_states(b)
    return all(torch.equal(a[k], b[k]) for k in a)


def latest(root: str) -> str:
    """The iteration directory Megatron-LM's tracker file in ``root`` names."""
    with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
        return os.path.join(root, f"iter_{int(f.read()):07d}")


def convert(*args) -> str:
    """Run tools/convert_checkpoint.py as a user would; returns its stdout."""
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"), *args],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.timeout(600)
def test_adam_to_muon_and_back(tmp_path):
    adam_ckpt, muon_ckpt = str(tmp_path / "adam"), str(tmp_path / "muon")
    weights = run_distributed(_save_megatron_adam, 2, adam_ckpt)
    stats = convert("adam-to-muon", adam_ckpt, muon_ckpt, "--momentum", "exp_avg")
    assert "'step': 2" in stats and "'muon_matrices': 4" in stats
    assert "optimizer: muon" in convert("inspect", muon_ckpt)
    # Loads into a different layout (TP2) and trains; weights are the AdamW run's.
    ranks = run_distributed(_load_muon_and_train, 2, latest(muon_ckpt), tp=2)
    assert _same(weights, [r["weights"] for r in ranks])
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in ranks)

    # And back: our own checkpoint becomes one Megatron's optimizer loads and trains from.
    ours, adam_again = str(tmp_path / "ours"), str(tmp_path / "adam_again")
    weights = run_distributed(_save_muon, 2, ours)
    assert "exp_avg_sq of 4 former Muon matrices is zero" in convert(
        "muon-to-adam", ours, adam_again, "--exp-avg", "momentum"
    )
    assert "fully_reshardable" in convert("inspect", adam_again)
    ranks = run_distributed(_load_megatron_adam_and_train, 2, latest(adam_again))
    assert _same(weights, [r["weights"] for r in ranks])
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in ranks)


def _atomic_and_errors(path):
    """A save that fails midway keeps the previous checkpoint; bad loads say why."""
    import megatron.core.dist_checkpointing as dcp

    from megatron_muon.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    out = {}
    spec = M.TinyModelSpec(**SPEC)
    chunks, model, opt, sched = build(spec)
    M.train_step(model, opt, M.synthetic_batches(spec, GBS, 1)[0], MBS, spec)
    save_checkpoint(path, model, opt, extra={"iteration": 1})
    good = M.gather_canonical_state(chunks)
    M.train_step(model, opt, M.synthetic_batches(spec, GBS, 2)[1], MBS, spec)
    original = dcp.save

    def crash(*args, **kwargs):
        raise OSError("disk full (simulated)")

    dcp.save = crash
    try:
        save_checkpoint(path, model, opt, extra={"iteration": 2})
    except OSError as e:
        out["save_error"] = str(e)
    finally:
        dcp.save = original
    chunks2, model2, opt2, _ = build(spec)
    out["extra"] = load_checkpoint(path, model2, opt2)
    out["previous_intact"] = _same([good], [M.gather_canonical_state(chunks2)])

    other = M.TinyModelSpec(kind="gqa", hidden_size=32, ffn_hidden_size=64)
    chunks3, model3, opt3, _ = build(other)
    try:
        load_checkpoint(path, model3, opt3)
    except CheckpointError as e:
        out["mismatch"] = str(e)
    chunks4, model4, opt4, _ = build(M.TinyModelSpec(kind="gqa", num_layers=1))
    try:
        load_checkpoint(path, model4, opt4)
    except CheckpointError as e:
        out["fewer_layers"] = str(e)
    try:
        load_checkpoint(os.path.join(path, "nope"), model2, opt2)
    except CheckpointError as e:
        out["missing"] = str(e)
    return out


@pytest.mark.timeout(300)
def test_atomic_save_and_clear_errors(tmp_path):
    path = str(tmp_path / "ckpt")
    out = run_distributed(_atomic_and_errors, 2, path)[0]
    assert "disk full" in out["save_error"]
    assert out["extra"] == {"iteration": 1} and out["previous_intact"]
    assert "different model config" in out["mismatch"] or "shape" in out["mismatch"]
    assert "not a checkpoint directory" in out["missing"]
    # Megatron stacks layers into one global tensor per name: fewer layers = other shapes.
    assert "model config differs" in out["fewer_layers"] and "shape mismatch" in out["fewer_layers"]


def _truncate_and_load(path, adam_path):
    from megatron_muon.checkpoint import CheckpointError, CheckpointIntegrityError, load_checkpoint

    out = {}
    spec = M.TinyModelSpec(**SPEC)
    chunks, model, opt, _ = build(spec)
    try:
        load_checkpoint(adam_path, model, opt)
    except CheckpointError as e:
        out["wrong_kind"] = str(e)
    try:
        load_checkpoint(path, model, opt)
    except CheckpointIntegrityError as e:  # found by the manifest, before anything is read
        out["truncated"] = str(e)
    return out


@pytest.mark.timeout(300)
def test_wrong_kind_and_truncated(tmp_path):
    path, adam = str(tmp_path / "ckpt"), str(tmp_path / "adam")
    run_distributed(_save_muon, 1, path)
    run_distributed(_save_megatron_adam, 1, adam)
    for name in os.listdir(path):
        if name.endswith(".distcp"):
            full = os.path.join(path, name)
            with open(full, "r+b") as f:
                f.truncate(os.path.getsize(full) // 2)
    out = run_distributed(_truncate_and_load, 1, path, adam)[0]
    assert "adam-to-muon" in out["wrong_kind"]
    assert ".distcp" in out["truncated"] and "truncated" in out["truncated"], out["truncated"]


def test_inspect_cli_and_experts_cli(tmp_path, capsys):
    """The command line's experts conversion both ways and an inspect of a non-checkpoint
    (tools/convert_checkpoint.py's main, in this process: torch files, no process group)."""
    from megatron_muon.megatron_lm.convert import main

    E, h, f = 2, 4, 3
    w1, w2 = torch.randn(h, E * 2 * f), torch.randn(E * f, h)
    src, seq, back = tmp_path / "legacy.pt", tmp_path / "seq.pt", tmp_path / "back.pt"
    torch.save({"model": {"decoder.layers.0.mlp.experts.weight1": w1, "decoder.layers.0.mlp.experts.weight2": w2}}, src)
    main(["experts", str(src), str(seq), "--to", "sequential", "--num-experts", str(E)])
    main(["experts", str(seq), str(back), "--to", "legacy_grouped"])
    restored = torch.load(back)["model"]
    assert torch.equal(restored["decoder.layers.0.mlp.experts.weight1"], w1)
    assert torch.equal(restored["decoder.layers.0.mlp.experts.weight2"], w2)
    capsys.readouterr()
    code, err = _in_process("inspect", str(tmp_path), capsys=capsys)
    assert code == 2 and "error:" in err


def test_experts_says_which_format_it_needs(tmp_path, capsys):
    listed = tmp_path / "listed.pt"
    torch.save({"model": [torch.zeros(2)]}, listed)
    for src, says in ((tmp_path, "is a directory. torch_dist checkpoints"), (listed, "is a list, not a state dict")):
        code, err = _in_process(
            "experts", str(src), str(tmp_path / "out.pt"), "--to", "sequential", "--num-experts", "2", capsys=capsys
        )
        assert code == 2 and says in err, err
    assert not (tmp_path / "out.pt").exists()


def _in_process(*args: str, capsys) -> tuple:
    """tools/convert_checkpoint.py's command line in this process, for what it refuses
    before writing anything: (exit code, stderr)."""
    from megatron_muon.megatron_lm.convert import main

    with pytest.raises(SystemExit) as exit_:
        main(list(args))
    return exit_.value.code, capsys.readouterr().err


# ---------------------------------------------------------------------------------------
# On what tools/pretrain_gpt.py (Megatron-LM's loop) writes
# ---------------------------------------------------------------------------------------

PRETRAIN = [
    sys.executable,
    os.path.join(ROOT, "tools", "pretrain_gpt.py"),
    "--recipe",
    "tiny_gqa",
    "--eval-iters",
    "0",
    "--make-vocab-size-divisible-by",
    "256",
    "--dist-ckpt-optim-fully-reshardable",
]


def pretrain(*args: str) -> str:
    env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(PRETRAIN + list(args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def tree(root) -> dict:
    """Every file under ``root``: path -> (size, mtime_ns, content hash)."""
    import hashlib

    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = (
                    os.path.getsize(path),
                    os.stat(path).st_mtime_ns,
                    hashlib.sha256(f.read()).hexdigest(),
                )
    return out


def converter(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"), *args], capture_output=True, text=True
    )


@pytest.fixture(scope="module")
def driver_checkpoints(tmp_path_factory):
    """Checkpoints written by tools/pretrain_gpt.py: AdamW (iterations 2, 4) and Muon (3, 6)."""
    root = tmp_path_factory.mktemp("driver")
    cache = str(root / "cache")
    pretrain(
        "--optimizer",
        "adam",
        "--train-iters",
        "4",
        "--save",
        str(root / "adam"),
        "--save-interval",
        "2",
        "--data-cache-path",
        cache,
    )
    pretrain(
        "--optimizer",
        "muon",
        "--train-iters",
        "6",
        "--save",
        str(root / "muon"),
        "--save-interval",
        "3",
        "--data-cache-path",
        cache,
    )
    return root


@pytest.mark.timeout(600)
def test_driver_checkpoints_convert_and_resume_both_ways(driver_checkpoints, tmp_path):
    """muon-to-adam on the Muon job's checkpoint directory, resumed by --optimizer adam via
    --load (the converter's tracker names iteration 6), Megatron-LM's own load path; each
    direction refuses the other's input. (adam-to-muon of a driver checkpoint and the
    Muon job resumed from it: docs/checkpoints.md's walk-through, run by test_docs.)"""
    root, cache = driver_checkpoints, str(driver_checkpoints / "cache")
    back = converter("muon-to-adam", str(root / "muon"), str(tmp_path / "adam"))
    assert back.returncode == 0 and "iter_0000006" in back.stdout, back.stderr[-2000:]
    out = pretrain(
        "--optimizer",
        "adam",
        "--train-iters",
        "8",
        "--override-opt_param-scheduler",
        "--load",
        str(tmp_path / "adam"),
        "--data-cache-path",
        cache,
    )
    loss = re.search(r"iteration        8/ .*?\| lm loss: ([0-9.E+-]+) \|", out)
    assert "at iteration 6" in out and loss and math.isfinite(float(loss.group(1)))
    # The source of each conversion is untouched; a wrong direction says the right one.
    wrong = converter("adam-to-muon", str(root / "muon"), str(tmp_path / "again"))
    assert wrong.returncode == 2 and "muon-to-adam" in wrong.stderr and not (tmp_path / "again").exists()
    wrong = converter("muon-to-adam", str(root / "adam"), str(tmp_path / "again"))
    assert wrong.returncode == 2 and "adam-to-muon" in wrong.stderr and not (tmp_path / "again").exists()


def test_converter_never_loses_data(driver_checkpoints, tmp_path, capsys):
    """Issue 13's reproduction (``muon-to-adam CKPT/iter_0000006 CKPT`` erased CKPT) and its
    relatives: refused with exit code 2, every file of CKPT unchanged."""
    import shutil

    ckpt = tmp_path / "CKPT"
    shutil.copytree(driver_checkpoints / "muon", ckpt)
    before = tree(ckpt)
    for src, dst in (
        (ckpt / "iter_0000006", ckpt),
        (ckpt, ckpt),
        (ckpt, ckpt / "converted"),
        (ckpt / "iter_0000006", ckpt / "iter_0000006"),
    ):
        code, err = _in_process("muon-to-adam", str(src), str(dst), capsys=capsys)
        assert code == 2 and "the source" in err, (src, dst, err[-2000:])
        assert tree(ckpt) == before
    # An existing destination iteration is refused unless --overwrite; other files are kept.
    out = tmp_path / "adam"
    assert converter("muon-to-adam", str(ckpt), str(out)).returncode == 0
    (out / "mine.txt").write_text("the user's")
    first = tree(out)
    code, err = _in_process("muon-to-adam", str(ckpt), str(out), capsys=capsys)
    assert code == 2 and "--overwrite" in err and tree(out) == first
    assert converter("muon-to-adam", str(ckpt), str(out), "--overwrite").returncode == 0
    assert (out / "mine.txt").read_text() == "the user's" and sorted(os.listdir(out)) == [
        "iter_0000006",
        "latest_checkpointed_iteration.txt",
        "mine.txt",
    ]
    assert tree(ckpt) == before


def test_the_converter_touches_only_what_it_made(driver_checkpoints, tmp_path):
    """A new destination DST is built in DST.tmp. A source that is DST.tmp or lies in it
    (``muon-to-adam run.tmp run`` deleted the whole run), a user's folder named DST.tmp and a
    symlink DST.tmp to a folder elsewhere (both were emptied): refused in one line, exit code
    2, every file where it was."""
    import shutil

    run = tmp_path / "run.tmp"
    shutil.copytree(driver_checkpoints / "muon", run)
    mine = tmp_path / "adam.tmp"
    (mine / "notes").mkdir(parents=True)
    (mine / "notes" / "thesis.tex").write_text("three years of work")
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(mine, elsewhere)
    os.symlink(elsewhere, tmp_path / "linked.tmp")
    before = tree(tmp_path)
    for src, dst, says in (
        (run, tmp_path / "run", "where the converter builds"),
        (run / "iter_0000006", tmp_path / "run", "where the converter builds"),
        (driver_checkpoints / "muon", tmp_path / "adam", "not made by megatron_muon"),
        (driver_checkpoints / "muon", tmp_path / "linked", "a symlink, not made by megatron_muon"),
    ):
        done = converter("muon-to-adam", str(src), str(dst))
        lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
        assert done.returncode == 2 and len(lines) == 1 and says in lines[0], (src, dst, done.stderr[-2000:])
        assert "Traceback" not in done.stderr
        assert tree(tmp_path) == before and not dst.exists()


def test_converter_keeps_the_tracker_and_refuses_unverified_sources(driver_checkpoints, tmp_path, capsys):
    """The destination's tracker never moves back without --overwrite; a source without its
    manifest is refused (always when it was saved with one), converted with
    --unverified-source and then labelled so; an unwritable destination is one line."""
    import shutil

    from megatron_muon.checkpoint.integrity import MANIFEST, RECORD, source_verified

    muon = tmp_path / "muon"
    shutil.copytree(driver_checkpoints / "muon", muon)  # tracker: 6
    before = tree(muon)
    code, err = _in_process("adam-to-muon", str(driver_checkpoints / "adam"), str(muon), capsys=capsys)
    assert code == 2 and "names iteration 6, later than the converted 4" in err and "--overwrite" in err, err
    assert tree(muon) == before
    assert converter("adam-to-muon", str(driver_checkpoints / "adam"), str(muon), "--overwrite").returncode == 0
    assert (muon / "latest_checkpointed_iteration.txt").read_text() == "4" and (muon / "iter_0000006").is_dir()

    adam = tmp_path / "adam" / "iter_0000004"
    shutil.copytree(driver_checkpoints / "adam" / "iter_0000004", adam)
    (adam / MANIFEST).unlink()
    code, err = _in_process("adam-to-muon", str(adam), str(tmp_path / "out"), capsys=capsys)
    assert code == 2 and "saved with a manifest" in err and not (tmp_path / "out").exists(), err
    (adam / RECORD).unlink()  # our run's arguments still say megatron_muon wrote it: refused
    code, err = _in_process("adam-to-muon", str(adam), str(tmp_path / "out"), "--unverified-source", capsys=capsys)
    assert code == 2 and "lost its" in err and not (tmp_path / "out").exists(), err
    adam = tmp_path / "plain" / "iter_0000004"  # as plain Megatron-LM saves it
    run_distributed(_as_plain_megatron_lm, 1, str(driver_checkpoints / "adam" / "iter_0000004"), str(adam))
    code, err = _in_process("adam-to-muon", str(adam), str(tmp_path / "out"), capsys=capsys)
    assert code == 2 and "--unverified-source" in err and not (tmp_path / "out").exists(), err
    done = converter("adam-to-muon", str(adam), str(tmp_path / "out"), "--unverified-source")
    assert done.returncode == 0, done.stderr[-2000:]
    assert not source_verified(str(tmp_path / "out" / "iter_0000004"))

    (tmp_path / "a_file").write_text("")
    code, err = _in_process(
        "muon-to-adam", str(driver_checkpoints / "muon"), str(tmp_path / "a_file" / "dst"), capsys=capsys
    )
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "a_file" in lines[0] and "Traceback" not in err, err


def _as_plain_megatron_lm(src: str, dst: str) -> None:
    """``src`` written again as Megatron-LM alone writes it: no manifest, no record, and
    arguments without megatron_muon's flags (in a rank: writing needs a process group)."""
    from megatron_muon.megatron_lm.checkpoint_dirs import read_checkpoint, write_checkpoint

    ckpt = read_checkpoint(src)
    args = ckpt.common["args"]
    for name in [n for n in vars(args) if n == "muon_impl"]:
        delattr(args, name)
    os.makedirs(dst)
    write_checkpoint(dst, ckpt)


KILLED_DURING_WRITE = """
import os, sys, time
import megatron.core.dist_checkpointing as dcp
save = dcp.save
def save_then_hang(*args, **kwargs):
    save(*args, **kwargs)
    print("WRITTEN", flush=True)
    time.sleep(600)
dcp.save = save_then_hang
from megatron_muon.megatron_lm.convert import main
main(sys.argv[1:])
"""


def _kill_when_written(*args: str) -> None:
    """SIGKILL the converter's whole process group (as a job scheduler does) once it has
    written its tensors: dist-checkpointing's writer processes die with it instead of
    outliving the test."""
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_DURING_WRITE, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        for line in proc.stdout:
            if "WRITTEN" in line:
                break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _tensors(path: str) -> dict:
    from megatron_muon.megatron_lm.checkpoint_dirs import read_checkpoint

    return read_checkpoint(path).tensors


@pytest.mark.timeout(300)
def test_killed_conversion_keeps_the_last_good_checkpoint(driver_checkpoints, tmp_path):
    """Killed after writing its tensors, before publishing: a new destination does not
    appear at all; an --overwrite of an existing one keeps the previous iteration and tracker,
    which still load (same tensors as before)."""
    src = str(driver_checkpoints / "muon")
    fresh = tmp_path / "fresh"
    _kill_when_written("muon-to-adam", src, str(fresh))
    assert not fresh.exists()
    out = tmp_path / "adam"
    assert converter("muon-to-adam", src, str(out)).returncode == 0
    before = tree(out)
    _kill_when_written("muon-to-adam", src, str(out), "--overwrite", "--exp-avg", "momentum")
    left = {k: v for k, v in tree(out).items() if ".tmp/" not in k and k != LOCK}
    assert left == before  # only the dead run's staging directory (and its lock) is new
    good = run_distributed(_tensors, 1, str(out / "iter_0000006"))[0]
    assert good and all(torch.isfinite(t).all() for t in good.values() if t.is_floating_point())


@pytest.mark.timeout(300)
def test_a_killed_converter_leaves_no_process_and_the_next_one_finishes(driver_checkpoints, tmp_path):
    """SIGKILL of the converter's PID alone while Megatron-LM re-saves the AdamW source for it
    (a torchrun and its rank, started by the converter): within 10 s none of its processes
    is left. The destination never appeared; the next conversion into it clears what the
    killed one left (its staging directory, its stale lock) and finishes."""
    import time

    from tests.helpers.jobs import job_env, tagged_processes

    adam = tmp_path / "adam"  # Megatron-LM's default optimizer format: the converter has it re-saved
    default_format = [a for a in PRETRAIN if a != "--dist-ckpt-optim-fully-reshardable"]
    done = subprocess.run(default_format + ["--optimizer", "adam", "--train-iters", "2", "--lr-warmup-iters", "0", "--save", str(adam),
                                            "--save-interval", "2", "--data-cache-path", str(driver_checkpoints / "cache")],
                          cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    tag = f"killed-converter-{os.getpid()}"
    dst = tmp_path / "muon"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"), "adam-to-muon", str(adam), str(dst)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=job_env(MUON_TEST_JOB=tag), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        deadline = time.time() + 120
        while len(tagged_processes(tag)) < 3:  # the converter, torchrun, the re-saving rank
            assert proc.poll() is None and time.time() < deadline, "the re-save never started"
            time.sleep(0.05)
        time.sleep(1.0)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.time() + 10
        while tagged_processes(tag) and time.time() < deadline:
            time.sleep(0.2)
        assert not tagged_processes(tag), "processes the killed converter started are still running"
    finally:
        for pid in tagged_processes(tag):
            os.kill(pid, signal.SIGKILL)
    assert not dst.exists()
    done = converter(*cmd[2:])
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        sorted(os.listdir(tmp_path)) == ["adam", "muon"]
        and (dst / "latest_checkpointed_iteration.txt").read_text() == "2"
    )


def test_a_failed_resave_leaves_nothing_and_says_why(driver_checkpoints, tmp_path):
    """An AdamW source in Megatron-LM's default format is re-saved by Megatron-LM with the
    run's own arguments (the docs' walk-through converts one). Arguments that do not fit
    the checkpoint (here a hidden size it was not trained with) end in one error naming the
    command to run, with no destination and no scratch directory left, the source intact."""
    import copy

    from megatron_muon.checkpoint import CheckpointError
    from megatron_muon.megatron_lm.checkpoint_dirs import read_common
    from megatron_muon.megatron_lm.convert import _read_resaved

    source = str(driver_checkpoints / "adam" / "iter_0000004")
    before = tree(driver_checkpoints / "adam")
    common = copy.deepcopy(read_common(source))
    common["args"].hidden_size = 32
    with pytest.raises(CheckpointError) as error:
        _read_resaved(source, 4, common, str(tmp_path / "muon"))
    message = str(error.value)
    assert "could not re-save" in message and "--hidden-size 32" in message and "\n" not in message, message
    assert os.listdir(tmp_path) == [] and tree(driver_checkpoints / "adam") == before


def test_a_converter_error_is_its_one_line():
    """Without a GPU, Megatron-core's import-time notices (transformer-engine / Apex absent,
    no CUDA runtime) are not printed: the converter's answer is the only line."""
    from tests.helpers.jobs import CONVERT, launch

    proc = launch(CONVERT + ["inspect", str(REPO / "no_such_checkpoint")], timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "is neither a checkpoint" in proc.stderr, (
        proc.stderr
    )
