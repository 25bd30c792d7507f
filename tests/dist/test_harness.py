"""Acceptance of the CPU/gloo harness (``megatron_muon.testing``) and the extra expert layouts.

* A GQA SwiGLU GPTModel trained with Megatron DDP + Megatron's own DistributedOptimizer
  (AdamW) in the layouts DP2, TP2, DP2xTP2 and PP2 follows the one-rank run: same loss on
  the same global batch at every step, same final parameters (``merge_canonical_states``).
* An MoE model (SequentialMLP experts) with EP2 does the same against one rank.
* ``LegacyGroupedMLP`` (fused legacy storage) and ``TEGroupedMLPStandIn`` (``weight<i>``)
  compute what SequentialMLP computes: same loss, same per-expert gradients, same training
  path, on one rank and with EP2; a Megatron checkpoint saved from the legacy layout
  loads into all three layouts.
* ``run_distributed`` fails fast: a hung rank gives TimeoutError, a raising rank gives
  DistributedTestError with that rank's traceback.
* Importing the package patches nothing.

Ranks are spawned (about 5 s of imports each), so every spawned run here does many checks:
one function trains and returns losses, gradients and canonical state; the one-rank
references are module-scoped fixtures.
"""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import textwrap
import time
from typing import Any, Dict, List, Sequence

import pytest
import torch

from megatron_muon.testing import DistributedTestError, run_distributed
from megatron_muon.testing import models as M

STEPS, GBS, MBS = 3, 4, 1
LOSS_RTOL = 1e-4
# Final parameters after 3 AdamW steps (lr 1e-2) agree across layouts only loosely: the
# layouts sum gradients in different orders (TP partial sums, DP reduce-scatter), and
# AdamW divides each element by its own sqrt(v), so an fp32 rounding difference in a
# near-zero gradient element becomes a visible update difference in that element (seen:
# up to 5e-5 in ~20 of 32768 elements of linear_fc1 at TP2, 6e-6 relative Frobenius).
# So each tensor must match to 1e-3 in every element (a tenth of one step's largest move,
# lr) and to 1e-4 in relative Frobenius norm: a wrong shard or a missed update moves
# whole rows by ~lr, and even one such row of 256 is ~1e-2 relative.
PARAM_ATOL = 1e-3
PARAM_FRO_RTOL = 1e-4
MOE = dict(kind="moe")
OTHER_EXPERT_LAYOUTS = ("legacy_grouped", "te_grouped")
ALL_EXPERT_LAYOUTS = ("sequential", *OTHER_EXPERT_LAYOUTS)


# ---------------------------------------------------------------------------------------
# Spawned functions (module level: ranks import them by name)
# ---------------------------------------------------------------------------------------


def _expert_grads(chunks: List[torch.nn.Module]) -> Dict[tuple, torch.Tensor]:
    """``{(experts module name, 'fc1'|'fc2', global expert): (out, in) gradient}``."""
    from megatron.core import parallel_state

    from megatron_muon.testing.experts import local_expert_matrices

    out = {}
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if name.endswith("mlp.experts"):
                for which, mats in local_expert_matrices(module, grads=True).items():
                    for e, g in enumerate(mats):
                        out[(name, which, ep_rank * len(mats) + e)] = g.detach().float().clone()
    return out


def _train(spec_kwargs: Dict[str, Any], layouts: Sequence[str] = ("sequential",)) -> Dict[str, dict]:
    """For each expert layout: canonical init, gradients of the first batch, then STEPS
    AdamW steps. Returns per layout the losses, the first-batch expert gradients, the
    canonical state after training and the parameter names."""
    out = {}
    for layout in layouts:
        spec = M.TinyModelSpec(**spec_kwargs, expert_layout=layout)
        config = M.transformer_config(spec)
        chunks = M.build_model_chunks(spec, config)
        M.canonical_init_(chunks, seed=7)
        model = M.wrap_ddp(chunks, config)
        optimizer = M.megatron_adam_optimizer(model)
        # One global batch, repeated: the loss must fall, so a no-op optimizer cannot
        # pass the comparisons by doing nothing in every layout.
        batches = M.synthetic_batches(spec, GBS, 1, seed=1) * STEPS
        M.forward_backward(model, batches[0], MBS, spec)
        grads = _expert_grads(chunks)
        losses, oks = [], []
        for batch in batches:
            loss, ok = M.train_step(model, optimizer, batch, MBS, spec)
            losses.append(loss)
            oks.append(ok)
        out[layout] = dict(
            losses=losses,
            ok=all(oks),
            grads=grads,
            state=M.gather_canonical_state(chunks),
            names=[n for c in chunks for n, _ in c.named_parameters()],
            attrs={
                n: (p.allreduce, p.tensor_model_parallel, p.partition_dim)
                for c in chunks
                for n, p in c.named_parameters()
                if ".experts." in n
            },
        )
    return out


def _moe_reference_and_checkpoint(ckpt_dir: str) -> Dict[str, dict]:
    """One rank: every expert layout trained (SwiGLU and plain GeLU experts), and a
    checkpoint of the legacy layout loaded into every layout (the canonical state each
    one ends up with)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    out = _train(MOE, ALL_EXPERT_LAYOUTS)
    out["no_glu"] = _train(dict(MOE, swiglu=False), ALL_EXPERT_LAYOUTS)
    spec = M.TinyModelSpec(**MOE, expert_layout="legacy_grouped")
    chunks = M.build_model_chunks(spec)
    M.canonical_init_(chunks, seed=11)
    dist_checkpointing.save(chunks[0].sharded_state_dict(), ckpt_dir)
    loaded = {"saved": M.gather_canonical_state(chunks)}
    for layout in ALL_EXPERT_LAYOUTS:
        target = M.build_model_chunks(M.TinyModelSpec(**MOE, expert_layout=layout))
        state, _, _ = dist_checkpointing.load(
            target[0].sharded_state_dict(), ckpt_dir, strict=StrictHandling.RETURN_ALL
        )
        result = target[0].load_state_dict(state, strict=False)
        # Only the (empty) extra state of Megatron's linear layers may be absent.
        assert all(k.endswith("_extra_state") for k in result.missing_keys), result.missing_keys
        assert not result.unexpected_keys, result.unexpected_keys
        loaded[layout] = M.gather_canonical_state(target)
    out["checkpoint"] = loaded
    return out


def _hang() -> None:
    """Rank 1 never returns; rank 0 waits in a collective that rank 1 never joins."""
    if torch.distributed.get_rank() == 1:
        time.sleep(3600)
    torch.distributed.barrier()


def _crash_in_native_code_on_last_rank() -> int:
    """The last rank dies of a segmentation fault, as a crash inside a native library
    (gloo, a kernel) would kill it."""
    import ctypes
    import resource

    if torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
        # No core file: where core dumps are on, one would land in the working directory.
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    torch.distributed.barrier()
    return 0


def _raise_on_last_rank() -> int:
    rank = torch.distributed.get_rank()
    if rank == torch.distributed.get_world_size() - 1:
        raise ValueError(f"deliberate failure on rank {rank}")
    return rank


def _die_by_signal_on_last_rank() -> int:
    """The last rank is killed by a signal (a crash in native code looks like this); the
    others then fail in their next collective, on a reset connection."""
    import os
    import signal

    if torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    torch.distributed.barrier()
    return 0


# ---------------------------------------------------------------------------------------
# Comparisons
# ---------------------------------------------------------------------------------------


def _rank_environment() -> tuple:
    """What a rank sees of the caller's environment and of the CPU patches."""
    import os

    return os.environ.get("MEGATRON_MUON_PROBE"), torch.cuda.current_device(), torch.distributed.get_rank()


def _assert_losses_close(losses: List[float], ref: List[float], what: str) -> None:
    assert len(losses) == len(ref) == STEPS
    for step, (a, b) in enumerate(zip(losses, ref)):
        assert abs(a - b) <= LOSS_RTOL * abs(b), f"{what}: step {step} loss {a} vs {b}"


def _assert_states_close(full: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor], what: str) -> None:
    assert full.keys() == ref.keys(), f"{what}: keys differ: {sorted(set(full) ^ set(ref))}"
    for key in ref:
        assert full[key].shape == ref[key].shape, f"{what}: {key} shape"
        diff = full[key] - ref[key]
        err = diff.abs().max().item()
        assert err <= PARAM_ATOL, f"{what}: {key} differs by {err:.2e}"
        rel = (diff.norm() / ref[key].norm()).item()
        assert rel <= PARAM_FRO_RTOL, f"{what}: {key} differs by {rel:.2e} (relative Frobenius)"


def _assert_run_matches(per_rank: List[Dict[str, dict]], ref: Dict[str, Any], layout: str, what: str) -> None:
    """One layout of a spawned run against the one-rank reference run ``ref``."""
    results = [r[layout] for r in per_rank]
    assert all(r["ok"] for r in results), f"{what}: an optimizer step was skipped"
    for r in results:  # every rank reports the same (reduced) loss
        _assert_losses_close(r["losses"], ref["losses"], what)
    full = M.merge_canonical_states([r["state"] for r in results])
    _assert_states_close(full, M.merge_canonical_states([ref["state"]]), what)


def _assert_expert_layouts_match(per_rank: List[Dict[str, dict]], what: str) -> None:
    """Legacy and TE layouts against SequentialMLP within one run: losses, first-batch
    gradients per expert, the whole training path."""
    for layout in OTHER_EXPERT_LAYOUTS:
        for rank, r in enumerate(per_rank):
            seq, other = r["sequential"], r[layout]
            assert other["grads"].keys() == seq["grads"].keys() and seq["grads"], (rank, layout)
            for key, g in seq["grads"].items():
                torch.testing.assert_close(
                    other["grads"][key],
                    g,
                    rtol=1e-5,
                    atol=1e-8,
                    msg=lambda m: f"{what} {layout} {key}: {m}",
                )
            # Same numbers, so only summation order can differ (legacy: x @ W vs F.linear).
            for a, b in zip(other["losses"], seq["losses"]):
                assert abs(a - b) <= 1e-6 * abs(b), f"{what} {layout}: {a} vs {b}"
        full = M.merge_canonical_states([r[layout]["state"] for r in per_rank])
        ref = M.merge_canonical_states([r["sequential"]["state"] for r in per_rank])
        _assert_states_close(full, ref, f"{what} {layout}")


# ---------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dense_reference() -> Dict[str, Any]:
    return run_distributed(_train, 1, dict(kind="gqa"), timeout_s=240)[0]["sequential"]


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory) -> Dict[str, dict]:
    ckpt = tmp_path_factory.mktemp("legacy_ckpt")
    return run_distributed(_moe_reference_and_checkpoint, 1, str(ckpt), timeout_s=240)[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "world,layout",
    [
        pytest.param(2, dict(), id="DP2"),
        pytest.param(2, dict(tp=2), id="TP2"),
        pytest.param(4, dict(tp=2), id="DP2xTP2"),
        pytest.param(2, dict(pp=2), id="PP2"),
    ],
)
def test_dense_layouts_match_one_rank(dense_reference, world, layout):
    assert all(l > 1.0 for l in dense_reference["losses"])  # a real, untrained LM loss
    assert dense_reference["losses"][-1] < dense_reference["losses"][0]  # and it trains
    per_rank = run_distributed(_train, world, dict(kind="gqa"), timeout_s=240, **layout)
    _assert_run_matches(per_rank, dense_reference, "sequential", f"world={world} {layout}")


@pytest.mark.timeout(300)
def test_expert_layouts_on_one_rank(moe_reference):
    seq = moe_reference["sequential"]
    assert seq["losses"][-1] < seq["losses"][0]
    names = {layout: moe_reference[layout]["names"] for layout in ALL_EXPERT_LAYOUTS}
    assert "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight" in names["sequential"]
    assert "decoder.layers.0.mlp.experts.weight1" in names["legacy_grouped"]
    assert "decoder.layers.1.mlp.experts.weight2" in names["legacy_grouped"]
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight3" in names["te_grouped"]
    assert "decoder.layers.1.mlp.experts.linear_fc2.weight0" in names["te_grouped"]
    _assert_expert_layouts_match([moe_reference], "1 rank")
    _assert_expert_layouts_match([moe_reference["no_glu"]], "1 rank, no GLU")
    # Without expert parallelism expert grads reduce with the dense ones (allreduce=True).
    attrs = moe_reference["legacy_grouped"]["attrs"]
    assert attrs["decoder.layers.1.mlp.experts.weight1"] == (True, True, 1)
    assert attrs["decoder.layers.1.mlp.experts.weight2"] == (True, True, 0)
    # A legacy-layout Megatron checkpoint loads into every layout, weight for weight.
    ckpt = moe_reference["checkpoint"]
    saved = M.merge_canonical_states([ckpt["saved"]])
    for layout in ALL_EXPERT_LAYOUTS:
        loaded = M.merge_canonical_states([ckpt[layout]])
        assert loaded.keys() == saved.keys()
        for key in saved:
            assert torch.equal(loaded[key], saved[key]), f"{layout}: {key}"


@pytest.mark.timeout(300)
def test_moe_ep2_matches_one_rank(moe_reference):
    per_rank = run_distributed(_train, 2, MOE, ALL_EXPERT_LAYOUTS, ep=2, timeout_s=240)
    _assert_run_matches(per_rank, moe_reference["sequential"], "sequential", "EP2")
    # Each EP rank holds half the experts, with their gradients equal to one rank's.
    for rank, r in enumerate(per_rank):
        experts = {key[2] for key in r["sequential"]["grads"]}
        assert experts == {2 * rank, 2 * rank + 1}, experts
        for key, g in r["sequential"]["grads"].items():
            ref = moe_reference["sequential"]["grads"][key]
            torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-8)
    _assert_expert_layouts_match(per_rank, "EP2")
    for layout in ALL_EXPERT_LAYOUTS:
        attrs = per_rank[1][layout]["attrs"]
        assert attrs and all(a[0] is False for a in attrs.values()), (layout, attrs)


@pytest.mark.timeout(300)
def test_expert_tensor_parallel_matches_one_rank(moe_reference):
    """Expert TP2 (dense DP2): every layout splits each expert's ffn dim across the two
    ranks (legacy: weight1 by columns, weight2 by rows) and still trains as one rank."""
    per_rank = run_distributed(_train, 2, MOE, ALL_EXPERT_LAYOUTS, etp=2, timeout_s=240)
    for layout in ALL_EXPERT_LAYOUTS:
        _assert_run_matches(per_rank, moe_reference[layout], layout, f"ETP2 {layout}")
    _assert_expert_layouts_match(per_rank, "ETP2")
    attrs = per_rank[0]["legacy_grouped"]["attrs"]
    # Expert TP differs from dense TP, so expert grads reduce over the expert-DP group.
    assert attrs["decoder.layers.0.mlp.experts.weight1"] == (False, True, 1)
    assert attrs["decoder.layers.0.mlp.experts.weight2"] == (False, True, 0)
    te = per_rank[0]["te_grouped"]["attrs"]
    assert te["decoder.layers.0.mlp.experts.linear_fc1.weight0"] == (False, True, 0)
    assert te["decoder.layers.0.mlp.experts.linear_fc2.weight1"] == (False, True, 1)
    seq = per_rank[0]["sequential"]["attrs"]
    assert seq["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"] == (False, True, 0)


@pytest.mark.timeout(120)
def test_hung_rank_times_out():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 did not finish") as info:
        run_distributed(_hang, 2, timeout_s=5)
    assert time.monotonic() - start < 60
    assert "in _hang" in str(info.value), "the report should say where each rank waited"
    assert not multiprocessing.active_children(), "the launcher left ranks running"


@pytest.mark.timeout(120)
def test_raising_rank_reports_its_traceback():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_on_last_rank, 2, timeout_s=90)
    text = str(info.value)
    assert "rank 1 of 2 failed" in text
    assert "Traceback (most recent call last)" in text
    assert "in _raise_on_last_rank" in text
    assert "ValueError: deliberate failure on rank 1" in text


@pytest.mark.timeout(120)
def test_a_rank_killed_by_a_signal_is_named_before_its_peers_errors():
    """The crashed rank is the root cause and is named first, with its signal; the peers'
    errors (a reset connection) follow."""
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_die_by_signal_on_last_rank, 2, timeout_s=90)
    text = str(info.value)
    assert text.startswith("rank 1 of 2 died (signal SIGKILL) without reporting a result"), text[:500]


@pytest.mark.timeout(120)
def test_a_crashed_rank_reports_where_it_died():
    """A rank killed by a crash in native code leaves its Python stacks (faulthandler), and
    the report quotes them: the frame it died in, not only the signal."""
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_crash_in_native_code_on_last_rank, 2, timeout_s=90)
    text = str(info.value)
    assert text.startswith("rank 1 of 2 died (signal SIGSEGV) without reporting a result"), text[:500]
    assert "--- rank 1 was at:" in text and "Segmentation fault" in text, text[:2000]
    assert "in _crash_in_native_code_on_last_rank" in text, text[:2000]


@pytest.mark.timeout(120)
def test_ranks_see_the_callers_environment_now(monkeypatch):
    """Ranks fork from a long-lived forkserver; each must still get the caller's current
    environment (as a spawned rank would) and its own patches, and a second run must too."""
    for value in ("first", "second"):
        monkeypatch.setenv("MEGATRON_MUON_PROBE", value)
        assert run_distributed(_rank_environment, 2) == [(value, "cpu", 0), (value, "cpu", 1)]


_IMPORT_PROBE = textwrap.dedent(
    """
    import torch
    before = {name: getattr(torch.cuda, name, None) for name in (
        "current_device", "device_count", "set_device", "Stream", "Event", "current_stream",
        "stream", "synchronize", "get_rng_state", "set_rng_state", "manual_seed")}
    import megatron_muon
    import megatron_muon.testing
    import megatron_muon.testing.models
    import megatron_muon.testing.experts
    changed = [n for n, v in before.items() if getattr(torch.cuda, n, None) is not v]
    assert not changed, f"torch.cuda patched on import: {changed}"
    assert torch._C._len_torch_function_stack() == 0, "a TorchFunctionMode is active"
    assert not megatron_muon.testing.patches_installed()
    import megatron.core.tensor_parallel.random as tp_random
    assert tp_random._get_cuda_rng_state.__module__ == tp_random.__name__
    print("clean")
    """
)


@pytest.mark.timeout(120)
def test_import_has_no_side_effects():
    proc = subprocess.run([sys.executable, "-c", _IMPORT_PROBE], capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("clean"), proc.stderr[-3000:]
