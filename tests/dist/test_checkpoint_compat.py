"""A Muon torch_dist checkpoint written by an earlier megatron_muon still loads, bitwise.

``tests/data/checkpoint_v1`` was written by :func:`write_fixture` at commit 9a77c27, when
every rank all-gathered its TP-local parameters' whole optimizer state for a save (regular
chunks, one per TP-local tensor); later saves write each rank's own ranges (irregular
chunks of the same tensors). The reference is the fixture's own tensors, read whole by
torch DCP in this process, not through the optimizer."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from megatron_muon.testing import models as M
from megatron_muon.testing import run_distributed
from tests.helpers.training import GBS, build, train_steps

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "checkpoint_v1")
SPEC = dict(kind="gqa", num_layers=1, hidden_size=32, ffn_hidden_size=32, vocab_size=64)
CFG = dict(muon_variance_reduction=0.95)  # an owner-kept state (the second moment) too


def write_fixture(ckpt_dir):
    """At DP2: two steps, then a save (how ``tests/data/checkpoint_v1`` was made)."""
    from megatron_muon.checkpoint import save_checkpoint

    spec = M.TinyModelSpec(**SPEC)
    chunks, model, opt, sched = build(spec, **CFG)
    train_steps(model, opt, sched, spec, M.synthetic_batches(spec, GBS, 2))
    save_checkpoint(ckpt_dir, model, opt, extra={"iteration": 2})


def _load(ckpt_dir):
    from megatron_muon.checkpoint import load_checkpoint

    spec = M.TinyModelSpec(**SPEC)
    chunks, model, opt, sched = build(spec, **CFG)
    extra = load_checkpoint(ckpt_dir, model, opt)
    return dict(
        state=M.gather_canonical_optimizer_state(model, opt), model=M.gather_canonical_state(chunks), extra=extra
    )


def _fixture_tensors(path):
    """Every tensor of the checkpoint ``path``, whole, read by torch DCP in this process."""
    from megatron_muon.megatron_lm.checkpoint_dirs import load_dcp

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megatron_muon.checkpoint.reading import read_dcp_metadata

    metadata = read_dcp_metadata(path).state_dict_metadata
    return load_dcp(path, lambda key: isinstance(metadata[key], TensorStorageMetadata))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,layout", [(2, {}), (2, dict(tp=2))], ids=["DP2", "TP2"])
def test_a_checkpoint_of_the_first_format_loads_bitwise(tmp_path, world, layout):
    ckpt = str(tmp_path / "v1")
    shutil.copytree(FIXTURE, ckpt)
    loaded = run_distributed(_load, world, ckpt, timeout_s=400, **layout)
    raw = _fixture_tensors(ckpt)
    state = M.merge_canonical_states([r["state"] for r in loaded])
    weights = M.merge_canonical_states([r["model"] for r in loaded])
    assert state.keys() == {k for k in raw if k.startswith("optimizer.state.")}
    assert any("second_moment" in k for k in state) and any("exp_avg_sq" in k for k in state)
    for key, value in list(state.items()) + list(weights.items()):
        assert torch.equal(value, raw[key].float()), f"{key} differs from the fixture"
    assert loaded[0]["extra"] == {"iteration": 2}
