"""Reading a checkpoint never runs code stored in it (``megatron_muon.checkpoint.unpickling``),
one process, no model: a pickle naming anything outside the allowlist is refused before
anything is called, naming the type; what Megatron-LM's and our checkpoints hold loads; the
readers of torch DCP and Megatron-core go through it inside ``restricted_unpickling`` and are
restored after it."""

from __future__ import annotations

import argparse
import io
import os
import pickle
import random
import signal

import numpy as np
import pytest
import torch

from megatron_muon.checkpoint import UnsafeCheckpointError
from megatron_muon.checkpoint.unpickling import load_pickle, restricted_unpickling, torch_load


class Payload:
    """What an attacker stores: unpickling it writes ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class OpensAFile:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("payload", [Payload, OpensAFile], ids=["os.system", "builtins.open"])
def test_a_payload_is_refused_naming_its_type_and_runs_nothing(tmp_path, payload):
    marker = tmp_path / "marker"
    data = {"args": argparse.Namespace(lr=0.1), "evil": [payload(str(marker))]}
    refused = "posix.system" if payload is Payload else "_io.open"
    with pytest.raises(UnsafeCheckpointError, match=f"file.pt holds a pickled {refused}, which no checkpoint"):
        load_pickle(io.BytesIO(pickle.dumps(data)), "file.pt")
    buffer = io.BytesIO()
    torch.save(data, buffer)
    buffer.seek(0)
    with pytest.raises(UnsafeCheckpointError) as error:
        torch_load(buffer, "common.pt")
    assert refused in str(error.value) and "\n" not in str(error.value)
    assert not marker.exists()


def test_what_checkpoints_hold_loads():
    """Megatron-LM's common state (arguments with enums and dtypes, RNG states of Python,
    numpy and torch, the rerun state machine's enums) and tensors."""
    from megatron.core.rerun_state_machine import RerunMode
    from megatron.core.transformer.enums import AttnBackend

    state = {
        "args": argparse.Namespace(
            params_dtype=torch.bfloat16, attention_backend=AttnBackend.auto, exit_signal=signal.SIGTERM
        ),
        "rng_state": [
            {
                "random_rng_state": random.getstate(),
                "np_rng_state": np.random.get_state(),
                "torch_rng_state": torch.get_rng_state(),
            }
        ],
        "rerun": {"mode": RerunMode.DISABLED},
        "weights": {"w": torch.arange(6.0).view(2, 3), "sizes": {1, 2}, "shape": torch.Size([2, 3])},
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch_load(buffer, "common.pt")
    assert loaded["args"].params_dtype is torch.bfloat16 and loaded["args"].attention_backend is AttnBackend.auto
    assert torch.equal(loaded["weights"]["w"], state["weights"]["w"]) and loaded["weights"]["sizes"] == {1, 2}
    assert (loaded["rng_state"][0]["np_rng_state"][1] == np.random.get_state()[1]).all()
    assert load_pickle(io.BytesIO(pickle.dumps(state["args"], protocol=2)), "x").exit_signal is signal.SIGTERM


def test_torch_dcp_and_megatron_readers_are_restricted_inside_the_block_only(tmp_path):
    import megatron.core.dist_checkpointing.strategies.common as common
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    def readers():
        return (FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes, common.load_common)

    before = readers()  # restricted already where a test of this process installed Megatron-LM's hooks
    with restricted_unpickling():
        patched = readers()
        assert all(hasattr(f, "__wrapped__") for f in patched)  # ours, wrapping torch's / Megatron's
        with restricted_unpickling():  # reentrant
            assert readers() == patched
        assert readers() == patched
    assert readers() == before

    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "marker"
    dcp.save({"t": torch.ones(2), "obj": {"iteration": Payload(str(marker))}}, checkpoint_id=str(tmp_path / "c"))
    with restricted_unpickling():
        metadata = FileSystemReader(str(tmp_path / "c")).read_metadata()  # DCP's own classes load
        assert "t" in metadata.state_dict_metadata
        with pytest.raises(BaseException) as error:
            dcp.load({"t": torch.zeros(2), "obj": {"iteration": None}}, checkpoint_id=str(tmp_path / "c"))
    from megatron_muon.checkpoint.errors import checkpoint_error_in

    assert "posix.system" in str(checkpoint_error_in(error.value)) and not marker.exists()
