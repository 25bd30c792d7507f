"""One job per save directory, and a save directory that cannot take a checkpoint, as users
meet them with ``tools/pretrain_gpt.py``.

* Two jobs on one ``--save``, started together, and a restart while the first still runs:
  the second is refused in one line naming the first, whose iterations and tracker it never
  touches. (A stale lock of a killed job is taken over: test_pretrain.py's killed job.)
* A full disk: one line that says "No space left on device"; the checkpoints already saved
  stay complete and the tracker names one (torch_dist and fsdp_dtensor).
* A read-only ``--save`` is refused at start-up; a read-only ``--load`` holding a stale
  staging directory is read as it is.

The disk cases run in a mount namespace of their own (``unshare``: a small tmpfs, a
read-only bind mount); they are skipped where the system allows none.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_muon.checkpoint.save_lock import LOCK
from tests.helpers import REPO
from tests.helpers.jobs import PRETRAIN, TWO_RANKS, job_env, launch, losses

TINY = ["--recipe", "tiny_gqa", "--lr-warmup-iters", "0", "--eval-iters", "0", "--save-interval", "1"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def one_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if "pretrain_gpt.py: error:" in line]
    assert proc.returncode != 0 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def verified_run(save: Path) -> int:
    """The iteration ``save``'s tracker names, after checking that it and every other
    iteration there verify and that nothing else was left there."""
    from megatron_muon.checkpoint.integrity import verify_manifest

    tracked = int((save / "latest_checkpointed_iteration.txt").read_text())
    names = sorted(os.listdir(save))
    assert all(n.startswith("iter_") and n[5:].isdigit() or n in ("latest_checkpointed_iteration.txt", LOCK)
               for n in names), names  # fmt: skip
    for name in names:
        if name.startswith("iter_"):
            verify_manifest(str(save / name), local=True)
    assert f"iter_{tracked:07d}" in names
    return tracked


@pytest.mark.timeout(600)
def test_a_second_job_on_one_save_directory_is_refused(cache, tmp_path):
    save = tmp_path / "run"
    job = PRETRAIN + TINY + ["--data-cache-path", str(cache), "--save", str(save)]
    first, second = (
        subprocess.Popen(
            job + ["--train-iters", "60", "--exit-interval", "12"],
            cwd=REPO,
            env=job_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for _ in range(2)
    )
    outcomes = [p.communicate(timeout=400) for p in (first, second)]
    codes = sorted(p.returncode for p in (first, second))
    refused = [err for (_, err), p in zip(outcomes, (first, second)) if p.returncode != 0]
    assert codes == [0, 2] and len(refused) == 1, [err[-2000:] for _, err in outcomes]
    said = [line for line in refused[0].splitlines() if "error:" in line]
    assert len(said) == 1 and f"{save} is being written by" in said[0] and "one job per save directory" in said[0]
    assert verified_run(save) == 12

    # A restart while the first job still runs (as a scheduler's retry of a job it thinks dead).
    running = subprocess.Popen(job + ["--train-iters", "60", "--load", str(save)], cwd=REPO, env=job_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    tracker = save / "latest_checkpointed_iteration.txt"
    deadline = time.time() + 200
    while int(tracker.read_text()) < 14:
        assert running.poll() is None and time.time() < deadline, running.communicate()[1][-3000:]
        time.sleep(0.1)
    restart = launch(job + ["--train-iters", "60", "--load", str(save)], timeout=200)
    assert f"is being written by tools/pretrain_gpt.py --save {save} (pid {running.pid}" in one_line(restart)
    stdout, stderr = running.communicate(timeout=400)
    assert running.returncode == 0, stderr[-3000:]
    assert sorted(losses(stdout)) == list(range(13, 61)) and verified_run(save) == 60
    assert not (save / LOCK).exists()  # released at the end of the job


def _unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


NEEDS_UNSHARE = pytest.mark.skipif(not _unshare_works(), reason="no user and mount namespaces (unshare -rm) here")


def in_namespace(script: str, timeout: int = 400) -> subprocess.CompletedProcess:
    """``script`` (bash) in a user and mount namespace of its own, as root there."""
    return subprocess.run(["unshare", "-rm", "bash", "-euc", script], cwd=REPO, env=job_env(), capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


CHECK_SAVED = f"""
{shlex.quote(sys.executable)} - "$@" <<'EOF'
import os, sys
from megatron_muon.checkpoint.integrity import verify_manifest
save = sys.argv[1]
tracked = open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip()
verify_manifest(os.path.join(save, f"iter_{{int(tracked):07d}}"), local=True)
print("SAVED", tracked, sorted(os.listdir(save)))
EOF
"""


@NEEDS_UNSHARE
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "launcher, flags, size",
    [
        (PRETRAIN, [], "5m"),  # full while Megatron-core's writer starts: it loses the OS error
        (TWO_RANKS, ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
                     "--ckpt-format", "fsdp_dtensor"], "4m"),
    ],
    ids=["torch_dist", "fsdp_dtensor"],
)  # fmt: skip
def test_a_full_disk_is_one_line_and_keeps_what_was_saved(cache, tmp_path, launcher, flags, size):
    disk = tmp_path / "disk"
    disk.mkdir()
    job = launcher + TINY + flags + ["--train-iters", "20", "--data-cache-path", str(cache), "--save", f"{disk}/run"]
    proc = in_namespace(
        f"mount -t tmpfs -o size={size} tmpfs {disk}\n"
        f"set +e; {shlex.join(job)}; echo EXIT $?; set -e\n"
        f"bash -c {shlex.quote(CHECK_SAVED)} check {disk}/run"
    )
    said = [line for line in proc.stderr.splitlines() if "pretrain_gpt.py: error:" in line]
    assert "EXIT 1" in proc.stdout and len(said) == 1, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "No space left on device" in said[0] and "--save" in said[0], said[0]
    # No rank's traceback (torchrun itself reports a failed rank with one of its own).
    assert not [line for line in proc.stderr.splitlines() if line.startswith("[rank") and "Traceback" in line]
    assert "SAVED" in proc.stdout and ".tmp" not in proc.stdout.split("SAVED")[1], proc.stdout[-2000:]


@NEEDS_UNSHARE
@pytest.mark.timeout(600)
def test_read_only_save_refused_at_start_and_read_only_load_read_as_it_is(cache, tmp_path):
    """A read-only --save is one line before anything is built (not a traceback at the
    first save). A read-only --load holding a stale staging directory (what a job killed
    mid-save left) resumes: a directory this job does not own is only read."""
    ckpt = tmp_path / "ckpt"
    job = PRETRAIN + TINY + ["--data-cache-path", str(cache)]
    first = launch(job + ["--train-iters", "4", "--exit-interval", "2", "--save", str(ckpt)], timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    (ckpt / "iter_0000003.tmp").mkdir()
    (ckpt / "iter_0000003.tmp" / "__0_0.distcp").write_text("half written")
    read_only = f"mount --bind {ckpt} {ckpt}\nmount -o remount,bind,ro {ckpt}\n"
    refused = in_namespace(
        read_only + shlex.join(job + ["--train-iters", "4", "--load", str(ckpt), "--save", str(ckpt)])
    )
    said = one_line(refused)
    assert "Read-only file system" in said and "[after model" not in refused.stdout, said
    elsewhere = tmp_path / "elsewhere"
    resumed = in_namespace(read_only + shlex.join(job + ["--train-iters", "4", "--load", str(ckpt), "--save",
                                                         str(elsewhere)]))  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(losses(resumed.stdout)) == [3, 4] and (ckpt / "iter_0000003.tmp").is_dir()
