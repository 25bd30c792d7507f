"""bf16 / fp16 models with fp32 masters (also offloaded to the CPU), one optimizer step at
a time against the single-process reference (``megatron_muon.reference.ReferenceMuon``).

The reference only takes fp32 parameters, so it cannot train the mixed-precision model
itself. Instead, each step hands it exactly what our optimizer starts from, gathered by
this test from Megatron's own structures on every rank, and compares what comes out:

* in: the full reduced fp32 gradient of every parameter (all-gathered from each rank's
  reduce-scattered shard of the DDP grad buffer, divided by the fp16 loss scale) and the
  full fp32 masters before the step (assembled from Megatron's master shards and param
  range maps); they go into an fp32 twin of the model that the reference steps (built
  fresh from the same spec: a deepcopy of the DDP-wrapped model would carry DDP's
  ``main_grad`` views, which the reference reads before ``.grad``);
* out: the update ``master_after - master_before`` of every parameter, Megatron's grad
  norm (before clipping), the Muon momentum and the AdamW moments, against the
  reference's; and the bf16/fp16 model params equal to the masters cast down (after the
  parameter all-gather), the masters equal to the upcast params before the first step.

The reference's own state (momentum, AdamW moments) runs on independently over the steps;
its params are reset to our masters before each step, so every step compares one update
from the same start. The fp16 case runs Megatron's dynamic loss scaler with the loss
scaled in backward as Megatron-LM does (``forward_backward(..., optimizer=opt)`` sets
``config.grad_scale_func``); the test checks the scale was really in the gradients.

Each layout is one spawned run with every precision case in it (starting ranks is slow).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import pytest
import torch

from megatron_muon.testing import run_distributed
from megatron_muon.testing import models as M
from tests.helpers.training import GBS, MASTER_OFFLOAD, MBS, build, muon_config

STEPS = 3
"""Steps per case: the tolerance holds over all of them (the momentum carries over)."""
TOL = 1e-5
"""Relative error allowed on updates, grad norms and optimizer state (fp32 rounding of
two implementations, e.g. batched against one-at-a-time Newton–Schulz products)."""
FP16_SCALER = dict(initial_loss_scale=2.0**12, hysteresis=1)
"""Megatron's dynamic scaler, at a scale that leaves the tiny model's fp16 grads finite."""
CASES = {
    "bf16": (dict(bf16=True), {}),
    "bf16-masters-offloaded": (dict(bf16=True), MASTER_OFFLOAD),
    "fp16": (dict(fp16=True), FP16_SCALER),
    "fp16-masters-offloaded": (dict(fp16=True), dict(FP16_SCALER, **MASTER_OFFLOAD)),
}
"""name -> (model precision, optimizer settings beyond tests.helpers.training.BASE_CFG)."""


# ---------------------------------------------------------------------------------------
# Full tensors from Megatron's sharded structures (TP1: a rank's param is the whole param)
# ---------------------------------------------------------------------------------------


def _ddp_buffers(model) -> list:
    """Every DDP grad buffer (dense and expert-parallel) of every chunk, in the same order
    on every rank of a buffer's data-parallel group (so the collectives below pair up)."""
    return [b for chunk in model for b in chunk.buffers + chunk.expert_parallel_buffers]


def _reduced_grads(model) -> Dict[torch.nn.Parameter, torch.Tensor]:
    """The full reduced fp32 gradient of every param: after DDP's reduce-scatter each rank
    holds the reduced values only in its own shard of every bucket (Megatron cuts each
    bucket into dp equal shards); all-gathering the shards gives the whole bucket."""
    import torch.distributed as dist
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    out = {}
    for buffer in _ddp_buffers(model):
        group = buffer.data_parallel_group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        for bucket in buffer.buckets:
            mine = shard_buffer(bucket.grad_data, size)[rank]
            shards = [torch.empty_like(mine) for _ in range(size)]
            dist.all_gather(shards, mine.contiguous(), group=group)
            full = torch.cat(shards)
            for param, (start, end) in bucket.param_to_index.items():
                out[param] = full[start:end].view(param.shape).float().clone()
    return out


def _master_pieces(opt, read: Callable) -> Dict[torch.nn.Parameter, Tuple[int, int, torch.Tensor]]:
    """This rank's piece of something kept per fp32 master shard (``read(optimizer,
    master)``), with its flat range in the model param, from Megatron's own groups and
    range maps; the offloaded masters are their CPU views, read where they live."""
    out = {}
    for o in opt.muon_optimizers:
        engine = o.storage.engine  # Megatron's DistributedOptimizer, held by the DDP storage
        pairs = list(zip(engine.model_float16_groups, engine.shard_fp32_from_float16_groups))
        pairs += list(zip(engine.model_fp32_groups, engine.shard_fp32_groups))
        for models, mains in pairs:
            for param, main in zip(models, mains):
                rng = engine._get_model_param_range_map(param)["param"]
                out[param] = (rng.start, rng.end, read(o, main))
    return out


def _assemble(model, pieces: Dict[torch.nn.Parameter, Tuple[int, int, torch.Tensor]]) -> Dict[torch.nn.Parameter, torch.Tensor]:
    """Full fp32 tensors from every rank's pieces: summed over each buffer's data-parallel
    group (adding zeros is exact), with a count that proves each element came exactly once.
    Params no rank has a piece of (a state key their optimizer does not keep) are left out."""
    import torch.distributed as dist

    out = {}
    for buffer in _ddp_buffers(model):
        params = list(buffer.param_index_map)
        sizes = [p.numel() for p in params]
        flat, count = torch.zeros(sum(sizes)), torch.zeros(sum(sizes))
        offset = 0
        for param, numel in zip(params, sizes):
            if param in pieces:
                start, end, value = pieces[param]
                flat[offset + start : offset + end] = value.detach().reshape(-1).float().cpu()
                count[offset + start : offset + end] += 1
            offset += numel
        dist.all_reduce(flat, group=buffer.data_parallel_group)
        dist.all_reduce(count, group=buffer.data_parallel_group)
        for param, value, seen in zip(params, flat.split(sizes), count.split(sizes)):
            if bool((seen == 1).all()):
                out[param] = value.view(param.shape)
            else:
                assert not bool(seen.any()), "the ranks' master shards do not partition a param"
    return out


def _full_masters(model, opt) -> Dict[torch.nn.Parameter, torch.Tensor]:
    return _assemble(model, _master_pieces(opt, lambda o, main: main))


def _full_state(model, opt, key: str) -> Dict[torch.nn.Parameter, torch.Tensor]:
    """One inner-optimizer state tensor (the momentum or an AdamW moment) of every param
    whose optimizer keeps it."""
    pieces = _master_pieces(opt, lambda o, main: o.optimizer.state[main].get(key))
    return _assemble(model, {p: v for p, v in pieces.items() if v[2] is not None})


# ---------------------------------------------------------------------------------------
# The reference, on an fp32 twin of the model
# ---------------------------------------------------------------------------------------


def _reference(spec_kwargs: dict, cfg):
    """An fp32 twin of the model (same spec, same parallel layout, so the same names and
    local experts) and ``ReferenceMuon`` over it, with our optimizer's hyper-parameters."""
    from megatron_muon.testing.reference import ReferenceMuon

    twin = M.build_model_chunks(M.TinyModelSpec(**spec_kwargs))[0]
    return twin, ReferenceMuon([twin], cfg)


@torch.no_grad()
def _feed(twin, names, masters, grads, scale: float) -> None:
    """Set the twin's params to our masters and its ``.grad`` to our unscaled gradients
    (the scale is a power of two: dividing is exactly Megatron's multiply by 1/scale)."""
    params = dict(twin.named_parameters())
    for param, name in names.items():
        params[name].copy_(masters[param])
        params[name].grad = grads[param] / scale


def _rel(ours: torch.Tensor, ref: torch.Tensor) -> Tuple[float, float]:
    """(Frobenius, elementwise-max) relative error of ``ours`` against ``ref``."""
    diff = ours - ref
    fro = float(diff.norm() / ref.norm().clamp_min(1e-30))
    peak = float(diff.abs().max() / ref.abs().max().clamp_min(1e-30))
    return fro, peak


def _worst(errors: Dict[str, Tuple[float, float]]) -> dict:
    fro_key = max(errors, key=lambda k: errors[k][0])
    max_key = max(errors, key=lambda k: errors[k][1])
    return dict(fro=(errors[fro_key][0], fro_key), max=(errors[max_key][1], max_key))


# ---------------------------------------------------------------------------------------
# One case, in every rank
# ---------------------------------------------------------------------------------------


STATE_KEYS = ("momentum_buffer", "exp_avg", "exp_avg_sq")
"""The per-element optimizer state both keep: Muon's momentum, AdamW's moments."""


def _state_errors(model, opt, ref, names) -> Dict[str, Tuple[float, float]]:
    """Our momentum and AdamW moments against the reference's, for every param (each
    keeps the momentum or both moments). Without clipping, a gradient of the wrong scale
    (say, not unscaled) shows here although the update hides it: Newton–Schulz and AdamW
    are nearly blind to the gradient's scale. With clipping active, the clipped gradient
    hides it too, and only the grad norm shows it."""
    ours = {key: _full_state(model, opt, key) for key in STATE_KEYS}
    errors = {}
    for param, name in names.items():
        keys = [key for key in STATE_KEYS if key in ref.state[name]]
        assert keys, f"the reference keeps no state for {name}"
        for key in keys:
            assert param in ours[key], f"our optimizer keeps no {key} for {name}"
            errors[f"{key}:{name}"] = _rel(ours[key][param], ref.state[name][key])
    return errors


def _step_against_reference(model, opt, spec, tokens, names, twin, ref) -> dict:
    """Forward/backward, then our step and the reference's from the same masters and grads."""
    for chunk in model:
        chunk.zero_grad_buffer()
    opt.zero_grad()
    M.forward_backward(model, tokens, MBS, spec, optimizer=opt)
    scale = float(opt.get_loss_scale())
    grads = _reduced_grads(model)
    before = _full_masters(model, opt)
    upcast_equal = all(torch.equal(before[p], p.detach().float()) for p in names)
    _feed(twin, names, before, grads, scale)
    ok, grad_norm, _ = opt.step()
    ref_norm = ref.step()
    after = _full_masters(model, opt)
    ref_params = dict(twin.named_parameters())
    updates = {n: _rel(after[p] - before[p], ref_params[n].detach() - before[p]) for p, n in names.items()}
    state = _state_errors(model, opt, ref, names)
    return dict(
        ok=bool(ok),
        scale=scale,
        raw_grad_norm=float(torch.stack([g.norm() for g in grads.values()]).norm()),
        grad_norm=(float(grad_norm), ref_norm),
        upcast_equal=upcast_equal,
        cast_down_equal=all(torch.equal(p.detach(), after[p].to(p.dtype)) for p in names),
        update=_worst(updates),
        state=_worst(state),
    )


def _offload_facts(opt) -> dict:
    masters = [o.masters_offload for o in opt.muon_optimizers]
    return dict(offloaded=all(m is not None for m in masters), in_pool=all(m.in_pool() for m in masters if m is not None))


def _run_case(spec_kwargs: dict, precision: dict, overrides: dict, steps: int) -> dict:
    spec = M.TinyModelSpec(**spec_kwargs, **precision)
    chunks, model, opt, _ = build(spec, **overrides)
    twin, ref = _reference(spec_kwargs, muon_config(M.TinyModelSpec(**spec_kwargs), **overrides))
    names = {p: n for n, p in chunks[0].named_parameters()}
    batches = M.synthetic_batches(spec, GBS, steps, seed=11)
    return dict(
        steps=[_step_against_reference(model, opt, spec, tokens, names, twin, ref) for tokens in batches],
        offload=_offload_facts(opt),
        dtypes={str(p.dtype) for p in names},
        scalers=[type(o.grad_scaler).__name__ for o in opt.muon_optimizers],
    )


def _all_cases(spec_kwargs: dict, cases: dict, cfg: dict, steps: int) -> dict:
    return {name: _run_case(spec_kwargs, precision, dict(cfg, **overrides), steps)
            for name, (precision, overrides) in cases.items()}


# ---------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------


def _check(results: List[dict], whole_model_norm: bool) -> None:
    for rank, cases in enumerate(results):
        for name, case in cases.items():
            assert case["offload"]["offloaded"] == name.endswith("masters-offloaded"), (name, case["offload"])
            assert case["offload"]["in_pool"], name
            half = "torch.float16" if name.startswith("fp16") else "torch.bfloat16"
            assert half in case["dtypes"] and case["dtypes"] <= {half, "torch.float32"}, case["dtypes"]
            for i, step in enumerate(case["steps"]):
                where = f"rank {rank}, {name}, step {i}"
                assert step["ok"], f"{where}: the step was skipped"
                assert step["cast_down_equal"], f"{where}: model params are not the masters cast down"
                if i == 0:
                    assert step["upcast_equal"], f"{where}: masters before the first step are not the upcast params"
                for part in ("update", "state"):
                    for norm in ("fro", "max"):
                        err, key = step[part][norm]
                        assert err <= TOL, f"{where}: {part} of {key} differs from the reference by {err:.2e} ({norm})"
                ours, theirs = step["grad_norm"]
                if whole_model_norm:
                    assert abs(ours - theirs) <= TOL * theirs, f"{where}: grad norm {ours} vs reference {theirs}"
        fp16, bf16 = cases["fp16"]["steps"][0], cases["bf16"]["steps"][0]
        for name in ("fp16", "fp16-masters-offloaded"):
            scalers, scale = cases[name]["scalers"], cases[name]["steps"][0]["scale"]
            assert scalers == ["DynamicGradScaler"] * len(scalers) and scale == FP16_SCALER["initial_loss_scale"], name
        assert bf16["scale"] == 1.0
        # The loss scale was in the backward: the fp16 buffer grads are scale x the bf16 ones
        # (same weights up to rounding, same batch).
        ratio = fp16["raw_grad_norm"] / (fp16["scale"] * bf16["raw_grad_norm"])
        assert 0.95 < ratio < 1.05, f"fp16 grads are {ratio:.3g} x scale x the bf16 grads"


def _report(results: List[dict], layout: str) -> None:
    """Print rank 0's worst errors per case (over steps), with the param they are on."""
    for name, case in results[0].items():
        line = [f"{layout} {name}:"]
        for part in ("update", "state"):
            for norm in ("fro", "max"):
                err, key = max((s[part][norm] for s in case["steps"]), key=lambda x: x[0])
                line.append(f"{part} {norm} {err:.2e} ({key})")
        print("\n" + " ".join(line))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mixed_precision_steps_equal_reference_dp2():
    """DP2, dense GQA, clipping on: bf16, bf16 with the masters on the CPU, fp16 + scaler
    (also with the masters on the CPU: the step rounds them to fp16 on the device)."""
    results = run_distributed(_all_cases, 2, dict(kind="gqa"), CASES, {}, STEPS, timeout_s=250)
    _report(results, "DP2")
    _check(results, whole_model_norm=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mixed_precision_steps_equal_reference_dp2_ep2():
    """DP2 x EP2 MoE (expert-parallel optimizer, experts reduced over expert-DP2). The
    reference on each rank sees the dense params and that rank's experts only, so the
    global grad norm is not its norm: clipping is off and the norms are not compared."""
    results = run_distributed(_all_cases, 4, dict(kind="moe"), CASES, dict(clip_grad=0.0), STEPS, timeout_s=250, ep=2)
    _report(results, "DP2xEP2")
    _check(results, whole_model_norm=False)
