"""Reading a checkpoint's files (``megatron_muon.checkpoint.reading``), one process, no
model: torch DCP's ``.metadata`` may place items only in the checkpoint's own regular data
files; a FIFO, a device or a socket in a checkpoint is refused in one line instead of
blocking a reader; a start-up read that does not finish within its bound ends in one line
naming the file."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from megatron_muon.checkpoint import UnsafeCheckpointError
from megatron_muon.checkpoint.reading import restricted_reading


@pytest.fixture
def dcp_checkpoint(tmp_path):
    """A one-process torch DCP checkpoint (a tensor and an object) and a copy of its data file
    outside it."""
    import shutil

    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "ckpt"
    dcp.save({"t": torch.arange(4.0), "obj": {"iteration": 3}}, checkpoint_id=str(ckpt))
    (data,) = ckpt.glob("*.distcp")
    shutil.copy(data, tmp_path / "outside.distcp")
    return ckpt


def _storage_points_to(ckpt, relative_path=None, length=None) -> None:
    """Rewrite ``.metadata`` (as an attacker does) so that every stored item lies in
    ``relative_path`` (and is ``length`` bytes long)."""
    with open(ckpt / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # the test's own file: trusted here
    for info in metadata.storage_data.values():
        info.relative_path = relative_path if relative_path is not None else info.relative_path
        info.length = length if length is not None else info.length
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


STORAGE_CASES = {
    "a file outside the checkpoint": dict(relative_path="../outside.distcp"),
    "an absolute path": dict(relative_path="/dev/zero"),
    "a FIFO": dict(relative_path="__9_0.distcp", make=lambda c: os.mkfifo(c / "__9_0.distcp")),
    "a symlink out": dict(relative_path="__9_0.distcp", make=lambda c: os.symlink(c.parent / "outside.distcp", c / "__9_0.distcp")),
    "not a DCP data file": dict(relative_path=".metadata"),
    "past the file's end": dict(length=1 << 40),
    "a file the manifest does not list": dict(relative_path="__9_0.distcp", manifest=True),
}  # fmt: skip


@pytest.mark.parametrize("case", list(STORAGE_CASES))
def test_dcp_metadata_names_only_the_checkpoints_own_regular_files(dcp_checkpoint, case):
    """``.metadata`` says in which file each item lies; torch's reader opens that path joined
    unchecked (a FIFO hangs the reader, ``/dev/zero`` with a large length allocates it, any
    local file is read as the checkpoint's data). It must name a DCP data file of the
    checkpoint itself, a regular file, listed in the manifest when there is one, and each
    item must lie inside it: refused in one line naming it, by our reader and by torch's."""
    import shutil

    from torch.distributed.checkpoint.filesystem import FileSystemReader

    from megatron_muon.checkpoint.errors import checkpoint_error_in
    from megatron_muon.checkpoint.integrity import write_manifest
    from megatron_muon.checkpoint.reading import read_dcp_metadata

    spec = STORAGE_CASES[case]
    ckpt = dcp_checkpoint
    assert read_dcp_metadata(str(ckpt)).storage_data  # the checkpoint as saved reads
    if spec.get("manifest"):
        write_manifest(str(ckpt))
        shutil.copy(ckpt.parent / "outside.distcp", ckpt / "__9_0.distcp")
    if "make" in spec:
        spec["make"](ckpt)
    _storage_points_to(ckpt, spec.get("relative_path"), spec.get("length"))
    with pytest.raises(UnsafeCheckpointError) as error:
        read_dcp_metadata(str(ckpt))
    said = str(error.value)
    assert "\n" not in said and said.startswith(str(ckpt / ".metadata")), said
    with restricted_reading(), pytest.raises(BaseException) as error:
        FileSystemReader(str(ckpt)).read_metadata()
    assert str(checkpoint_error_in(error.value)) == said


SPECIAL_FILES = r"""
import json, os, shutil, sys, warnings
warnings.simplefilter("ignore")
import torch
import torch.distributed.checkpoint as dcp
from megatron_muon.checkpoint.errors import CheckpointError
from megatron_muon.checkpoint.integrity import record, verify_manifest, write_manifest
from megatron_muon.checkpoint.reading import read_dcp_metadata, restricted_reading
from megatron_muon.megatron_lm.checkpoint_dirs import check_source, resume_iteration

root = sys.argv[1]
good = os.path.join(root, "good")
dcp.save({"t": torch.arange(4.0), "obj": {"iteration": 3}}, checkpoint_id=good)
write_manifest(good)
(data,) = [n for n in os.listdir(good) if n.endswith(".distcp")]


def copy(name, fifo=None, manifest=True):
    path = os.path.join(root, name, "iter_0000001")
    shutil.copytree(good, path)
    if not manifest:
        for n in ("integrity.json", "megatron_muon.json"):
            os.unlink(os.path.join(path, n))
    if fifo:
        os.unlink(os.path.join(path, fifo)) if os.path.exists(os.path.join(path, fifo)) else None
        os.mkfifo(os.path.join(path, fifo))
    return path


def outcome(read):
    from megatron_muon.checkpoint.errors import checkpoint_error_in
    try:
        return "read: " + repr(read())[:80]
    except BaseException as e:  # torch's and Megatron-core's readers carry ours out as a BaseException
        if checkpoint_error_in(e) is None:
            raise
        return str(checkpoint_error_in(e))


said = {}
said[".metadata"] = outcome(lambda: read_dcp_metadata(copy("metadata", ".metadata")))
said["manifest"] = outcome(lambda: verify_manifest(copy("manifest", "integrity.json"), local=True))
path = copy("record", "megatron_muon.json")
said["record"] = outcome(lambda: (record(path), verify_manifest(path, local=True)))
said["data file"] = outcome(lambda: verify_manifest(copy("data", data), local=True))
said["metadata.json, no manifest"] = outcome(lambda: check_source(copy("plain", "metadata.json", manifest=False), unverified=True))
path = copy("tracker")
os.mkfifo(os.path.join(root, "tracker", "latest_checkpointed_iteration.txt"))
said["tracker"] = outcome(lambda: resume_iteration(os.path.join(root, "tracker")))
path = copy("common_pt", "common.pt")
def legacy():
    from megatron.core.dist_checkpointing.strategies import common
    with restricted_reading():
        return common.load_common(path)
said["common.pt"] = outcome(legacy)
print(json.dumps(said))
"""


def test_a_fifo_in_a_checkpoint_is_refused_in_one_line_instead_of_blocking(tmp_path):
    """A FIFO where a checkpoint's file should be (``.metadata``, the manifest, the record, a
    data file, Megatron-core's ``metadata.json`` or legacy ``common.pt``, the tracker): opening
    it waits for a writer for ever. Each is refused in one line naming it (a tracker that is
    one is a broken tracker: the newest iteration that verifies is resumed). In a child
    process: a reader that opens it blocks (the child's timeout fails the test)."""
    import json
    import subprocess
    import sys

    from tests.helpers import REPO

    proc = subprocess.run(
        [sys.executable, "-c", SPECIAL_FILES, str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = json.loads(proc.stdout.strip().splitlines()[-1])
    cases = {".metadata": ".metadata", "manifest": "integrity.json", "metadata.json, no manifest": "metadata.json"}
    for case, name in dict(cases, **{"common.pt": "common.pt"}).items():
        assert f"{name} is a FIFO, not a regular file" in said[case] and "\n" not in said[case], (case, said[case])
    for case, name in (("record", "megatron_muon.json"), ("data file", ".distcp")):  # found by the manifest
        assert f"{name}: a FIFO, not a regular file" in said[case], said[case]
    assert said["tracker"].startswith("read: (1, "), said["tracker"]


def test_a_read_that_does_not_finish_ends_in_one_line_naming_the_file(tmp_path, monkeypatch):
    """A read inside ``bounded`` that outlasts the bound (here 1 s; a hung filesystem) ends
    with a CheckpointError naming the file being read."""
    from megatron_muon.checkpoint.errors import CheckpointError
    from megatron_muon.checkpoint.reading import READ_BOUND_ENV, bounded, open_regular

    monkeypatch.setenv(READ_BOUND_ENV, "1")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")
    never, writer = os.pipe()
    try:
        with pytest.raises(CheckpointError) as error:
            with bounded("the checkpoint"), open_regular(str(tmp_path / "latest_checkpointed_iteration.txt")):
                os.read(never, 1)  # a read that never returns (nothing is ever written): the bound ends it
    finally:
        os.close(never)
        os.close(writer)
    said = str(error.value)
    assert said.startswith(f"reading {tmp_path / 'latest_checkpointed_iteration.txt'} did not finish in 1 s")
    assert READ_BOUND_ENV in said and "\n" not in said


STALLED_START = r"""
import os, sys, warnings
warnings.simplefilter("ignore")
os.environ["MEGATRON_MUON_READ_TIMEOUT"] = "1"
from megatron_muon.megatron_lm import launch, resume

def stalls(args):  # a read of the checkpoint that never returns (a hung filesystem)
    never, _ = os.pipe()
    os.read(never, 1)

resume.check_optimizer_to_load = stalls
sys.argv = ["pretrain_gpt.py"]
launch.prepare(["--recipe", "tiny_gqa", "--load", os.environ["LOAD"]])
"""


def test_the_main_jobs_start_up_reads_are_bounded(tmp_path):
    """The main job's start-up reads of ``--load`` run within the bound: one stalled read
    ends the job in one line, exit code 2, before any model is built."""
    import subprocess
    import sys

    from tests.helpers import REPO

    (tmp_path / "run" / "iter_0000003").mkdir(parents=True)
    (tmp_path / "run" / "latest_checkpointed_iteration.txt").write_text("3")
    proc = subprocess.run(
        [sys.executable, "-c", STALLED_START],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, LOAD=str(tmp_path / "run"), CUDA_VISIBLE_DEVICES=""),
    )
    lines = [line for line in proc.stderr.splitlines() if "error" in line or "Traceback" in line]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("pretrain_gpt.py: error: reading what this job reads at start-up did not finish in 1 s")
    assert "MEGATRON_MUON_READ_TIMEOUT" in lines[0], lines[0]
