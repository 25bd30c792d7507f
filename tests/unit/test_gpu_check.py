"""tools/bench/gpu_check.py: the one command for a CUDA machine, run here without one.

Without CUDA every part is skipped and the command exits 0; the plan fits seven minutes by
its own time boxes; a part past its box is stopped with its process group and is not a
failure, a crash is; the logs are read as Megatron-LM and pytest write them.
"""

from __future__ import annotations

import json
import os
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

from tools.bench import gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_without_cuda_every_part_is_skipped_and_the_command_exits_0(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(data["parts"]) == [p.name for p in gpu_check.PARTS]
    assert all(p["status"] == "skipped" and p["reason"] == "no CUDA device" for p in data["parts"].values())
    summary = (tmp_path / "gpu_check.md").read_text()
    assert summary.count("skipped (no CUDA device)") == len(gpu_check.PARTS)
    assert summary in capsys.readouterr().out
    assert tarfile.is_tarfile(tmp_path / "gpu_check_parts.tar.gz")


def test_the_plan_fits_seven_minutes_by_its_own_time_boxes():
    assert sum(p.box_s for p in gpu_check.PARTS) < gpu_check.PLAN_LIMIT_S == 8 * 60
    assert sorted(gpu_check.RUNNERS) == sorted(p.name for p in gpu_check.PARTS)


def test_a_part_past_its_box_is_stopped_with_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(child.pid)); time.sleep(60)"
    )
    started = time.monotonic()
    rc = gpu_check.run_boxed([sys.executable, "-c", script], 3, tmp_path / "log", dict(os.environ))
    assert rc is None and time.monotonic() - started < 30
    assert "stopped at its time box" in (tmp_path / "log").read_text()
    child = int(pid_file.read_text())
    for _ in range(50):  # the killed grandchild is reaped by init
        if not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the part's child process outlived its time box")
    assert gpu_check.run_boxed([sys.executable, "-c", "raise SystemExit(3)"], 30, tmp_path / "log", {}) == 3


def test_a_part_ends_with_the_check_that_started_it(tmp_path):
    """The check killed (its launcher's kill, an out-of-memory kill): its running part ends too."""
    import signal
    import subprocess

    pid_file = tmp_path / "part.pid"
    part = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    check = (
        "import os, sys; from tools.bench import gpu_check; "
        f"gpu_check.run_boxed([sys.executable, '-c', {part!r}], 60, {str(tmp_path / 'log')!r}, dict(os.environ))"
    )
    proc = subprocess.Popen([sys.executable, "-c", check], cwd=gpu_check.ROOT)
    for _ in range(300):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.1)
    part_pid = int(pid_file.read_text())
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for _ in range(100):
        if not Path(f"/proc/{part_pid}").exists() or "Z" in Path(f"/proc/{part_pid}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the part outlived the killed check")


def test_a_failed_part_fails_the_command_and_a_timed_out_one_does_not(tmp_path, monkeypatch):
    def crashes(*args):
        raise RuntimeError("a reader bug")

    monkeypatch.setattr(gpu_check.common, "environment", lambda device: dict(date="d", device_name=device, versions={}, command="c"))  # fmt: skip
    monkeypatch.setitem(gpu_check.RUNNERS, "cuda_tier", lambda *a: dict(status="timed_out"))
    monkeypatch.setitem(gpu_check.RUNNERS, "newton_schulz", lambda *a: dict(status="passed", rows=[]))
    monkeypatch.setitem(gpu_check.RUNNERS, "optimizer_step", crashes)
    monkeypatch.setitem(gpu_check.RUNNERS, "main_job", lambda *a: dict(status="passed"))
    data = gpu_check.run(gpu_check.PARTS, tmp_path, cuda=True)
    statuses = {name: p["status"] for name, p in data["parts"].items()}
    assert statuses == dict(cuda_tier="timed_out", newton_schulz="passed", optimizer_step="failed", main_job="passed")
    assert data["parts"]["optimizer_step"]["error"] == "RuntimeError: a reader bug"
    assert gpu_check.exit_status(data) == 1
    del data["parts"]["optimizer_step"]
    assert gpu_check.exit_status(data) == 0
    assert json.loads((tmp_path / "gpu_check.json").read_text())["parts"]["main_job"]["status"] == "passed"


def test_the_logs_are_read_as_megatron_lm_and_pytest_write_them():
    megatron = (
        " [2026-11-27 07:02:33.685743] iteration        2/      55 | consumed samples:           16 | elapsed time "
        "per iteration (ms): 202.4 | learning rate: 3.250000E-03 | global batch size:     8 | lm loss: 5.532614E+00 "
        "| loss scale: 1.0 | grad norm: 3.808 | number of skipped iterations:   0 | number of nan iterations:   0 |\n"
        "[Rank 0] (after 2 iterations) memory (MB) | allocated: 812.5 | max allocated: 2048.25 | reserved: 3000.0 "
        "| max reserved: 3072.0\n"
    )
    seen = gpu_check.read_iterations(megatron)
    assert seen["ms"] == {2: 202.4} and seen["loss"] == {2: 5.532614}
    assert seen["max_allocated_mb"] == 2048.25 and seen["max_reserved_mb"] == 3072.0
    pytest_out = (
        "tests/cuda/test_cuda.py::test_a PASSED [ 50%]\n"
        "[gw1] [ 75%] FAILED tests/cuda/test_cuda.py::test_b[shape0] \n"
        "[gw0] [100%] SKIPPED tests/cuda/test_cuda.py::test_c \n"
    )
    assert gpu_check.read_pytest_outcomes(pytest_out) == {
        "tests/cuda/test_cuda.py::test_a": "PASSED",
        "tests/cuda/test_cuda.py::test_b[shape0]": "FAILED",
        "tests/cuda/test_cuda.py::test_c": "SKIPPED",
    }


def test_a_rerun_of_some_parts_takes_the_others_from_an_earlier_run(tmp_path, monkeypatch):
    env = dict(date="now", device_name="GPU X", versions={}, command="c")
    monkeypatch.setattr(gpu_check.common, "environment", lambda device: env)
    monkeypatch.setitem(gpu_check.RUNNERS, "cuda_tier", lambda *a: dict(status="passed"))
    earlier = dict(
        env=dict(env, date="then", command="first"),
        parts=dict(cuda_tier=dict(status="failed"), main_job=dict(status="passed", seconds=1, box_s=2, what="w")),
    )
    data = gpu_check.merge(gpu_check.run(gpu_check.PARTS[:1], tmp_path, cuda=True), earlier)
    assert list(data["parts"]) == ["cuda_tier", "main_job"]
    assert data["parts"]["cuda_tier"]["status"] == "passed" and data["parts"]["cuda_tier"]["date"] == "now"
    assert data["parts"]["main_job"]["date"] == "then" and gpu_check.exit_status(data) == 0
    assert "from the run of then" in gpu_check.markdown(data)
    with pytest.raises(SystemExit, match="on GPU Y"):
        gpu_check.merge(data, dict(earlier, env=dict(env, device_name="GPU Y")))


def test_main_job_compares_losses_as_far_as_each_run_got_at_each_learning_rate(tmp_path, monkeypatch):
    """AdamW and Muon at each learning rate; a run stopped at the part's box is no loss
    mismatch; a run's time counts only when it finished its timed iterations; a Muon run
    logging another loss than the other place of its step at that rate fails the part."""
    total = gpu_check.MAIN_JOB_WARMUP + gpu_check.MAIN_JOB_TIMED
    plan = {}  # position -> (iterations logged, ms per iteration, loss offset)

    def fake_run(cmd, box_s, log, env):
        position = int(Path(log).stem.split("_")[2])
        count, ms, offset = plan[position]
        lr = float(cmd[cmd.index("--lr") + 1])
        with open(log, "a") as out:
            for i in range(1, count + 1):
                out.write(f" [t] iteration {i:8d}/{total:8d} | consumed samples: {8 * i} | elapsed time per iteration (ms): {ms} | "
                          f"lm loss: {10.0 - i * lr + offset:.6E} | grad norm: 1.0 |\n")  # fmt: skip
        return 0 if count == total else None

    monkeypatch.setattr(gpu_check, "run_boxed", fake_run)
    runs = gpu_check.MAIN_JOB_RUNS
    assert {(opt, lr) for _, opt, lr, _ in runs} == {(o, lr) for o in ("adam", "muon") for lr in gpu_check.MAIN_JOB_LRS}
    last = len(runs) - 1
    assert runs[last][1] == "muon" and "forward" in runs[last][3]
    plan.update({i: (total, 100.0 + i, 0.0) for i in range(len(runs))})
    plan[last] = (7, 500.0, 0.0)  # the last run stopped at the box after 7 iterations
    job = gpu_check.main_job(60, tmp_path, tmp_path / "log", {})
    assert job["status"] == "timed_out" and job["muon_losses_same"]
    assert runs[last][0] not in job["median_ms"] and job["over_step_whole"] == {}
    lr = gpu_check.MAIN_JOB_LRS[0]
    assert job["muon_over_adamw"][lr] == 101.0 / 100.0
    plan[last] = (total, 100.0, 1e-3)  # the step in the forward logs another loss
    assert gpu_check.main_job(60, tmp_path, tmp_path / "log2", {})["status"] == "failed"
