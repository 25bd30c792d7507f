"""The storage backends (``megatron_muon/storage``): the engine is chosen once, from the
chunks, and nothing outside ``storage/`` asks which one runs."""

from __future__ import annotations

import ast
import re
from types import SimpleNamespace

import pytest

from megatron_muon.storage import DistributedOptimizerStorage, MegatronFSDPStorage, storage_for
from tests.helpers import REPO


def _ddp_chunk():
    return SimpleNamespace(ddp_config=SimpleNamespace(use_megatron_fsdp=False), buffers=[])


def _fsdp_chunk():
    return SimpleNamespace(ddp_config=SimpleNamespace(use_megatron_fsdp=True), param_and_grad_buffer=object())


def test_the_chunks_choose_their_backend_and_a_mix_is_refused():
    assert storage_for([_ddp_chunk(), _ddp_chunk()]) is DistributedOptimizerStorage
    assert storage_for([_fsdp_chunk()]) is MegatronFSDPStorage
    assert storage_for([SimpleNamespace()]) is DistributedOptimizerStorage  # its check names the wrapping
    with pytest.raises(ValueError, match="DistributedOptimizerStorage and MegatronFSDPStorage"):
        storage_for([_ddp_chunk(), _fsdp_chunk()])
    with pytest.raises(TypeError, match="not wrapped in megatron.core.distributed.DistributedDataParallel"):
        DistributedOptimizerStorage.check([SimpleNamespace()], None)
    assert {DistributedOptimizerStorage.checkpoint_format, MegatronFSDPStorage.checkpoint_format} == {
        "torch_dist",
        "fsdp_dtensor",
    }


ENGINE_NAMES = re.compile(r"fsdp|use_distributed_optimizer|param_and_grad_buffer|bucket", re.IGNORECASE)


@pytest.mark.parametrize("module", ["optimizer.py", "factory.py", "pipeline.py", "planner.py", "state.py"])
def test_only_the_storage_modules_know_the_engine(module):
    """The optimizer, the factory and the step name nothing of a data-parallel engine in
    their code (names, attributes, imports; prose aside): no branch on it can hide there, and
    a new engine is a new module under ``storage/``."""
    tree = ast.parse((REPO / "megatron_muon" / module).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(alias.name for alias in node.names)
            names.add(getattr(node, "module", None) or "")
    found = sorted(n for n in names if ENGINE_NAMES.search(n))
    assert not found, f"{module} names the data-parallel engine: {found}"
