"""The guards on Megatron-LM's save and load path, one process, no model: the directory
swap (atomic exchange, and the two renames where a filesystem cannot exchange), what an
interrupted save leaves and how loading repairs it, the tracker written atomically and
chosen anew when it is unreadable, the ``--save`` refusal, the record that a checkpoint
carries a manifest, and the router's expert bias held back for a skipped step."""

from __future__ import annotations

import argparse
import hashlib
import os
import types
from pathlib import Path
from unittest import mock

import pytest
import torch

from megatron_muon.checkpoint import CheckpointError
from megatron_muon.checkpoint import publish as checkpoint
from megatron_muon.checkpoint.integrity import (
    MANIFEST,
    RECORD,
    CheckpointIntegrityError,
    source_verified,
    verify_manifest,
    write_manifest,
)
from megatron_muon.checkpoint.publish import recover_interrupted_swap
from megatron_muon.megatron_lm import checkpoint_dirs as D
from megatron_muon.megatron_lm import checkpoint_guards as G
from megatron_muon.megatron_lm.expert_bias import PendingExpertBias, _wrap_train_step, _wrap_update_router_expert_bias
from megatron_muon.megatron_lm.launch import check_save_directory


def saved(path: Path, content: str) -> Path:
    """A complete checkpoint directory (one data file, its record and manifest)."""
    path.mkdir(parents=True)
    (path / "data.distcp").write_text(content)
    write_manifest(str(path))
    return path


def files(root: Path) -> dict:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def read(path: Path) -> str:
    return (path / "data.distcp").read_text()


def writes(content: str):
    """A writer for ``publish``: the one data file of :func:`saved`."""
    return lambda staging: (Path(staging) / "data.distcp").write_text(content)


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_swap_replaces_only_a_complete_copy(tmp_path, exchange):
    target = saved(tmp_path / "iter_0000003", "old")
    with mock.patch.object(checkpoint, "_exchange", wraps=checkpoint._exchange if exchange else lambda a, b: False):
        checkpoint.publish(str(target), writes("new"))
    assert read(target) == "new" and sorted(os.listdir(tmp_path)) == ["iter_0000003"]
    # an empty directory made for the save is replaced; a new target is renamed in
    (tmp_path / "iter_0000004").mkdir()
    checkpoint.publish(str(tmp_path / "iter_0000004"), writes("four"))
    checkpoint.publish(str(tmp_path / "iter_0000005"), writes("five"))
    assert [read(tmp_path / f"iter_000000{i}") for i in (4, 5)] == ["four", "five"]
    assert sorted(os.listdir(tmp_path)) == [f"iter_000000{i}" for i in (3, 4, 5)]


def test_a_swap_killed_between_its_renames_is_undone_at_load(tmp_path):
    target = saved(tmp_path / "iter_0000003", "old")
    real_rename = os.rename

    def die_after_first(src, dst):
        real_rename(src, dst)
        raise KeyboardInterrupt  # stands in for SIGKILL

    with mock.patch.object(checkpoint, "_exchange", return_value=False), mock.patch("os.rename", die_after_first):
        with pytest.raises(KeyboardInterrupt):
            checkpoint.publish(str(target), writes("new"))
    assert not target.exists() and read(tmp_path / "iter_0000003.old" / "iter_0000003") == "old"
    assert checkpoint.resolve_checkpoint_dir(str(target)) == str(tmp_path / "iter_0000003.old" / "iter_0000003")
    (tmp_path / D.TRACKER).write_text("3")
    assert (
        G.choose_iteration(str(tmp_path), owned=True, choose=True) is None
    )  # the tracker is fine; the directory is back
    assert read(target) == "old" and sorted(os.listdir(tmp_path)) == ["iter_0000003", D.TRACKER]
    assert recover_interrupted_swap(str(target)) is None


def test_unreadable_tracker_resumes_from_the_newest_iteration_that_verifies(tmp_path, capsys):
    for i in (2, 4, 6):
        saved(tmp_path / f"iter_000000{i}", f"state {i}")
    (tmp_path / "iter_0000006" / "data.distcp").write_text("state 7")  # corrupt: fails its manifest
    (tmp_path / "iter_0000008").mkdir()  # a first save killed before anything was written

    def write_then_die(staging):
        writes("unfinished")(staging)
        raise KeyboardInterrupt  # stands in for SIGKILL: nothing after it runs

    with pytest.raises(KeyboardInterrupt):
        checkpoint.publish(str(tmp_path / "iter_0000008"), write_then_die)
    for tracker in ("", "\x00\x00", "6x", "³", "٦"):  # the last two are digits, not ASCII ones
        (tmp_path / D.TRACKER).write_text(tracker)
        assert G.choose_iteration(str(tmp_path), owned=True, choose=True) == 4
        assert "resuming from iter_0000004, the newest iteration that verifies" in capsys.readouterr().out
        assert G.choose_iteration(str(tmp_path), owned=True, choose=False) is None
    assert not (tmp_path / "iter_0000008.tmp").exists()  # ours, removed; Megatron-LM's empty iter_0000008 stays
    (tmp_path / D.TRACKER).unlink()
    assert G.choose_iteration(str(tmp_path), owned=True, choose=True) == 4  # missing beside saved iterations
    for i in (2, 4):
        (tmp_path / f"iter_000000{i}" / "data.distcp").write_text("bad")
    with pytest.raises(CheckpointError, match="no iteration in .* verifies"):
        G.choose_iteration(str(tmp_path), owned=True, choose=True)
    assert G.choose_iteration(str(tmp_path / "nothing"), owned=True, choose=True) is None


def test_tracker_writes_are_atomic(tmp_path):
    tracker = tmp_path / D.TRACKER
    tracker.write_text("3")
    msc = G.AtomicTrackerWrites(mock.Mock(open=open))
    with pytest.raises(KeyboardInterrupt):
        with msc.open(str(tracker), "w") as f:
            f.write("")  # Megatron-LM's open-with-truncate left this behind when killed here
            raise KeyboardInterrupt
    assert tracker.read_text() == "3"
    with msc.open(str(tracker), "w") as f:
        f.write("6")
    assert tracker.read_text() == "6" and sorted(os.listdir(tmp_path)) == [D.TRACKER]
    with msc.open(str(tmp_path / "other.txt"), "w") as f:  # any other file: Megatron-LM's own open
        assert not isinstance(f, G._AtomicFile)
    assert D.read_tracker(str(tmp_path)) == "6"


def test_a_deleted_manifest_is_refused_and_an_unverified_source_is_labelled(tmp_path):
    ckpt = saved(tmp_path / "ckpt", "x")
    assert RECORD in files(ckpt) and source_verified(str(ckpt))
    (ckpt / MANIFEST).unlink()
    with pytest.raises(CheckpointIntegrityError, match=f"saved with a manifest .*{MANIFEST} is missing"):
        verify_manifest(str(ckpt))
    other = tmp_path / "converted"
    other.mkdir()
    (other / "data.distcp").write_text("y")
    write_manifest(str(other), source_verified=False)
    verify_manifest(str(other))
    assert not source_verified(str(other))


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"save": None, "load": None, "start_over": False, **kw})


def test_save_holding_a_run_without_a_load_is_refused(tmp_path):
    run = tmp_path / "run"
    saved(run / "iter_0000003", "x")
    (run / D.TRACKER).write_text("3")
    before = files(run)
    for load in (None, str(tmp_path / "typo")):
        with pytest.raises(ValueError, match=f"--save {run} holds a run but .*--load {run}.*--start-over"):
            check_save_directory(_args(save=str(run), load=load))
    check_save_directory(_args(save=str(run), load=str(run)))
    check_save_directory(_args(save=str(run), start_over=True))
    check_save_directory(_args(save=str(tmp_path / "new")))
    assert files(run) == before


def test_expert_bias_moves_only_with_a_step_taken():
    router = torch.nn.Module()
    router.expert_bias = torch.zeros(4)
    model = [torch.nn.Sequential(router)]
    pending = PendingExpertBias()

    def megatron_update(model, config):  # Megatron-core's in-place update
        router.expert_bias.add_(1.0)

    update = _wrap_update_router_expert_bias(megatron_update, types.SimpleNamespace(expert_bias=pending))
    for skipped, should_exit, expected in ((1, False, 0.0), (0, True, 0.0), (0, False, 1.0), (0, False, 2.0)):

        def megatron_train_step():
            update(model, None)  # finalize_model_grads, inside the step
            assert router.expert_bias.eq(expected - (not skipped and not should_exit)).all()  # not yet
            return {}, skipped, False, should_exit, 0, None, None, 0

        _wrap_train_step(megatron_train_step, types.SimpleNamespace(expert_bias=pending))()
        assert router.expert_bias.eq(expected).all(), (skipped, should_exit, router.expert_bias)


def test_save_holding_another_run_is_refused_unless_asked(tmp_path):
    """--load A --save B with B holding another run: B's later iterations would be replaced
    as this job saves. The same directory under another spelling is the same run."""
    a, b = tmp_path / "a", tmp_path / "b"
    for run in (a, b):
        saved(run / "iter_0000003", str(run))
        (run / D.TRACKER).write_text("3")
    with pytest.raises(ValueError, match=f"--save {b} holds a run but this job resumes --load {a}, another run"):
        check_save_directory(_args(save=str(b), load=str(a)))
    check_save_directory(_args(save=str(b), load=str(a), start_over=True))
    check_save_directory(_args(save=str(b), load=str(tmp_path / "." / "b") + "/"))
    check_save_directory(_args(save=str(tmp_path / "c"), load=str(a)))


def test_a_tracker_naming_a_missing_iteration_resumes_from_the_newest_that_verifies(tmp_path, capsys):
    saved(tmp_path / "iter_0000002", "two")
    saved(tmp_path / "iter_0000004", "four")
    (tmp_path / D.TRACKER).write_text("6")  # iter_0000006 was deleted, or never moved in
    assert G.choose_iteration(str(tmp_path), owned=False, choose=True) == 4
    assert "names iter_0000006, which is missing: resuming from iter_0000004" in capsys.readouterr().out
    (tmp_path / D.TRACKER).write_text("4")
    assert G.choose_iteration(str(tmp_path), owned=False, choose=True) is None
    assert D.resolve_source(str(tmp_path)) == str(tmp_path / "iter_0000004")


def test_a_directory_this_job_does_not_own_is_only_read(tmp_path):
    """A leftover in --load that is not this job's --save may be another job's work in
    progress (or the directory read-only): it is neither removed nor renamed."""
    saved(tmp_path / "iter_0000002", "two")
    (tmp_path / D.TRACKER).write_text("2")
    staging = saved(tmp_path / "iter_0000004.tmp", "being written by another job")
    previous = saved(tmp_path / "iter_0000003.old", "three")
    before = files(tmp_path)
    assert G.choose_iteration(str(tmp_path), owned=False, choose=True) is None
    assert files(tmp_path) == before and staging.exists() and previous.exists()


def test_the_manifest_lists_the_whole_directory(tmp_path):
    """A file added after the save, a manifest emptied or rewritten to list nothing, and a
    missing file are refused; with ``items`` the data files are checked at those items only."""
    import json

    ckpt = saved(tmp_path / "ckpt", "x")
    (ckpt / "extra.pt").write_text("added later")
    with pytest.raises(CheckpointIntegrityError, match="extra.pt: not in the manifest"):
        verify_manifest(str(ckpt))
    (ckpt / "extra.pt").unlink()
    manifest = json.loads((ckpt / MANIFEST).read_text())
    for emptied in ({**manifest, "files": {}, "sizes": {}}, {}, {"files": []}):
        (ckpt / MANIFEST).write_text(json.dumps(emptied))
        with pytest.raises(CheckpointIntegrityError, match="lists no files|is not a manifest"):
            verify_manifest(str(ckpt))
    # a table of another shape (it raised AttributeError, a traceback) is not a manifest either
    for malformed in ({"sizes": []}, {"items": []}, {"sizes": {"data.distcp": "1"}}, {"items": {"data.distcp": [[1]]}}):
        (ckpt / MANIFEST).write_text(json.dumps({**manifest, **malformed}))
        for items in (None, ("common_state",)):
            with pytest.raises(CheckpointIntegrityError, match="is not a manifest") as error:
                verify_manifest(str(ckpt), items=items)
            assert "\n" not in str(error.value)
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    verify_manifest(str(ckpt), items=("common_state",))
    (ckpt / RECORD).unlink()
    with pytest.raises(CheckpointIntegrityError, match=f"{RECORD}: missing"):
        verify_manifest(str(ckpt), items=("common_state",))


def test_the_converter_never_moves_a_tracker_behind_an_iteration_it_holds(tmp_path):
    """A destination whose tracker is empty or missing but which holds a later iteration:
    the converted, older one would become the one --load resumes from."""
    saved(tmp_path / "iter_0000006", "six")
    for tracker in ("", None):
        if tracker is None:
            (tmp_path / D.TRACKER).unlink()
        else:
            (tmp_path / D.TRACKER).write_text(tracker)
        with pytest.raises(CheckpointError, match="holds iter_0000006, later than the converted 4"):
            D.check_destination(str(tmp_path), 4, overwrite=False)
        D.check_destination(str(tmp_path), 4, overwrite=True)
        D.check_destination(str(tmp_path), 7, overwrite=False)


def test_the_format_is_read_from_the_record_then_the_files(tmp_path):
    """An fsdp_dtensor checkpoint that lost its ``.metadata`` is still one (its record says
    so; without a record, its ``.distcp`` files), never read as torch_dist."""
    fsdp = tmp_path / "fsdp"
    fsdp.mkdir()
    (fsdp / ".metadata").write_bytes(b"")
    (fsdp / "__0_0.distcp").write_text("x")
    write_manifest(str(fsdp))
    (fsdp / ".metadata").unlink()
    assert D.checkpoint_format(str(fsdp)) == "fsdp_dtensor" and D.is_fsdp_dtensor(str(fsdp))
    (fsdp / RECORD).unlink()
    assert D.checkpoint_format(str(fsdp)) == "fsdp_dtensor"
    torch_dist = tmp_path / "torch_dist"
    torch_dist.mkdir()
    (torch_dist / "metadata.json").write_text("{}")
    assert D.checkpoint_format(str(torch_dist)) == "torch_dist" and D.checkpoint_format(str(tmp_path)) == "unknown"


def test_a_full_disk_is_named_even_once_the_staging_directory_freed_it(tmp_path):
    """A write that fails for want of space without saying so (Megatron-core's writer workers
    raise "An error is caught while starting worker 0", the OS error gone): the disk is full
    when it fails, no longer once the staging directory it filled is removed. The failure is
    judged before the removal: one line naming the full disk (it was a 1,000-line traceback)."""
    target = tmp_path / "save" / "iter_0000008"

    def fills_the_disk(staging):
        (Path(staging) / "__0_0.distcp").write_text("x" * 1000)
        raise RuntimeError("Worker failure: An error is caught while starting worker 0, error: <class 'OSError'>")

    def full_while_staged(directory):  # full while the staging directory holds the space
        return any(p.name.startswith("iter_0000008.tmp") for p in (tmp_path / "save").iterdir())

    with mock.patch.object(checkpoint, "disk_full", full_while_staged):
        with pytest.raises(CheckpointError) as error:
            checkpoint.publish(str(target), fills_the_disk)
    said = str(error.value)
    assert "No space left on device" in said and "--save" in said and "\n" not in said, said
    assert os.listdir(tmp_path / "save") == []
