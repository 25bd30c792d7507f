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
while not os.path.exists(sys.argv[2]):
    time.sleep(0.001)
try:
    save_lock.take(sys.argv[1], "racer")
    print("took", flush=True)
    time.sleep(1.0)
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
                [sys.executable, "-c", RACER, str(tmp_path), str(go)], cwd=REPO, stdout=subprocess.PIPE, text=True
            )
            for _ in range(2)
        ]
        time.sleep(0.5)
        go.write_text("")
        said = sorted(r.communicate(timeout=60)[0].strip() for r in racers)
        assert said == ["refused", "took"], said
    assert not [n for n in os.listdir(tmp_path) if ".stale." in n or n.startswith(f".{L.LOCK}")]


def test_an_unwritable_directory_is_one_line(tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(CheckpointError, match="cannot be written .*choose another"):
        L.take(str(tmp_path / "a_file" / "run"), "job")
