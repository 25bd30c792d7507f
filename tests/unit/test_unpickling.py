"""Reading a checkpoint never runs code stored in it (``megatron_muon.checkpoint.unpickling``),
one process, no model: a pickle naming anything outside the allowlist is refused before
anything is called, naming the type; what Megatron-LM's and our checkpoints hold loads; the
readers of torch DCP and Megatron-core go through it inside ``restricted_reading`` and are
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
from megatron_muon.checkpoint.reading import restricted_reading
from megatron_muon.checkpoint.unpickling import load_pickle, torch_load


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
    with restricted_reading():
        patched = readers()
        assert all(hasattr(f, "__wrapped__") for f in patched)  # ours, wrapping torch's / Megatron's
        with restricted_reading():  # reentrant
            assert readers() == patched
        assert readers() == patched
    assert readers() == before

    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "marker"
    dcp.save({"t": torch.ones(2), "obj": {"iteration": Payload(str(marker))}}, checkpoint_id=str(tmp_path / "c"))
    with restricted_reading():
        metadata = FileSystemReader(str(tmp_path / "c")).read_metadata()  # DCP's own classes load
        assert "t" in metadata.state_dict_metadata
        with pytest.raises(BaseException) as error:
            dcp.load({"t": torch.zeros(2), "obj": {"iteration": None}}, checkpoint_id=str(tmp_path / "c"))
    from megatron_muon.checkpoint.errors import checkpoint_error_in

    assert "posix.system" in str(checkpoint_error_in(error.value)) and not marker.exists()


# ---------------------------------------------------------------------------------------
# A checkpoint builds data, never changes a class, and cannot make its reader hang
# ---------------------------------------------------------------------------------------

CLASSES_AND_FUNCTIONS = [
    ("argparse", "Namespace"),  # every getattr(args, X, default) of Megatron-LM would read the class's X
    ("types", "SimpleNamespace"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("megatron.core.optimizer.optimizer_config", "OptimizerConfig"),
    ("megatron_muon.checkpoint.fsdp_dtensor", "CommonState"),
    ("pathlib", "PosixPath"),
    ("megatron.core.rerun_state_machine", "RerunMode"),
    ("torch._utils", "_rebuild_tensor_v2"),
]


@pytest.mark.parametrize("module,name", CLASSES_AND_FUNCTIONS, ids=[n for _, n in CLASSES_AND_FUNCTIONS])
def test_build_on_an_allowed_class_or_function_is_refused_and_changes_nothing(module, name):
    """Pickle's BUILD with a slot state on a global does ``setattr(global, ...)``: a checkpoint
    would set class attributes process-wide (``argparse.Namespace.dataloader_save``)."""
    import importlib

    from tests.helpers.crafted_pickles import build_on_global, whole

    target = importlib.import_module(module)
    for part in name.split("."):
        target = getattr(target, part)
    try:
        with pytest.raises(UnsafeCheckpointError, match="BUILD") as error:
            load_pickle(io.BytesIO(whole(build_on_global(module, name, "dataloader_save", "/x"))), ".metadata")
        assert "dataloader_save" not in vars(target) and "\n" not in str(error.value)
    finally:
        if "dataloader_save" in vars(target):
            delattr(target, "dataloader_save")


def test_build_on_an_enum_member_is_refused_and_an_enum_name_never_resolves_to_enum_itself():
    """An enum member is a process-wide singleton (Megatron-LM compares arguments with it);
    ``megatron.core.X.Enum`` (a module that imported it) is ``enum.Enum``, not one of
    Megatron-core's enums."""
    import enum

    from megatron.core.rerun_state_machine import RerunMode

    from megatron_muon.checkpoint.unpickling import allowed
    from tests.helpers.crafted_pickles import global_, text, whole

    state = pickle.NONE + pickle.EMPTY_DICT + text("_value_") + text("validate_results") + pickle.SETITEM
    member = global_("megatron.core.rerun_state_machine", "RerunMode") + text("disabled") + pickle.TUPLE1
    crafted = whole(member + pickle.REDUCE + state + pickle.TUPLE2 + pickle.BUILD)
    try:
        with pytest.raises(UnsafeCheckpointError, match="BUILD"):
            load_pickle(io.BytesIO(crafted), ".metadata")
        assert RerunMode.DISABLED.value == "disabled"
    finally:
        RerunMode.DISABLED._value_ = "disabled"
    assert allowed("megatron.core.rerun_state_machine", "Enum") is None
    assert allowed("megatron.core.rerun_state_machine", "RerunMode") is RerunMode and RerunMode is not enum.Enum


DAG_READS = r"""
import io, json, sys, zipfile
import torch
from megatron_muon.checkpoint import UnsafeCheckpointError
from megatron_muon.checkpoint.unpickling import load_pickle, torch_load
from tests.helpers.crafted_pickles import global_, list_dag, set_of, splice, tuple_dag, whole
import pickle

def as_torch_file(body):
    plain = io.BytesIO()
    torch.save({"args": "PLACEHOLDER"}, plain)
    out = io.BytesIO()
    with zipfile.ZipFile(plain) as z, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as w:
        for name in z.namelist():
            data = z.read(name)
            w.writestr(name, splice(data, "PLACEHOLDER", body) if name.endswith("data.pkl") else data)
    out.seek(0)
    return out

frozen = global_("builtins", "frozenset") + pickle.MARK + tuple_dag(90) + pickle.LIST + pickle.TUPLE1 + pickle.REDUCE
cases = {
    "tuple DAG in a set": set_of(tuple_dag(90)),
    "tuple DAG in a frozenset": frozen,
    "tuple DAG as a dict key": pickle.EMPTY_DICT + tuple_dag(90) + pickle.NONE + pickle.SETITEM,
    "list DAG": list_dag(90),
    "deep nesting": pickle.EMPTY_TUPLE + pickle.TUPLE1 * 100_000,
}
results = {}
for name, body in cases.items():
    for reader in ("load_pickle", "torch_load"):
        try:
            if reader == "load_pickle":
                load_pickle(io.BytesIO(whole(body)), ".metadata")
            else:
                torch_load(as_torch_file(body), "the stored object common_state/shard_0_1")
            results[f"{name} ({reader})"] = "loaded"
        except UnsafeCheckpointError as e:
            results[f"{name} ({reader})"] = str(e)
print(json.dumps(results))
"""


def test_a_dag_or_deep_nesting_is_refused_while_loading_before_anything_hashes_it(tmp_path):
    """A few hundred bytes of pickle can hold a tuple DAG whose hash visits 2**90 leaves (in a
    set, a frozenset, a dict key: hashed while it loads), a list DAG that every print or
    format of it expands, or 100,000 nested tuples (a C recursion in their hash): each is
    refused while it loads, in one line, through both readers. In a child process: a reader
    without the bounds hashes for ever (its hang ends the child at the timeout, failing here)."""
    import json
    import subprocess
    import sys

    from tests.helpers import REPO

    proc = subprocess.run([sys.executable, "-c", DAG_READS], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 10
    for case, said in results.items():
        assert said != "loaded" and "\n" not in said, (case, said)
        assert said.startswith((".metadata holds", "the stored object common_state/shard_0_1 holds")), (case, said)
