"""Checkpoint conversion (Megatron AdamW <-> Muon), inspection, atomic saves and clear
errors, on real Megatron-core checkpoints (CPU, gloo)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megatron_muon.testing import run_distributed
from megatron_muon.testing import models as M
from tests.test_optimizer import GBS, MBS, build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = dict(kind="gqa")
FULLY_RESHARDABLE = {"distrib_optim_sharding_type": "fully_reshardable"}


def _megatron_adam(spec):
    """Megatron's DistributedOptimizer + AdamW with our tests' lr (param groups, which
    Megatron matches by their settings, then line up with converted checkpoints)."""
    from tests.test_optimizer import BASE_CFG

    chunks = M.build_model_chunks(spec)
    M.canonical_init_(chunks, seed=0)
    model = M.wrap_ddp(chunks, chunks[0].config)
    opt = M.megatron_adam_optimizer(
        model, lr=BASE_CFG["lr"], min_lr=BASE_CFG["min_lr"], weight_decay=BASE_CFG["weight_decay"]
    )
    return chunks, model, opt


def _save_megatron_adam(path):
    """Megatron's own DistributedOptimizer + AdamW, 2 steps, saved fully reshardable."""
    from megatron.core import dist_checkpointing

    from megatron_muon.matrices import unwrap

    spec = M.TinyModelSpec(**SPEC)
    chunks, model, opt = _megatron_adam(spec)
    for tokens in M.synthetic_batches(spec, GBS, 2):
        M.train_step(model, opt, tokens, MBS, spec)
    model_sd = {"model0": unwrap(model[0]).sharded_state_dict()}
    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(
        {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, metadata=FULLY_RESHARDABLE)}, path
    )
    return M.gather_canonical_state(chunks)


def _load_muon_and_train(path):
    from megatron_muon.checkpoint import load_checkpoint

    spec = M.TinyModelSpec(**SPEC)
    chunks, model, opt, sched = build(spec)
    load_checkpoint(path, model, opt)
    weights = M.gather_canonical_state(chunks)
    losses = []
    for tokens in M.synthetic_batches(spec, GBS, 3, seed=1):
        loss, ok = M.train_step(model, opt, tokens, MBS, spec)
        assert ok
        losses.append(loss)
    return dict(weights=weights, losses=losses, state=M.gather_canonical_optimizer_state(model, opt))


def _save_muon(path):
    from megatron_muon.checkpoint import save_checkpoint

    spec = M.TinyModelSpec(**SPEC)
    chunks, model, opt, sched = build(spec)
    for tokens in M.synthetic_batches(spec, GBS, 2):
        M.train_step(model, opt, tokens, MBS, spec)
    save_checkpoint(path, model, opt, extra={"iteration": 2})
    return M.gather_canonical_state(chunks)


def _load_megatron_adam_and_train(path):
    """Megatron-LM's own load path for its distributed optimizer."""
    from megatron.core import dist_checkpointing

    from megatron_muon.matrices import unwrap

    spec = M.TinyModelSpec(**SPEC)
    chunks, model, opt = _megatron_adam(spec)
    # Megatron's DistributedOptimizer with plain torch AdamW (no transformer-engine/Apex)
    # cannot build a loading state dict before its first step (its state_dict() asserts
    # on the missing 'step'); Megatron's own remedy, used by its FSDP path, is this.
    for sub in opt.chained_optimizers:
        sub._init_optimizer_states_with_dummy_values()
    model_sd = {"model0": unwrap(model[0]).sharded_state_dict()}
    state = {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=True, metadata=FULLY_RESHARDABLE)}
    loaded = dist_checkpointing.load(state, path)
    unwrap(model[0]).load_state_dict(loaded["model"]["model0"])
    opt.load_state_dict(loaded["optimizer"])
    weights = M.gather_canonical_state(chunks)
    losses = [M.train_step(model, opt, t, MBS, spec)[0] for t in M.synthetic_batches(spec, GBS, 3, seed=1)]
    return dict(weights=weights, losses=losses)


def _same(a, b):
    a, b = M.merge_canonical_states(a), M.merge_canonical_states(b)
    return all(torch.equal(a[k], b[k]) for k in a)


def convert(*args) -> str:
    """Run tools/convert_checkpoint.py as a user would; returns its stdout."""
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"), *args],
        capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.timeout(600)
def test_adam_to_muon_and_back(tmp_path):
    adam_ckpt, muon_ckpt = str(tmp_path / "adam"), str(tmp_path / "muon")
    weights = run_distributed(_save_megatron_adam, 2, adam_ckpt)
    stats = convert("adam-to-muon", adam_ckpt, muon_ckpt, "--momentum", "exp_avg")
    assert "'step': 2" in stats and "'muon_matrices': 4" in stats
    assert "optimizer: muon" in convert("inspect", muon_ckpt)
    # Loads into a different layout (TP2) and trains; weights are the AdamW run's.
    ranks = run_distributed(_load_muon_and_train, 2, muon_ckpt, tp=2)
    assert _same(weights, [r["weights"] for r in ranks])
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in ranks)

    # And back: our own checkpoint becomes one Megatron's optimizer loads and trains from.
    ours, adam_again = str(tmp_path / "ours"), str(tmp_path / "adam_again")
    weights = run_distributed(_save_muon, 2, ours)
    assert "exp_avg_sq of 4 former Muon matrices is zero" in convert("muon-to-adam", ours, adam_again, "--exp-avg", "momentum")
    assert "fully_reshardable" in convert("inspect", adam_again)
    ranks = run_distributed(_load_megatron_adam_and_train, 2, adam_again)
    assert _same(weights, [r["weights"] for r in ranks])
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in ranks)


def _atomic_and_errors(path):
    """A save that fails midway keeps the previous checkpoint; bad loads say why."""
    import megatron.core.dist_checkpointing as dcp

    from megatron_muon.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    out = {}
    spec = M.TinyModelSpec(**SPEC)
    chunks, model, opt, sched = build(spec)
    M.train_step(model, opt, M.synthetic_batches(spec, GBS, 1)[0], MBS, spec)
    save_checkpoint(path, model, opt, extra={"iteration": 1})
    good = M.gather_canonical_state(chunks)
    M.train_step(model, opt, M.synthetic_batches(spec, GBS, 2)[1], MBS, spec)
    original = dcp.save

    def crash(*args, **kwargs):
        raise OSError("disk full (simulated)")

    dcp.save = crash
    try:
        save_checkpoint(path, model, opt, extra={"iteration": 2})
    except OSError as e:
        out["save_error"] = str(e)
    finally:
        dcp.save = original
    chunks2, model2, opt2, _ = build(spec)
    out["extra"] = load_checkpoint(path, model2, opt2)
    out["previous_intact"] = _same([good], [M.gather_canonical_state(chunks2)])

    other = M.TinyModelSpec(kind="gqa", hidden_size=32, ffn_hidden_size=64)
    chunks3, model3, opt3, _ = build(other)
    try:
        load_checkpoint(path, model3, opt3)
    except CheckpointError as e:
        out["mismatch"] = str(e)
    chunks4, model4, opt4, _ = build(M.TinyModelSpec(kind="gqa", num_layers=1))
    try:
        load_checkpoint(path, model4, opt4)
    except CheckpointError as e:
        out["fewer_layers"] = str(e)
    try:
        load_checkpoint(os.path.join(path, "nope"), model2, opt2)
    except CheckpointError as e:
        out["missing"] = str(e)
    return out


@pytest.mark.timeout(300)
def test_atomic_save_and_clear_errors(tmp_path):
    path = str(tmp_path / "ckpt")
    out = run_distributed(_atomic_and_errors, 2, path)[0]
    assert "disk full" in out["save_error"]
    assert out["extra"] == {"iteration": 1} and out["previous_intact"]
    assert "different model config" in out["mismatch"] or "shape" in out["mismatch"]
    assert "not a checkpoint directory" in out["missing"]
    # Megatron stacks layers into one global tensor per name: fewer layers = other shapes.
    assert "model config differs" in out["fewer_layers"] and "shape mismatch" in out["fewer_layers"]


def _truncate_and_load(path, adam_path):
    from megatron_muon.checkpoint import CheckpointError, load_checkpoint

    out = {}
    spec = M.TinyModelSpec(**SPEC)
    chunks, model, opt, _ = build(spec)
    try:
        load_checkpoint(adam_path, model, opt)
    except CheckpointError as e:
        out["wrong_kind"] = str(e)
    try:
        load_checkpoint(path, model, opt)
    except CheckpointError as e:
        out["truncated"] = str(e)
    return out


@pytest.mark.timeout(300)
def test_wrong_kind_and_truncated(tmp_path):
    path, adam = str(tmp_path / "ckpt"), str(tmp_path / "adam")
    run_distributed(_save_muon, 1, path)
    run_distributed(_save_megatron_adam, 1, adam)
    for name in os.listdir(path):
        if name.endswith(".distcp"):
            full = os.path.join(path, name)
            with open(full, "r+b") as f:
                f.truncate(os.path.getsize(full) // 2)
    out = run_distributed(_truncate_and_load, 1, path, adam)[0]
    assert "adam-to-muon" in out["wrong_kind"]
    assert "loading" in out["truncated"]


def test_inspect_cli_and_experts_cli(tmp_path):
    E, h, f = 2, 4, 3
    w1, w2 = torch.randn(h, E * 2 * f), torch.randn(E * f, h)
    src, seq, back = tmp_path / "legacy.pt", tmp_path / "seq.pt", tmp_path / "back.pt"
    torch.save({"model": {"decoder.layers.0.mlp.experts.weight1": w1, "decoder.layers.0.mlp.experts.weight2": w2}}, src)
    run = [sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py")]
    subprocess.run(run + ["experts", str(src), str(seq), "--to", "sequential", "--num-experts", str(E)], check=True)
    subprocess.run(run + ["experts", str(seq), str(back), "--to", "legacy_grouped"], check=True)
    restored = torch.load(back)["model"]
    assert torch.equal(restored["decoder.layers.0.mlp.experts.weight1"], w1)
    assert torch.equal(restored["decoder.layers.0.mlp.experts.weight2"], w2)
    bad = subprocess.run(run + ["inspect", str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode == 2 and "error:" in bad.stderr
