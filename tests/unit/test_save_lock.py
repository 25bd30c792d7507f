"""One job per save directory (``megatron_muon.checkpoint.save_lock``), one process and its
children: a live holder is refused in one line naming it (on this host by its PID and start
time, on another by its heartbeat), a provably dead one is taken over, a lost lock is noticed
before the next save, and two takers racing for a stale lock get it once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from megatron_muon.checkpoint import CheckpointError, SaveDirectoryLockedError
from megatron_muon.checkpoint import save_lock as L


@pytest.fixture(autouse=True)
def no_locks_left():
    yield
    for lock in list(L._held.values()):
        lock.release()


def forge(directory, **fields) -> str:
    """A lock file as another process would have written it."""
    os.makedirs(directory, exist_ok=True)
    holder = dict(L.holder_identity("another job"), **fields)
    with open(os.path.join(directory, L.LOCK), "w") as f:
        json.dump(holder, f)
    return holder["token"]


def test_taken_released_and_taken_again(tmp_path):
    lock = L.take(str(tmp_path / "run"), "job A")
    assert L.take(str(tmp_path / "run"), "job A") is lock and L.held(str(tmp_path / "run")) is lock
    lock.confirm()
    lock.release()
    assert not (tmp_path / "run" / L.LOCK).exists() and L.held(str(tmp_path / "run")) is None
    L.take(str(tmp_path / "run"), "job B").release()


def test_a_live_holder_on_this_host_is_refused_a_dead_one_taken_over(tmp_path, capsys):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        forge(tmp_path, pid=sleeper.pid, start=L.process_start(sleeper.pid), command="pretrain_gpt.py --save x")
        with pytest.raises(SaveDirectoryLockedError, match=f"is being written by another job \\(pid {sleeper.pid} on"):
            L.take(str(tmp_path), "job B")
        before = (tmp_path / L.LOCK).read_text()
        # the same PID with another start time is another process: the holder is gone
        forge(tmp_path, pid=sleeper.pid, start="1")
        lock = L.take(str(tmp_path), "job B")
        assert "took over" in capsys.readouterr().err and lock.held()
        assert json.loads((tmp_path / L.LOCK).read_text())["pid"] == os.getpid() != json.loads(before)["pid"]
    finally:
        sleeper.kill()
        sleeper.wait()


def test_another_host_is_judged_by_its_heartbeat(tmp_path):
    forge(tmp_path, host="node-17", boot_id="other")
    with pytest.raises(SaveDirectoryLockedError, match="pid .* on node-17"):
        L.take(str(tmp_path), "job B")
    stale = time.time() - L.LEASE - 60
    os.utime(tmp_path / L.LOCK, (stale, stale))
    assert L.take(str(tmp_path), "job B").held()


def test_a_lost_lock_is_noticed_before_the_next_save(tmp_path):
    lock = L.take(str(tmp_path), "job A")
    forge(tmp_path, host="node-17", boot_id="other")  # taken over while this job was stopped
    with pytest.raises(SaveDirectoryLockedError, match="no longer holds"):
        lock.confirm()
    lock.release()
    assert json.loads((tmp_path / L.LOCK).read_text())["host"] == "node-17"  # not removed: not ours


RACER = """
import os, sys, time
from megatron_muon.checkpoint import SaveDirectoryLockedError, save_lock
open(sys.argv[2] + "." + sys.argv[3], "w").close()  # imported: ready to race
while not os.path.exists(sys.argv[2]):
    time.sleep(0.001)
try:
    save_lock.take(sys.argv[1], "racer")
    print("took", flush=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(sys.argv[2] + ".stop") and time.monotonic() < deadline:
        time.sleep(0.01)  # held (alive) until both have answered, however loaded the machine
except SaveDirectoryLockedError:
    print("refused", flush=True)
"""


def test_two_takers_of_a_stale_lock_get_it_once(tmp_path):
    from tests.helpers import REPO

    for attempt in range(2):
        forge(tmp_path, pid=2**22 + 7, start="1")  # a holder that is gone
        go = tmp_path / f"go{attempt}"
        racers = [
            subprocess.Popen(
                [sys.executable, "-c", RACER, str(tmp_path), str(go), str(i)],
                cwd=REPO,
                stdout=subprocess.PIPE,
                text=True,
            )
            for i in range(2)
        ]
        deadline = time.monotonic() + 300
        while not all(os.path.exists(f"{go}.{i}") for i in range(2)) and time.monotonic() < deadline:
            time.sleep(0.05)  # both past their imports: they race, not the first against a gone holder
        go.write_text("")
        said = sorted(r.stdout.readline().strip() for r in racers)
        (tmp_path / f"go{attempt}.stop").write_text("")
        for r in racers:
            r.communicate(timeout=120)
        assert said == ["refused", "took"], said
    assert not [n for n in os.listdir(tmp_path) if ".stale." in n or n.startswith(f".{L.LOCK}")]


def test_an_unwritable_directory_is_one_line(tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(CheckpointError, match="cannot be written .*choose another"):
        L.take(str(tmp_path / "a_file" / "run"), "job")


def _unshare_pid_works() -> bool:
    """Whether this machine lets a process start in a PID namespace of its own (root, or user
    namespaces) with its own /proc."""
    try:
        done = subprocess.run(["unshare", "-fp", "--mount-proc", "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


HOLDER = """
import os, sys, time
from megatron_muon.checkpoint import SaveDirectoryLockedError, save_lock
try:
    lock = save_lock.take(sys.argv[1], "job " + sys.argv[2])
except SaveDirectoryLockedError as e:
    print("refused:", e, flush=True)
    sys.exit(0)
print("took", flush=True)
if sys.argv[3] == "-":  # only trying
    sys.exit(0)
while not os.path.exists(sys.argv[3]):
    time.sleep(0.05)
lock.confirm()  # raises if another job took it meanwhile
print("still held", flush=True)
"""


@pytest.mark.skipif(not _unshare_pid_works(), reason="no PID namespaces here (unshare -fp --mount-proc)")
@pytest.mark.parametrize("first_in_namespace", [True, False], ids=["holder-in-namespace", "taker-in-namespace"])
def test_jobs_in_two_pid_namespaces_never_take_the_lock_from_each_other(tmp_path, first_in_namespace):
    """A job in a PID namespace of its own (a container sharing the host's name, as with host
    networking) has another PID there than here: judged by PID, each looked ended to the
    other and took its lock, and both saved into one directory. Judged by the heartbeat
    instead, the second job is refused, naming the first, which keeps its lock."""
    from tests.helpers import REPO

    namespace = ["unshare", "-fp", "--mount-proc", "--kill-child"]  # the job dies with unshare
    go = tmp_path / "go"
    first = subprocess.Popen(
        (namespace if first_in_namespace else [])
        + [sys.executable, "-c", HOLDER, str(tmp_path / "save"), "A", str(go)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert first.stdout.readline().strip() == "took"
        second = subprocess.run(
            ([] if first_in_namespace else namespace)
            + [sys.executable, "-c", HOLDER, str(tmp_path / "save"), "B", "-"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.stdout.startswith("refused:") and "is being written by job A" in second.stdout, second
        go.write_text("")
        assert first.communicate(timeout=60)[0].strip() == "still held"
    finally:
        go.write_text("")
        first.kill()
        first.wait()


@pytest.mark.parametrize("kind", ["directory", "symlink", "fifo"])
def test_a_lock_that_is_not_a_file_is_named_and_left_as_it_is(tmp_path, kind):
    """``megatron_muon.lock`` that is a directory (made by hand, or by an old tool), a symlink
    or a FIFO: refused in one line saying what it is (it was moved aside, then reported as a
    permissions problem), left where it was."""
    path = tmp_path / L.LOCK
    if kind == "directory":
        path.mkdir()
        (path / "notes").write_text("mine")
    elif kind == "symlink":
        (tmp_path / "elsewhere").write_text("{}")
        os.symlink(tmp_path / "elsewhere", path)
    else:
        os.mkfifo(path)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(SaveDirectoryLockedError) as error:
        L.take(str(tmp_path), "job B")
    said = str(error.value)
    assert f"{path} is a {kind if kind != 'fifo' else 'FIFO'}, not a lock" in said and "\n" not in said, said
    assert sorted(os.listdir(tmp_path)) == before
