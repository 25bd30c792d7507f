"""The support matrix (``megatron_muon/support.py``): every refusal, written once, read alike
from a library call's settings (a config and each chunk's DDP settings) and from
Megatron-LM's arguments (``integration.settings_from_args``), naming the setting and its flag.
Each refusal's command-line case runs through the main job in tests/e2e/test_pretrain.py
(BAD_INPUT) or tests/dist/test_megatron_lm_integration.py."""

from __future__ import annotations

import argparse
import ast
from types import SimpleNamespace

import pytest

from megatron_muon.megatron_lm.integration import settings_from_args
from megatron_muon.storage import DistributedOptimizerStorage, MegatronFSDPStorage
from megatron_muon.support import Settings, refusals
from tests.helpers import REPO

SUPPORTED = dict(
    # the optimizer's
    use_precision_aware_optimizer=False,
    reuse_grad_buf_for_mxfp8_param_ag=False,
    optimizer_cpu_offload=False,
    optimizer_offload_fraction=1.0,
    muon_cpu_offload=False,
    muon_step_overlap="auto",
    # the engine's
    use_distributed_optimizer=True,
    num_distributed_optimizer_instances=1,
    overlap_param_gather=False,
    fp8_param_gather=False,
    fp4_param_gather=False,
    data_parallel_sharding_strategy="optim_grads_params",
    overlap_grad_reduce=True,
)

DDP, FSDP = DistributedOptimizerStorage, MegatronFSDPStorage
REFUSALS = [
    (DDP, dict(use_distributed_optimizer=False), "needs use_distributed_optimizer=True", "--use-distributed-optimizer"),
    (
        DDP,
        dict(num_distributed_optimizer_instances=2),
        "needs num_distributed_optimizer_instances=1",
        "--num-distributed-optimizer-instances 1",
    ),
    (FSDP, dict(num_distributed_optimizer_instances=2), "(HSDP on Megatron-FSDP) is not supported", "--num-distr"),
    (
        DDP,
        dict(use_precision_aware_optimizer=True),
        "does not support use_precision_aware_optimizer",
        "--use-precision-aware-optimizer",
    ),
    (
        DDP,
        dict(reuse_grad_buf_for_mxfp8_param_ag=True),
        "does not support reuse_grad_buf_for_mxfp8_param_ag",
        "--reuse-grad-buf-for-mxfp8-param-ag",
    ),
    (
        DDP,
        dict(optimizer_cpu_offload=True),
        "optimizer_cpu_offload=True needs muon_cpu_offload=True",
        "--muon-cpu-offload",
    ),
    (
        DDP,
        dict(optimizer_cpu_offload=True, muon_cpu_offload=True, optimizer_offload_fraction=0.5),
        "optimizer_offload_fraction=0.5 is not supported",
        "--optimizer-offload-fraction 1.0",
    ),
    (DDP, dict(muon_step_overlap="forward"), "muon_step_overlap='forward' cannot run here", "--overlap-param-gather"),
    (
        DDP,
        dict(muon_step_overlap="forward", overlap_param_gather=True, fp8_param_gather=True),
        "does not quantize FP8 / FP4",
        "--fp8-param-gather",
    ),
    (FSDP, dict(muon_step_overlap="forward"), "not on Megatron-FSDP", "--muon-step-overlap none"),
    (FSDP, dict(muon_cpu_offload=True), "does not offload to the CPU on Megatron-FSDP", "--muon-cpu-offload"),
    (
        FSDP,
        dict(data_parallel_sharding_strategy="no_shard"),
        "data_parallel_sharding_strategy='no_shard' is not supported",
        "--data-parallel-sharding-strategy",
    ),
    (
        FSDP,
        dict(data_parallel_sharding_strategy="optim", overlap_grad_reduce=False),
        "reduces gradients twice",
        "--overlap-grad-reduce",
    ),
    (FSDP, dict(pipeline_model_parallel_size=2), "pipeline parallelism fails", "--pipeline-model-parallel-size 1"),
    (
        FSDP,
        dict(megatron_fsdp_main_params_dtype=None),
        "without main weights",
        "--megatron-fsdp-main-params-dtype fp32",
    ),
]


def _views(storage, **changed):
    """The library's settings (a config, two chunks' DDP settings) and Megatron-LM's."""
    values = {**SUPPORTED, **changed}
    library = Settings(SimpleNamespace(**values), (SimpleNamespace(**values), SimpleNamespace(**values)))
    if values.get("megatron_fsdp_main_params_dtype", "") is None:
        values["megatron_fsdp_main_params_dtype"] = "auto"  # the flag's value, None once Megatron-LM validated it
    args = argparse.Namespace(use_megatron_fsdp=storage is FSDP, **values)
    return {"library": library, "megatron-lm": settings_from_args(args)}


@pytest.mark.parametrize("storage", [DDP, FSDP], ids=["ddp", "fsdp"])
def test_supported_settings_are_refused_nowhere(storage):
    for view in _views(storage).values():
        assert refusals(view, storage) == []


@pytest.mark.parametrize("storage, changed, says, flag", REFUSALS, ids=[r[2][:40] for r in REFUSALS])
def test_each_refusal_names_the_setting_and_its_flag_in_both_views(storage, changed, says, flag):
    for name, view in _views(storage, **changed).items():
        found = refusals(view, storage)
        assert len(found) == 1 and says in found[0] and flag in found[0], (name, found)


def test_megatron_lm_demands_a_precision_aware_optimizer_for_its_offload_which_ours_drops():
    """--optimizer-cpu-offload --use-precision-aware-optimizer --muon-cpu-offload: Megatron-LM's
    validation asserts the precision-aware optimizer with its offload; ours runs without one."""
    offload = dict(optimizer_cpu_offload=True, muon_cpu_offload=True, use_precision_aware_optimizer=True)
    views = _views(DDP, **offload)
    assert refusals(views["megatron-lm"], DDP) == []
    assert "use_precision_aware_optimizer" in refusals(views["library"], DDP)[0]


ONCE = [
    "needs use_distributed_optimizer=True",
    "needs num_distributed_optimizer_instances=1",
    "does not support use_precision_aware_optimizer",
    "does not support reuse_grad_buf_for_mxfp8_param_ag",
    "needs muon_cpu_offload=True",
    "is not supported with optimizer_cpu_offload",
    "cannot run here",
    "does not offload to the CPU on Megatron-FSDP",
    "Megatron-FSDP with data_parallel_sharding_strategy=",
    "reduces gradients twice",
    "pipeline parallelism fails",
    "without main weights",
    "--dump-param-to-param-group-map",
]


def _code_strings():
    """(file, text) of every string in the package's code (docstrings aside; an f-string's
    literal parts joined)."""
    out = []
    for path in sorted((REPO / "megatron_muon").rglob("*.py")):
        tree = ast.parse(path.read_text())
        skip = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        skip.update(id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values)  # counted below
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                out.append((path, "".join(v.value for v in node.values if isinstance(v, ast.Constant))))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
                out.append((path, node.value))
    return out


def test_each_refusal_is_written_once():
    strings = _code_strings()
    for phrase in ONCE:
        where = [str(path.relative_to(REPO)) for path, text in strings if phrase in text]
        assert len(where) == 1, f"{phrase!r} is written in {where}"
