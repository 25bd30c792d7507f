"""A writer removes only what it provably made (``megatron_muon.checkpoint.staging``), one
process, no model: every directory the converter, a save or a load's clean-up would empty or
remove is tried with a user's folder, a symlink to a folder elsewhere, and a source in the
way; each is left as it was (the write goes on beside it, or is refused in one line)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from megatron_muon.checkpoint import CheckpointError
from megatron_muon.checkpoint import publish as P
from megatron_muon.checkpoint.integrity import write_manifest
from megatron_muon.megatron_lm import checkpoint_dirs as D
from tests.helpers import REPO


def files(root: Path) -> dict:
    """Every file under ``root``, not following symlinks: relative path -> content hash."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            out[str(path.relative_to(root))] = (
                "link" if path.is_symlink() else hashlib.sha256(path.read_bytes()).hexdigest()
            )
    return out


def users_folder(path: Path) -> Path:
    """A folder of the user's: something that must never be emptied."""
    path.mkdir(parents=True)
    (path / "thesis.tex").write_text("three years of work")
    (path / "data").mkdir()
    (path / "data" / "results.csv").write_text("1,2,3")
    return path


IN_THE_WAY = ["users_folder", "symlink"]


def in_the_way(kind: str, name: Path, elsewhere: Path) -> Path:
    """At ``name``: a user's folder, or a symlink to one at ``elsewhere``; returns the folder."""
    if kind == "users_folder":
        return users_folder(name)
    folder = users_folder(elsewhere)
    os.symlink(folder, name)
    return folder


def write_checkpoint(content: str):
    """A writer for ``publish``: one data file."""

    def write(staging: str) -> None:
        with open(os.path.join(staging, "__0_0.distcp"), "w") as f:
            f.write(content)

    return write


# ---------------------------------------------------------------------------------------
# The converter's destination: DST.tmp, and a source in the way
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", IN_THE_WAY)
def test_the_converter_never_empties_a_dst_tmp_it_did_not_make(tmp_path, kind):
    """A new destination is built as ``DST.tmp``: a folder of that name that is not the
    converter's (a user's, or a symlink to one) is refused in one line and left as it was."""
    folder = in_the_way(kind, tmp_path / "run.tmp", tmp_path / "elsewhere")
    before = files(folder)
    with pytest.raises(CheckpointError) as error:
        with D.owned(str(tmp_path / "run"), "test"):
            pass
    said = str(error.value)
    assert str(tmp_path / "run.tmp") in said and "\n" not in said, said
    assert files(folder) == before and not (tmp_path / "run").exists()
    assert (tmp_path / "run.tmp").is_symlink() == (kind == "symlink")


def test_a_killed_converters_staging_is_cleared_by_the_next_one(tmp_path):
    """What a converter killed (SIGKILL) inside its write left as ``DST.tmp`` is its own: the
    next conversion into DST takes it over, and DST appears with only the new write."""
    dst = tmp_path / "run"
    code = (
        "import sys, time\n"
        "from megatron_muon.megatron_lm.checkpoint_dirs import owned\n"
        "with owned(sys.argv[1], 'killed') as (where, lock):\n"
        "    open(where + '/half_written', 'w').write('x')\n"
        "    print('IN', flush=True)\n"
        "    time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(dst)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "IN"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert (tmp_path / "run.tmp").is_dir() and not dst.exists()
    with D.owned(str(dst), "test") as (where, _):
        with open(os.path.join(where, "new"), "w") as f:
            f.write("y")
    assert sorted(os.listdir(dst)) == ["new"] and sorted(os.listdir(tmp_path)) == ["run"]


def _a_run(path: Path) -> Path:
    """A save directory as a user has it: a tracker and an iteration with files."""
    (path / "iter_0000002").mkdir(parents=True)
    (path / "iter_0000002" / "__0_0.distcp").write_text("weeks of training")
    (path / "latest_checkpointed_iteration.txt").write_text("2")
    return path


@pytest.mark.parametrize("source", ["run.tmp", "run.tmp/iter_0000002"])
def test_a_source_in_the_converters_way_is_refused(tmp_path, capsys, source):
    """``muon-to-adam run.tmp run``: ``run.tmp`` is where the converter builds ``run``; the
    source, or an iteration in it, is refused in one line before anything is read."""
    from megatron_muon.megatron_lm.convert import main

    _a_run(tmp_path / "run.tmp")
    before = files(tmp_path)
    for command in ("muon-to-adam", "adam-to-muon", "to-fsdp-dtensor"):
        with pytest.raises(SystemExit) as exit_code:
            main([command, str(tmp_path / source), str(tmp_path / "run")])
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_code.value.code == 2 and len(err) == 1, err
        assert "the converter builds" in err[0] and str(tmp_path / "run.tmp") in err[0], err[0]
        assert files(tmp_path) == before


# ---------------------------------------------------------------------------------------
# A save: its staging directory and the previous copy while it is swapped
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", IN_THE_WAY)
def test_a_save_writes_beside_a_staging_name_it_did_not_make(tmp_path, kind):
    """``iter_N.tmp`` in the save directory that a save did not make (a user's folder, a
    symlink to one) is left as it was; the save goes on beside it and completes."""
    save = tmp_path / "save"
    save.mkdir()
    folder = in_the_way(kind, save / "iter_0000003.tmp", tmp_path / "elsewhere")
    before = files(folder)
    P.publish(str(save / "iter_0000003"), write_checkpoint("new"))
    assert (save / "iter_0000003" / "__0_0.distcp").read_text() == "new"
    assert files(folder) == before and (save / "iter_0000003.tmp").is_symlink() == (kind == "symlink")
    assert sorted(os.listdir(save)) == ["iter_0000003", "iter_0000003.tmp"]


@pytest.mark.parametrize("kind", IN_THE_WAY)
def test_a_resave_without_an_atomic_exchange_never_removes_an_old_it_did_not_make(tmp_path, kind):
    """Where a filesystem cannot exchange two directories, a re-save moves the previous copy
    aside as ``iter_N.old``: a folder of that name that is not the save's is left as it was,
    and the previous checkpoint stays in place (the save refused in one line)."""
    save = tmp_path / "save"
    P.publish(str(save / "iter_0000003"), write_checkpoint("old"))
    folder = in_the_way(kind, save / "iter_0000003.old", tmp_path / "elsewhere")
    before = files(folder)
    with mock.patch.object(P, "_exchange", return_value=False), pytest.raises(CheckpointError) as error:
        P.publish(str(save / "iter_0000003"), write_checkpoint("new"))
    assert str(save / "iter_0000003.old") in str(error.value) and "\n" not in str(error.value)
    assert files(folder) == before and (save / "iter_0000003" / "__0_0.distcp").read_text() == "old"


# ---------------------------------------------------------------------------------------
# A load's clean-up of what interrupted saves left
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", IN_THE_WAY)
def test_the_clean_up_of_a_save_directory_removes_only_what_a_save_left(tmp_path, kind):
    """A directory named as an interrupted save's leftover (``iter_N.tmp``, ``.old``,
    ``.resave.tmp``) that no save made (a user's folder, a symlink to one) is left as it
    was, said in one line each."""
    save = tmp_path / "save"
    save.mkdir()
    kept = {}
    for suffix in (".tmp", ".old", ".resave.tmp"):
        folder = in_the_way(kind, save / f"iter_0000003{suffix}", tmp_path / f"elsewhere{suffix}")
        kept[folder] = files(folder)
    done = D.remove_leftovers(str(save))
    assert all(files(folder) == before for folder, before in kept.items())
    assert len(sorted(os.listdir(save))) == 3 and len(done) == 3, done
    assert all("not made by megatron_muon" in line for line in done), done


def test_what_interrupted_saves_left_is_removed_and_no_symlink_is_followed(tmp_path):
    """A save killed after its staging directory filled (and one that left a symlink to a
    folder elsewhere inside it) and one killed between the two renames of a swap: the next
    clean-up removes the first (not the folder the symlink names) and puts the previous
    copy back from the second."""
    save = tmp_path / "save"
    P.publish(str(save / "iter_0000003"), write_checkpoint("three"))
    folder = users_folder(tmp_path / "elsewhere")
    before = files(folder)

    def write_then_die(staging: str) -> None:
        write_checkpoint("four")(staging)
        os.symlink(folder, os.path.join(staging, "link"))
        raise KeyboardInterrupt  # stands in for SIGKILL: nothing after it runs

    with pytest.raises(KeyboardInterrupt):
        P.publish(str(save / "iter_0000004"), write_then_die)
    real_rename = os.rename

    def die_after_first(src, dst):
        real_rename(src, dst)
        raise KeyboardInterrupt

    with mock.patch.object(P, "_exchange", return_value=False), mock.patch("os.rename", die_after_first):
        with pytest.raises(KeyboardInterrupt):
            P.publish(str(save / "iter_0000003"), write_checkpoint("three again"))
    assert not (save / "iter_0000003").exists() and len(os.listdir(save)) == 3
    done = D.remove_leftovers(str(save))
    assert len(done) == 3, done
    assert sorted(os.listdir(save)) == ["iter_0000003"] and files(folder) == before
    assert (save / "iter_0000003" / "__0_0.distcp").read_text() == "three"


# ---------------------------------------------------------------------------------------
# The converter's re-save scratch directory
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", IN_THE_WAY)
def test_the_resave_scratch_directory_is_never_one_it_did_not_make(tmp_path, kind):
    """adam-to-muon has Megatron-LM re-save a default-format source into ``DST/iter_N.resave.tmp``
    and removes that afterwards: a folder of that name that is not the converter's is left as
    it was (the conversion refused in one line)."""
    import argparse

    from megatron_muon.megatron_lm import convert

    dst = tmp_path / "dst"
    dst.mkdir()
    folder = in_the_way(kind, dst / "iter_0000004.resave.tmp", tmp_path / "elsewhere")
    before = files(folder)

    def resave_fails(*args, **kwargs):
        raise CheckpointError("Megatron-LM could not re-save it")

    common = {"args": argparse.Namespace(world_size=1)}
    with mock.patch("megatron_muon.megatron_lm.resave.resave_fully_reshardable", resave_fails):
        with pytest.raises(CheckpointError) as error:
            convert._read_resaved(str(tmp_path / "src" / "iter_0000004"), 4, common, str(dst))
    assert "\n" not in str(error.value)
    assert files(folder) == before and (dst / "iter_0000004.resave.tmp").is_symlink() == (kind == "symlink")


def test_a_manifest_written_into_a_checkpoint_ignores_nothing_of_the_users(tmp_path):
    """The staging marker never enters a checkpoint: a published checkpoint lists exactly
    what its writer wrote (and verifies)."""
    from megatron_muon.checkpoint.integrity import verify_manifest

    P.publish(str(tmp_path / "iter_0000001"), write_checkpoint("one"))
    import json

    listed = json.loads((tmp_path / "iter_0000001" / "integrity.json").read_text())["files"]
    assert sorted(listed) == ["__0_0.distcp", "megatron_muon.json"]
    verify_manifest(str(tmp_path / "iter_0000001"))
    write_manifest(str(tmp_path / "iter_0000001"))
