"""Loading a checkpoint never runs code from it, tried as an attacker would, through the main
job (``tools/pretrain_gpt.py --load``) and every converter command as users run them.

Each payload, unpickled, writes a marker file; the attacker also forges the manifest so that
the files verify. No marker may ever appear; each refusal is one line naming the refused
type. A checkpoint of ours that lost its manifest or both of our files, or whose manifest was
emptied, is refused before anything of it is read.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path
from typing import List

import pytest

from megatron_muon.checkpoint.integrity import MANIFEST, RECORD
from megatron_muon.testing import run_distributed
from tests.helpers.jobs import CONVERT, PRETRAIN, launch, run

SYSTEM = "posix.system"
"""How ``os.system`` is named in a pickle (what the refusal names)."""


class Payload:
    """Unpickled, it runs ``touch marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def forge_manifest(checkpoint_dir: Path) -> None:
    """Rewrite the manifest so that every file of the directory verifies (what an attacker
    who edits files also does: the manifest is an unkeyed checksum)."""
    manifest = json.loads((checkpoint_dir / MANIFEST).read_text())
    manifest["files"], manifest["sizes"], manifest["items"] = {}, {}, {}
    for path in sorted(checkpoint_dir.iterdir()):
        if path.name != MANIFEST:
            manifest["files"][path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
            manifest["sizes"][path.name] = path.stat().st_size
    (checkpoint_dir / MANIFEST).write_text(json.dumps(manifest))


def as_save_directory(iteration_dir: Path) -> Path:
    """``iteration_dir`` (``.../iter_0000002``) as a --load directory: its parent, tracked."""
    (iteration_dir.parent / "latest_checkpointed_iteration.txt").write_text(str(int(iteration_dir.name[5:])))
    return iteration_dir.parent


def splice_stored_object(checkpoint_dir: Path, fqn: str, placeholder: str, body: bytes) -> None:
    """Replace the string ``placeholder`` in the stored object ``fqn`` (a torch file inside a
    DCP data file) by what the pickle opcodes ``body`` push, as an attacker writing the bytes
    does (Megatron-core's own save traverses a DAG it is given for ever): the new object is
    appended to its data file and ``.metadata`` pointed at it."""
    import io
    import zipfile

    from tests.helpers.crafted_pickles import splice

    with open(checkpoint_dir / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own file: trusted here
    (index,) = [i for i in metadata.storage_data if i.fqn.startswith(fqn)]
    info = metadata.storage_data[index]
    data = checkpoint_dir / info.relative_path
    raw = data.read_bytes()[info.offset : info.offset + info.length]
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(raw)) as z, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as w:
        for name in z.namelist():
            content = z.read(name)
            w.writestr(name, splice(content, placeholder, body) if name.endswith("data.pkl") else content)
    info.offset, info.length = data.stat().st_size, len(out.getvalue())
    with open(data, "ab") as f:
        f.write(out.getvalue())
    with open(checkpoint_dir / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def _rewrite(src: str, dst: str, marker: str, where: str) -> None:
    """In a rank (writing needs a process group): ``src`` written again as ``dst`` with a
    payload in a stored object: Megatron-LM's common state (torch_dist) or fsdp_dtensor's
    ``iteration``; the manifest written for it (the attacker's own, so it verifies)."""
    from megatron_muon.checkpoint.integrity import write_manifest
    from megatron_muon.megatron_lm.checkpoint_dirs import read_checkpoint, write_checkpoint
    from megatron_muon.megatron_lm.convert_fsdp import write_fsdp_dtensor

    ckpt = read_checkpoint(src)
    os.makedirs(dst)
    if where == "common_state":
        ckpt.common["notes"] = [Payload(marker)]
        write_checkpoint(dst, ckpt)
    elif where == "common_dag":
        ckpt.common["notes"] = "PLACEHOLDER"  # replaced by a list DAG (splice_stored_object)
        write_checkpoint(dst, ckpt)
    else:
        ckpt.common["iteration"] = Payload(marker)
        write_fsdp_dtensor(dst, ckpt)
    write_manifest(dst)


@pytest.fixture(scope="module")
def attacks(tmp_path_factory):
    """A Muon run's checkpoint (torch_dist, iteration 2), and copies of it with a payload in
    ``.metadata``, in Megatron-LM's common state, in a legacy ``common.pt``, and as an
    fsdp_dtensor checkpoint with one in ``iteration``; each under a save directory."""
    root = tmp_path_factory.mktemp("attacks")
    marker = root / "MARKER"
    run(PRETRAIN + ["--recipe", "tiny_gqa", "--train-iters", "2", "--lr-warmup-iters", "0", "--eval-iters", "0",
                    "--data-cache-path", str(root / "cache"), "--save", str(root / "good"), "--save-interval", "2"])  # fmt: skip
    good = root / "good" / "iter_0000002"
    out = {"root": root, "marker": marker, "good": good}

    metadata = root / "metadata" / "iter_0000002"
    shutil.copytree(good, metadata)
    with open(metadata / ".metadata", "rb") as f:
        loaded = pickle.load(f)  # our own file: trusted here
    loaded.planner_data = {"notes": Payload(str(marker))}
    with open(metadata / ".metadata", "wb") as f:
        pickle.dump(loaded, f)
    forge_manifest(metadata)
    out["metadata"] = as_save_directory(metadata)

    common_pt = root / "common_pt" / "iter_0000002"
    shutil.copytree(good, common_pt)
    import torch

    torch.save({"args": Payload(str(marker))}, common_pt / "common.pt")
    forge_manifest(common_pt)
    out["common_pt"] = as_save_directory(common_pt)

    for where in ("common_state", "fsdp_iteration", "common_dag"):
        target = root / where / "iter_0000002"
        run_distributed(_rewrite, 1, str(good), str(target), str(marker), where, timeout_s=240)
        out[where] = as_save_directory(target)

    from tests.helpers.crafted_pickles import list_dag, set_of, splice, tuple_dag

    splice_stored_object(out["common_dag"] / "iter_0000002", "common_state", "PLACEHOLDER", list_dag(90))
    forge_manifest(out["common_dag"] / "iter_0000002")

    metadata_dag = root / "metadata_dag" / "iter_0000002"  # a set of a 90-level tuple DAG: hashed for ever
    shutil.copytree(good, metadata_dag)
    loaded.planner_data = "PLACEHOLDER"
    (metadata_dag / ".metadata").write_bytes(
        splice(pickle.dumps(loaded, protocol=2), "PLACEHOLDER", set_of(tuple_dag(90)))
    )
    forge_manifest(metadata_dag)
    out["metadata_dag"] = as_save_directory(metadata_dag)

    storage = root / "storage_path" / "iter_0000002"  # items read from /dev/zero: a large allocation
    shutil.copytree(good, storage)
    with open(storage / ".metadata", "rb") as f:
        forged = pickle.load(f)
    for info in forged.storage_data.values():
        info.relative_path, info.length = "/dev/zero", 1 << 36
    with open(storage / ".metadata", "wb") as f:
        pickle.dump(forged, f)
    forge_manifest(storage)
    out["storage_path"] = as_save_directory(storage)
    assert not marker.exists()
    return out


MUON_JOB = [
    "--recipe",
    "tiny_gqa",
    "--train-iters",
    "4",
    "--lr-warmup-iters",
    "0",
    "--eval-iters",
    "0",
    "--save-interval",
    "2",
]
FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params", "--ckpt-format",
        "fsdp_dtensor"]  # fmt: skip


def in_process(*argv: str) -> tuple:
    """The converter's command line in this process, for what it refuses before it starts a
    process group: (exit code, stderr)."""
    import contextlib
    import io

    from megatron_muon.megatron_lm.convert import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(list(argv))
        except SystemExit as e:
            return e.code, err.getvalue()
    return 0, err.getvalue()


def refused_in_one_line(proc, *says: str) -> str:
    """The one error line of a refused run (rc != 0, no traceback)."""
    ours = [line for line in proc.stderr.splitlines() if ": error: " in line or line.startswith("error: ")]
    assert proc.returncode != 0 and len(ours) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for said in says:
        assert said in ours[0], ours[0]
    return ours[0]


CRAFTED = {
    "metadata_dag": "through shared references",
    "common_dag": "through shared references",
    "storage_path": "places stored items in '/dev/zero'",
}
"""Checkpoints that hang or flood a reader without running code, and what refuses each."""


@pytest.mark.timeout(900)
def test_payloads_never_run_from_the_main_job(attacks, tmp_path):
    """``--load`` of each: refused in one line naming the type, at start-up (our check reads
    the common state first) or inside Megatron-LM's own load (``--no-load-optim`` skips that
    check: the weights are read through torch's DCP reader, restricted)."""
    cache = ["--data-cache-path", str(attacks["root"] / "cache")]
    for name in ("metadata", "common_state", "common_pt"):
        proc = launch(PRETRAIN + MUON_JOB + cache + ["--load", str(attacks[name]), "--save", str(tmp_path / name)])
        refused_in_one_line(proc, SYSTEM)
    for name, says in CRAFTED.items():  # --no-load-optim: the start-up check skips the optimizer, not the reads
        for optim in ([], ["--no-load-optim"]):
            job = PRETRAIN + MUON_JOB + cache + optim + ["--load", str(attacks[name]), "--save", str(tmp_path / name)]
            refused_in_one_line(launch(job), says)
    proc = launch(PRETRAIN + MUON_JOB + FSDP + cache + ["--load", str(attacks["fsdp_iteration"])])
    refused_in_one_line(proc, SYSTEM)
    weights_only = ["--no-load-optim", "--load", str(attacks["common_state"]), "--save", str(tmp_path / "w")]
    refused_in_one_line(launch(PRETRAIN + MUON_JOB + cache + weights_only), SYSTEM)
    assert not attacks["marker"].exists()


@pytest.mark.timeout(900)
def test_payloads_never_run_from_the_converter(attacks, tmp_path):
    """Every converter command on each payload it reads, and ``integrity write`` (which reads
    ``.metadata`` to name the tensors): refused in one line naming the type. Two run as
    ``tools/convert_checkpoint.py`` processes; the others refuse before they start a process
    group, so they run the same command line in this process."""
    for command, name in ((["muon-to-adam"], "metadata"), (["to-torch-dist"], "fsdp_iteration")):
        proc = launch(CONVERT + command + [str(attacks[name]), str(tmp_path / f"{command[0]}_{name}")])
        refused_in_one_line(proc, SYSTEM)
        assert not (tmp_path / f"{command[0]}_{name}").exists()
    experts = tmp_path / "experts.pt"
    import torch

    torch.save({"model": {"decoder.layers.0.mlp.experts.weight1": Payload(str(attacks["marker"]))}}, experts)
    cases = [
        ("adam-to-muon", "metadata"),
        ("to-fsdp-dtensor", "metadata"),
        ("muon-to-adam", "common_state"),
        ("inspect", "metadata"),
        ("inspect", "common_pt"),
        ("inspect", "common_state"),
    ]
    for command, name in cases:
        out = [] if command == "inspect" else [str(tmp_path / f"{command}_{name}")]
        code, err = in_process(command, str(attacks[name]), *out)
        assert code == 2 and SYSTEM in err and len(err.strip().splitlines()) == 1, (command, name, err)
        assert not out or not os.path.exists(out[0])
    code, err = in_process("experts", str(experts), str(tmp_path / "out.pt"), "--to", "sequential")
    assert code == 2 and SYSTEM in err and len(err.strip().splitlines()) == 1, err
    integrity = [PRETRAIN[0], "-m", "megatron_muon.checkpoint.integrity", "write"]
    refused_in_one_line(launch(integrity + [str(attacks["metadata"] / "iter_0000002")]), SYSTEM)
    for name, says in CRAFTED.items():
        for command in ("inspect", "muon-to-adam"):
            out = [] if command == "inspect" else [str(tmp_path / f"{command}_{name}")]
            code, err = in_process(command, str(attacks[name]), *out)
            assert code == 2 and says in err and len(err.strip().splitlines()) == 1, (command, name, err)
    for name in ("metadata_dag", "storage_path"):
        refused_in_one_line(launch(integrity + [str(attacks[name] / "iter_0000002")]), CRAFTED[name])
    assert not attacks["marker"].exists()


def _damaged(good: Path, root: Path) -> List[tuple]:
    """Copies of ``good`` with a flipped byte in a data file and, around it: the manifest
    emptied, the manifest deleted, both of our files deleted."""
    cases = []
    for name, damage in (
        ("emptied", lambda d: (d / MANIFEST).write_text(json.dumps({"algorithm": "sha256", "files": {}}))),
        ("deleted", lambda d: (d / MANIFEST).unlink()),
        ("both_deleted", lambda d: [(d / MANIFEST).unlink(), (d / RECORD).unlink()]),
    ):
        target = root / name / good.name
        shutil.copytree(good, target)
        data = sorted(target.glob("*.distcp"))[0]
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
        damage(target)
        cases.append((name, as_save_directory(target)))
    return cases


@pytest.mark.timeout(900)
def test_a_checkpoint_that_lost_its_manifest_is_refused(attacks, tmp_path):
    """An emptied manifest, a deleted manifest, both of our files deleted (with a flipped
    byte in a data file each): refused by the main job and by the converter, nothing written."""
    says = {"emptied": "lists no files", "deleted": "is missing", "both_deleted": "lost its"}
    cache = ["--data-cache-path", str(attacks["root"] / "cache")]
    for name, load in _damaged(attacks["good"], tmp_path):
        proc = launch(PRETRAIN + MUON_JOB + cache + ["--load", str(load), "--save", str(tmp_path / f"run_{name}")])
        refused_in_one_line(proc, says[name])
        assert "iteration        3/" not in proc.stdout
        code, err = in_process("muon-to-adam", str(load), str(tmp_path / f"adam_{name}"))  # refused before any read
        assert code == 2 and says[name] in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / f"adam_{name}").exists()
