"""``muon_step_overlap='forward'``: the step finished during the next forward gives the same
bits as the step finished inside ``optimizer.step()`` ('none'), on real Megatron-core models
under DDP with ``overlap_param_gather`` (CPU, gloo).

One spawned run per layout trains both modes in fp32 and in bf16 for 12 steps, with a
``clip_grad`` that acts on some of them, and compares every loss, grad norm and final
parameter bit for bit; between steps it checks that the step really was left pending (the
model's parameters still the old ones) and that the forward finished it. In the same run a
NaN in one rank's gradient is skipped on every rank with nothing left pending.
"""

from __future__ import annotations

import pytest
import torch

from megatron_muon.testing import models as M
from megatron_muon.testing import run_distributed
from tests.helpers.training import MBS, build

OVERLAP_DDP = dict(overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=3000)
LAYOUT = dict(muon_buffer_layout="megatron", muon_chunk_numel=4096)
"""Small buckets and chunks, so that chunks finish in more than one place of the forward.
(The owner-aligned layout packs a tiny model's matrices into one bucket: its step would
finish in one place.)"""
STEPS = 12
QK = dict(qk_clip=True, qk_clip_threshold=0.04)


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for chunk in model for p in chunk.parameters()])


def _momenta(opt) -> torch.Tensor:
    """Every Muon momentum this rank holds, flat (empty where it holds none)."""
    held = [s["momentum_buffer"].reshape(-1) for o in opt.muon_optimizers for s in o.optimizer.state.values()
            if "momentum_buffer" in s]  # fmt: skip
    return torch.cat([torch.empty(0), *held])


def _train(spec_kwargs: dict, precision: str, mode: str, clip: float, lr: float) -> dict:
    """``mode``: 'none', 'forward' (run from the hooks) or 'side' ('forward' queued on a
    side stream as ``step()`` returns: on the CPU a ``torch.cpu.Stream``, whose events order
    nothing, so the chunks run inside ``step()`` and the hooks only wait)."""
    spec = M.TinyModelSpec(**spec_kwargs, bf16=precision == "bf16")
    overrides = dict(muon_ns_dtype=torch.bfloat16) if precision == "bf16" else {}
    chunks, model, opt, sched = build(
        spec, ddp=OVERLAP_DDP, clip_grad=clip, lr=lr, min_lr=lr, muon_step_overlap="none" if mode == "none" else "forward",
        **LAYOUT, **overrides,
    )  # fmt: skip
    if mode == "side":
        opt.pending.stream = torch.cpu.Stream()
    batches = M.synthetic_batches(spec, 8, STEPS, seed=3)
    losses, norms, deferred = [], [], []
    for tokens in batches:
        for chunk in model:
            chunk.zero_grad_buffer()
        opt.zero_grad()
        loss = M.forward_backward(model, tokens, MBS, spec, optimizer=opt)
        before = _params(model)
        ok, norm, _ = opt.step()
        assert ok
        sched.step(1)
        if mode == "forward":  # chunks pending; a bf16 model's parameters not yet touched (an
            # fp32 model's master shards are views of its parameters: they move as updated)
            untouched = precision == "fp32" or bool(torch.equal(before, _params(model)))
            deferred.append(opt.pending.chunks_left > 0 and untouched)
        if mode == "side":  # queued whole, every unit waiting for the forward to wait for it
            deferred.append(opt.pending.chunks_left == 0 and set(opt.pending.events) == opt.pending.unsynced != set())
        losses.append(loss)
        norms.append(norm)
    order = list(opt.pending.order) if mode != "none" else None  # learned from the last forward
    for chunk in model:  # what Megatron-LM's end of training does
        chunk.start_param_sync(force_sync=True)
    out = dict(losses=losses, norms=norms, deferred=deferred, state=M.gather_canonical_state(chunks))
    if mode == "forward":
        out["finished_by_the_forward"] = _finished_by_the_forward(model, opt, spec, batches[0])
    if mode != "none":
        out["order"] = order
        out["nan"] = _nan_step(model, opt, spec, batches[1])
    return out


def _finished_by_the_forward(model, opt, spec, tokens) -> int:
    """One more step, then a forward pass alone (no sync forced): how many bucket groups'
    syncs ran chunks (0 if anything stays pending)."""
    from megatron_muon.pipeline import StepWork

    for chunk in model:
        chunk.zero_grad_buffer()
    opt.zero_grad()
    M.forward_backward(model, tokens, MBS, spec, optimizer=opt)
    assert opt.step()[0] and opt.pending.active
    drives = []
    run = StepWork.run
    StepWork.run = lambda work, position, indices=None, **kw: (drives.append(indices), run(work, position, indices, **kw))
    try:
        M.forward_backward(model, tokens, MBS, spec, forward_only=True)
    finally:
        StepWork.run = run
    return 0 if opt.pending.active else len(drives)


def _nan_step(model, opt, spec, tokens) -> dict:
    """A NaN in rank 0's reduced gradient of a Muon matrix: every rank skips, nothing is pending,
    parameters and optimizer state are unchanged."""
    import torch.distributed as dist

    for chunk in model:
        chunk.zero_grad_buffer()
    opt.zero_grad()
    M.forward_backward(model, tokens, MBS, spec, optimizer=opt)
    for chunk in model:  # the last step's parameters everywhere, to compare against
        chunk.start_param_sync(force_sync=True)
    if dist.get_rank() == 0:  # into its own shard of the reduced gradient of a Muon matrix
        shard = next(s for s in (opt.dense.shard_map[mp.param] for mp in opt.dense.muon_params) if s.master is not None)
        shard.param.main_grad.view(-1)[shard.start] = float("nan")
    momentum, before = _momenta(opt), _params(model)
    ok, norm, _ = opt.step()
    return dict(
        ok=ok,
        pending=opt.pending.active,
        unchanged=bool(torch.equal(before, _params(model))) and bool(torch.equal(momentum, _momenta(opt))),
    )


def _both_modes(spec_kwargs: dict, clip: float, lr: float) -> dict:
    return {(p, m): _train(spec_kwargs, p, m, clip, lr) for p in ("fp32", "bf16") for m in ("none", "forward", "side")}


# The clip_grad and learning rate of each: the clip between the grad norms its model
# reaches in 12 steps, so that clipping acts on some steps only; the pipelined model keeps
# its norms at 78-129 with lr 0.005 (at 0.02 they climb to 6,000 in 12 steps).
LAYOUTS = [
    # slow too (34 CPU-s: three modes, two precisions, 12 steps on 4 ranks), so that the
    # not-slow tier stays under 3 minutes on 2 cores; the fast tier keeps the prefetch-order test
    pytest.param(
        4, dict(tp=2), dict(kind="gqa", extra=QK), 1.75, 0.02, id="DP2xTP2-gqa-qkclip", marks=pytest.mark.slow
    ),
    pytest.param(
        4,
        dict(ep=2),
        dict(kind="moe", mla=True, extra=QK),
        1.75,
        0.02,
        id="EP2xDP2-moe-mla-qkclip",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        2, dict(pp=2, vpp=2), dict(kind="gqa", num_layers=4), 95.0, 0.005, id="PP2-VPP2", marks=pytest.mark.slow
    ),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,layout,model,clip,lr", LAYOUTS)
def test_forward_overlap_is_bitwise_the_step(world, layout, model, clip, lr):
    ranks = run_distributed(_both_modes, world, model, clip, lr, timeout_s=580, **layout)
    for r in ranks:
        for precision, mode in [(p, m) for p in ("fp32", "bf16") for m in ("forward", "side")]:
            none, forward = r[(precision, "none")], r[(precision, mode)]
            what = f"{precision} {mode}"
            assert forward["losses"] == none["losses"], (what, forward["losses"], none["losses"])
            assert forward["norms"] == none["norms"], what
            norms = none["norms"]
            assert min(norms) < clip < max(norms), f"{what}: clip_grad {clip} must act on some steps: {norms}"
            assert all(forward["deferred"]), f"{what}: a step was not left pending: {forward['deferred']}"
            for key, pieces in none["state"].items():
                for (region, want), (_, got) in zip(pieces, forward["state"][key]):
                    assert torch.equal(got, want), f"{what}: {key} {region} differs"
            if mode == "forward":  # the chunks finish in more than one place of the forward
                assert forward["finished_by_the_forward"] > 1, (what, forward["finished_by_the_forward"])
            # The side stream's order is the last forward's. DDP keeps a model chunk's bucket
            # groups in backward order, so with more than the dense and the expert unit it is
            # not the units' own order.
            order = forward["order"]
            assert sorted(order) == list(range(len(order))), (what, order)
            assert len(order) <= 2 or order != sorted(order), (what, order)
            nan = forward["nan"]
            assert nan["ok"] is False and not nan["pending"] and nan["unchanged"], (what, nan)


def _param_gathers_waited_for(layout: str) -> dict:
    """One step, then the next forward with DDP's ``overlap_param_gather``: per chain of bucket
    groups (dense, expert), how many groups the forward reached with their all-gather not yet
    started (each a gather waited for, not overlapped), and Megatron's warnings that a group's
    successor had already been started. Also with DDP's own chain (its ``bucket_groups`` list
    reversed), as Megatron-core 0.19 links it."""
    import warnings

    spec = M.TinyModelSpec(kind="moe")
    chunks, model, opt, _ = build(spec, ddp=OVERLAP_DDP, muon_buffer_layout=layout, muon_step_overlap="none")
    batches = M.synthetic_batches(spec, 8, 3, seed=3)
    out = {}
    for chain, tokens in (("ours", batches[1]), ("megatron", batches[2])):
        for chunk in model:
            chunk.zero_grad_buffer()
        opt.zero_grad()
        M.forward_backward(model, tokens, MBS, spec, optimizer=opt)
        assert opt.step()[0]
        if chain == "megatron":
            for groups in (model[0].bucket_groups, model[0].expert_parallel_bucket_groups):
                for later, earlier in zip(groups[1:], groups[:-1]):
                    later.next_param_gather_bucket_group = earlier
                if groups:
                    groups[0].next_param_gather_bucket_group = None
        waited = {"dense": 0, "expert": 0}
        for kind, groups in (("dense", model[0].bucket_groups), ("expert", model[0].expert_parallel_bucket_groups)):
            for group in groups:
                finish = group.finish_param_sync

                def counted(*a, _group=group, _finish=finish, _kind=kind, **kw):
                    if not _group.param_gather_dispatched:
                        waited[_kind] += 1
                    return _finish(*a, **kw)

                group.finish_param_sync = counted
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            M.forward_backward(model, batches[0], MBS, spec, forward_only=True)
        for group in model[0].bucket_groups + model[0].expert_parallel_bucket_groups:
            del group.finish_param_sync
        dispatched = sum("has already been dispatched" in str(w.message) for w in caught)
        out[chain] = dict(waited=waited, warned=dispatched, groups=len(model[0].bucket_groups))
    return out


@pytest.mark.parametrize("layout", ["owner_aligned", "megatron"])
def test_each_param_gather_is_started_before_the_forward_needs_it(layout):
    """The owner-aligned layout's separate Muon buffer: DDP's chain (its list order) left the
    Muon buffer's first all-gather unstarted until the forward needed it and warned that the
    next one had "already been dispatched"; chained in the forward's order
    (``buffer_layout.prefetch_param_gathers_in_forward_order``) only each chain's first is
    waited for and nothing warns. On Megatron's layout (one dense buffer) the chain is DDP's
    own. EP2 MoE: dense and expert chains. (With buckets that cut a layer, DDP itself waits
    where the forward's order is not the registration order: an attention's linear_proj is
    registered before its linear_qkv; Megatron's chain, with AdamW too.)"""
    ranks = run_distributed(_param_gathers_waited_for, 2, layout, ep=2, timeout_s=300)
    for r in ranks:
        if layout == "owner_aligned":  # ours, and what DDP's chain did on our buffers
            assert r["ours"]["waited"] == {"dense": 1, "expert": 1} and r["ours"]["warned"] == 0, r
            assert r["megatron"]["waited"]["dense"] > 1 and r["megatron"]["warned"] > 0, r
        else:  # one dense buffer: DDP's own chain, unchanged
            assert r["megatron"] == r["ours"] and r["ours"]["groups"] > 2, r
