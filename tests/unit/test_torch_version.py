"""The torch releases the main job runs on (issue 50): setup.py's floor, and the one-line
refusal of a torch found not to work with megatron-core 0.19.2."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_muon.megatron_lm.launch import check_torch_version

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("version", ["2.10.0", "2.11.0+cu130", "2.14.1", "2.11.0a0+git1234"])
def test_torch_before_the_first_failing_release_runs(version):
    check_torch_version(version)


@pytest.mark.parametrize("version", ["2.15.0+cu132", "2.16.0", "3.0.0"])
def test_torch_from_the_first_failing_release_is_refused_in_one_line(version):
    with pytest.raises(ValueError, match=r"torch .* does not run megatron-core 0\.19\.2's checkpoints") as refusal:
        check_torch_version(version)
    message = str(refusal.value)
    assert len(message.splitlines()) == 1 and "install torch 2.11" in message


def test_setup_requires_torch_2_10_or_later():
    """torch before 2.10 has CVE-2026-24747 (its weights_only unpickler): pip refuses 2.9."""
    setup = (ROOT / "setup.py").read_text()
    assert re.search(r'"torch>=2\.10"', setup), "setup.py must require torch>=2.10"
