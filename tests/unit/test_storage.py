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
    assert {DistributedOptimizerStorage.checkpoint_format.name, MegatronFSDPStorage.checkpoint_format.name} == {
        "torch_dist",
        "fsdp_dtensor",
    }


def test_step_overlap_runs_only_where_the_engine_can_finish_a_bucket_group_alone():
    """'auto' picks 'forward' only under DDP with overlap_param_gather and unquantized
    parameter gathers; 'forward' asked elsewhere is refused, naming why."""
    from megatron_muon.pipeline import step_overlap_mode

    def ddp(**flags):
        config = dict(
            use_megatron_fsdp=False, overlap_param_gather=True, fp8_param_gather=False, fp4_param_gather=False
        )
        return SimpleNamespace(ddp_config=SimpleNamespace(**{**config, **flags}), buffers=[])

    def mode(chunk, asked="auto", offload=False):
        config = SimpleNamespace(muon_step_overlap=asked, muon_cpu_offload=offload)
        return step_overlap_mode(config, [chunk], storage_for([chunk]))

    assert mode(ddp()) == mode(ddp(), "forward") == "forward"
    assert mode(ddp(), "none") == mode(ddp(), offload=True) == "none"
    cases = [(ddp(overlap_param_gather=False), "--overlap-param-gather"), (ddp(fp8_param_gather=True), "FP8"),
             (ddp(fp4_param_gather=True), "FP4"), (_fsdp_chunk(), "Megatron-FSDP")]  # fmt: skip
    for chunk, why in cases:
        assert mode(chunk) == "none"
        with pytest.raises(ValueError, match=f"muon_step_overlap='forward' cannot run here: .*{why}"):
            mode(chunk, "forward")


ENGINE_NAMES = re.compile(r"fsdp|use_distributed_optimizer|param_and_grad_buffer|bucket", re.IGNORECASE)


@pytest.mark.parametrize("module", ["optimizer.py", "factory.py", "pipeline.py", "planner.py", "state.py", "rule.py"])
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
