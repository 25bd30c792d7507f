"""Fault injection: nothing is lost.

* inf/NaN gradients, injected before the data-parallel reduction (into one rank's full
  gradient) and after it (into one rank's own shard), in a Muon matrix, an expert matrix
  and an AdamW parameter, in fp32, bf16 and fp16: the step is skipped on every rank with
  parameters, fp32 masters, momentum and AdamW moments bitwise unchanged; too many skips in
  a row raise, naming the parameter (issue 13, reproduction 2);
* early, one-line errors for invalid settings (reproduction 6); the harness applies the
  fp16 loss scale (reproduction 8);
* checkpoints: flipped bits, truncated and missing files fail on every rank naming the
  file (reproduction 3); a re-save killed between its renames still loads (reproduction 4).

Each spawned run checks many cases (starting ranks is slow).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from megatron_muon.testing import run_distributed
from megatron_muon.testing import models as M
from tests.helpers.training import GBS, MBS, MASTER_OFFLOAD, build

PRECISIONS = {"fp32": ({}, {}), "bf16": (dict(bf16=True), {}), "fp16": (dict(fp16=True), {}),
              "bf16-offload": (dict(bf16=True), MASTER_OFFLOAD)}
"""name -> (model precision, optimizer settings beyond it)."""


# ---------------------------------------------------------------------------------------
# Non-finite gradients
# ---------------------------------------------------------------------------------------


def _snapshot(model, opt) -> list:
    """Every tensor a step may change: model params, fp32 masters, optimizer state."""
    out = [p.detach().clone() for chunk in model for p in chunk.parameters()]
    for o in opt.muon_optimizers:
        for group in o.storage.engine.shard_fp32_from_float16_groups + o.storage.engine.shard_fp32_groups:
            out += [t.detach().clone() for t in group]
        for state in o.optimizer.state.values():
            out += [v.clone() for _, v in sorted(state.items()) if torch.is_tensor(v)]
    return out


def _unchanged(before: list, after: list) -> bool:
    return len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))


def _targets(chunks, opt) -> dict:
    """Name -> param of the three kinds of parameter a fault can hit."""
    dense = next(o for o in opt.muon_optimizers if o.name == "dense")
    expert = next(o for o in opt.muon_optimizers if o.name == "expert")
    return {
        "muon": dense.muon_params[0].param,
        "expert": expert.muon_params[0].param,
        "adamw": chunks[0].embedding.word_embeddings.weight,
    }


def _shard_start(opt, param) -> int:
    for o in opt.muon_optimizers:
        if param in o.shard_map and o.shard_map[param].master is not None:
            return o.shard_map[param].start
    return -1


def _faulty_step(model, opt, spec, tokens, param, where: str, value: float, poison_rank: int):
    """Forward/backward with ``value`` injected into ``param``'s gradient on one rank,
    ``before`` the DDP reduction (a tensor hook on the full gradient) or ``after`` it
    (into that rank's own shard of the reduced gradient); then ``optimizer.step()``."""
    import torch.distributed as dist

    rank = dist.get_rank()
    for chunk in model:
        chunk.zero_grad_buffer()
    opt.zero_grad()
    handle = None
    if where == "before" and rank == poison_rank:

        def poison(grad):
            grad = grad.clone()
            grad.view(-1)[-1] = value
            return grad

        handle = param.register_hook(poison)
    M.forward_backward(model, tokens, MBS, spec, optimizer=opt)
    if handle is not None:
        handle.remove()
    if where == "after" and rank == poison_rank:
        start = _shard_start(opt, param)
        assert start >= 0, "the poisoned rank must own a piece of the parameter"
        param.main_grad.view(-1)[start] = value
    return opt.step()


def _non_finite_run():
    """In every rank (2 ranks, EP2: dense DP2, experts one per rank)."""
    import torch.distributed as dist

    from megatron_muon.non_finite import NonFiniteGradientError

    out = {"cases": {}}
    for precision, (flags, settings) in PRECISIONS.items():
        spec = M.TinyModelSpec(kind="moe", **flags)
        scaler = dict(initial_loss_scale=2.0**10, hysteresis=1) if precision == "fp16" else {}
        chunks, model, opt, sched = build(spec, **scaler, **settings)
        batches = M.synthetic_batches(spec, GBS, 3, seed=7)
        assert M.train_step(model, opt, batches[0], MBS, spec)[1]  # state exists
        targets = _targets(chunks, opt)
        for target, param in targets.items():
            for where in ("before", "after"):
                value = float("nan") if where == "before" else float("inf")
                poison_rank = 1
                if where == "after":  # must hit a rank that owns a piece of the param
                    owners = [None, None]
                    dist.all_gather_object(owners, _shard_start(opt, param) >= 0)
                    poison_rank = max(r for r, owns in enumerate(owners) if owns)
                before = _snapshot(model, opt)
                scale = opt.get_loss_scale().item()
                ok, norm, _ = _faulty_step(model, opt, spec, batches[1], param, where, value, poison_rank)
                out["cases"][(precision, target, where)] = dict(
                    ok=ok, norm=norm, unchanged=_unchanged(before, _snapshot(model, opt)),
                    scale=(scale, opt.get_loss_scale().item()),
                    scales=[o.get_loss_scale().item() for o in opt.muon_optimizers],
                )
        out[(precision, "skipped_steps")] = opt.skips.skipped_steps
        out[(precision, "masters_offloaded")] = all(o.masters_offload is not None for o in opt.muon_optimizers)
        loss, ok = M.train_step(model, opt, batches[2], MBS, spec)
        out[(precision, "recovers")] = ok and math.isfinite(loss)

        # N consecutive skips raise on every rank, naming the parameter.
        limit = 3
        extra = dict(initial_loss_scale=4.0, min_loss_scale=1.0, hysteresis=1) if precision == "fp16" else {}
        chunks, model, opt, sched = build(spec, muon_max_consecutive_skipped_steps=limit, **extra, **settings)
        param = _targets(chunks, opt)["muon"]
        name = next(n for n, p in chunks[0].named_parameters() if p is param)
        attempts, error = 0, None
        try:
            for _ in range(limit + 3):
                attempts += 1
                _faulty_step(model, opt, spec, batches[1], param, "before", float("nan"), 0)
        except NonFiniteGradientError as e:
            error = str(e)
        out[(precision, "raise")] = dict(attempts=attempts, error=error, name=name)
    return out


@pytest.mark.timeout(600)
def test_non_finite_gradients_skip_everywhere_and_raise():
    ranks = run_distributed(_non_finite_run, 2, ep=2, timeout_s=580)
    for r in ranks:
        for case, result in r["cases"].items():
            assert result["ok"] is False, f"{case}: the step must be skipped on every rank"
            assert result["norm"] is None, case
            assert result["unchanged"], f"{case}: params, masters or optimizer state changed"
            before, after = result["scale"]
            assert set(result["scales"]) == {after}, f"{case}: dense and expert loss scales differ"
            if case[0] == "fp16":
                assert after == before / 2, f"{case}: the loss scaler must back off"
            else:
                assert after == before == 1.0
        for precision in PRECISIONS:
            assert r[(precision, "skipped_steps")] == 6
            assert r[(precision, "masters_offloaded")] == (precision == "bf16-offload")
            assert r[(precision, "recovers")], f"{precision}: training must go on after a skip"
            raised = r[(precision, "raise")]
            assert raised["error"] is not None, f"{precision}: {raised['attempts']} skips did not raise"
            assert raised["name"] in raised["error"], raised["error"]
            assert "muon_max_consecutive_skipped_steps" in raised["error"]
            # fp16: the skips at scales 4 and 2 are the loss scaler's own work (not counted).
            assert raised["attempts"] == (4 if precision == "fp16" else 3), (precision, raised)


# ---------------------------------------------------------------------------------------
# Early errors (reproduction 6) and the harness's fp16 loss scale (reproduction 8)
# ---------------------------------------------------------------------------------------

BAD_CONFIGS = [
    (dict(muon_extra_scale_factor=float("nan")), "muon_extra_scale_factor=nan"),
    (dict(muon_extra_scale_factor=0.0), "muon_extra_scale_factor=0.0"),
    (dict(fp16=True, bf16=True), "fp16=True and bf16=True"),
    (dict(muon_momentum=-0.1), "muon_momentum=-0.1"),
    (dict(muon_num_ns_steps=0), "muon_num_ns_steps=0"),
    (dict(muon_chunk_numel=-5), "muon_chunk_numel=-5"),
    (dict(muon_max_consecutive_skipped_steps=-1), "muon_max_consecutive_skipped_steps=-1"),
    (dict(muon_tp_mode="exactly"), "muon_tp_mode='exactly'"),
    (dict(muon_coefficient_type="cubic"), "muon_coefficient_type='cubic'"),
    (dict(lr=float("inf")), "lr=inf"),
    (dict(weight_decay=-0.1), "weight_decay=-0.1"),
    (dict(muon_exclude_patterns="*.weight"), "muon_exclude_patterns='*.weight'"),
    (dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0), "optimizer_cpu_offload=True needs muon_cpu_offload"),
    (dict(optimizer_cpu_offload=True, muon_cpu_offload=True, optimizer_offload_fraction=0.5),
     "optimizer_offload_fraction=0.5"),
]


@pytest.mark.parametrize("kwargs,field", BAD_CONFIGS, ids=[f for _, f in BAD_CONFIGS])
def test_invalid_config_is_one_line_naming_the_field(kwargs, field):
    from megatron_muon import MuonConfig

    with pytest.raises(ValueError) as info:
        MuonConfig(**dict(dict(lr=0.01), **kwargs))
    message = str(info.value)
    assert field in message and "\n" not in message, message


def test_experts_not_divisible_by_expert_parallel_size_is_named():
    import types

    from megatron_muon.layer_specs import gpt_block_spec

    config = types.SimpleNamespace(num_moe_experts=3, expert_model_parallel_size=2)
    with pytest.raises(ValueError, match="num_moe_experts=3 is not divisible by expert_model_parallel_size=2"):
        gpt_block_spec(config, None)


def _early_errors_and_loss_scale():
    """In every rank (2 ranks, EP2)."""
    from megatron_muon import get_muon_optimizer
    from tests.helpers.training import muon_config

    out = {}
    # EP2 with 3 experts: our message, not Megatron's empty AssertionError.
    try:
        M.build_model_chunks(M.TinyModelSpec(kind="moe", num_moe_experts=3))
    except ValueError as e:
        out["experts"] = str(e)
    # An fp16 model with a non-fp16 optimizer config would get no loss scaler.
    spec = M.TinyModelSpec(kind="moe", fp16=True)
    chunks = M.build_model_chunks(spec)
    model = M.wrap_ddp(chunks, chunks[0].config)
    try:
        get_muon_optimizer(muon_config(M.TinyModelSpec(kind="moe")), model)
    except ValueError as e:
        out["precision"] = str(e)
    # The harness multiplies the loss by the loss scale (Megatron's grad_scale_func) and
    # refuses an fp16 backward without it: the fp16 grad norm (after the optimizer unscales)
    # must match the fp32 one, not be 1/scale of it.
    norms = {}
    for precision, flags in (("fp32", {}), ("fp16", dict(fp16=True))):
        spec = M.TinyModelSpec(kind="moe", **flags)
        chunks, model, opt, _ = build(spec, initial_loss_scale=2.0**10, clip_grad=0.0)
        tokens = M.synthetic_batches(spec, GBS, 1, seed=11)[0]
        if precision == "fp16":
            try:
                M.forward_backward(model, tokens, MBS, spec)
            except ValueError as e:
                out["unscaled_fp16_backward"] = str(e)
        M.forward_backward(model, tokens, MBS, spec, optimizer=opt)
        ok, norms[precision], _ = opt.step()
        assert ok
    out["norms"] = norms
    return out


@pytest.mark.timeout(300)
def test_early_errors_and_fp16_loss_scale_in_the_harness():
    ranks = run_distributed(_early_errors_and_loss_scale, 2, ep=2, timeout_s=280)
    for r in ranks:
        assert "num_moe_experts=3" in r["experts"] and "expert_model_parallel_size=2" in r["experts"]
        assert "TransformerConfig.fp16=True" in r["precision"] and "MuonConfig(fp16=True)" in r["precision"]
        assert "optimizer=" in r["unscaled_fp16_backward"]
        fp32, fp16 = r["norms"]["fp32"], r["norms"]["fp16"]
        # fp16 rounding of activations and gradients: a few percent; a missing loss scale
        # would make the fp16 norm 1/1024 of the fp32 one.
        assert abs(fp16 - fp32) <= 0.05 * fp32, r["norms"]


# ---------------------------------------------------------------------------------------
# Checkpoints: corruption is named on every rank (reproduction 3); an interrupted re-save
# leaves the last good checkpoint loadable (reproduction 4)
# ---------------------------------------------------------------------------------------


def _flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def _attempt_load(ckpt, spec) -> str:
    from megatron_muon.checkpoint import load_checkpoint
    from megatron_muon.checkpoint.integrity import CheckpointIntegrityError

    chunks, model, opt, _ = build(spec)
    try:
        load_checkpoint(ckpt, model, opt)
    except CheckpointIntegrityError as e:
        return str(e)
    return "loaded"


def _corrupted_checkpoints(ckpt):
    """In every rank (2 ranks, TP2): save; then flip a bit in a tensor, truncate a file,
    delete a file, delete the manifest; every load attempt must fail on every rank."""
    import json
    import os
    import shutil

    import torch.distributed as dist

    from megatron_muon.checkpoint import save_checkpoint
    from megatron_muon.checkpoint.integrity import MANIFEST

    spec = M.TinyModelSpec(kind="gqa")
    chunks, model, opt, sched = build(spec)
    assert M.train_step(model, opt, M.synthetic_batches(spec, GBS, 1)[0], MBS, spec)[1]
    save_checkpoint(ckpt, model, opt)
    pristine = ckpt + ".pristine"
    out = {"clean": _attempt_load(ckpt, spec)}
    if dist.get_rank() == 0:
        shutil.copytree(ckpt, pristine)
        with open(os.path.join(ckpt, MANIFEST)) as f:
            manifest = json.load(f)
        # The largest stored item (a tensor), a byte in its middle.
        name, items = max(manifest["items"].items(), key=lambda kv: max(i[1] for i in kv[1]))
        offset, length, _, label = max(items, key=lambda i: i[1])
        out["target"] = (name, label)
    out["target"] = [out.get("target")]
    dist.broadcast_object_list(out["target"], src=0)
    name, label = out["target"][0]

    def corrupt(action):
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(ckpt)
            shutil.copytree(pristine, ckpt)
            action(os.path.join(ckpt, name))
        dist.barrier()
        return _attempt_load(ckpt, spec)

    out["bit_flip"] = corrupt(lambda path: _flip_byte(path, offset + length // 2))
    out["truncated"] = corrupt(lambda path: os.truncate(path, os.path.getsize(path) // 2))
    out["missing"] = corrupt(os.remove)
    out["no_manifest"] = corrupt(lambda path: os.remove(os.path.join(ckpt, MANIFEST)))
    return out


@pytest.mark.timeout(300)
def test_corrupted_checkpoint_fails_on_every_rank_naming_file_and_tensor(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    ranks = run_distributed(_corrupted_checkpoints, 2, ckpt, tp=2, timeout_s=280)
    name, label = ranks[0]["target"][0]
    for r in ranks:
        assert r["clean"] == "loaded"
        assert name in r["bit_flip"] and label in r["bit_flip"] and "contents changed" in r["bit_flip"], r["bit_flip"]
        assert name in r["truncated"] and "truncated" in r["truncated"], r["truncated"]
        assert f"{name}: missing" in r["missing"], r["missing"]
        assert "saved with a manifest (megatron_muon.json says so) but integrity.json is missing" in r["no_manifest"], (
            r["no_manifest"]
        )
    # Same message on every rank.
    for key in ("bit_flip", "truncated", "missing", "no_manifest"):
        assert ranks[0][key] == ranks[1][key]


class _Killed(BaseException):
    """Stands in for SIGKILL at one point of a save (nothing after it runs)."""


def _killed_resave(ckpt):
    """In one rank: save A; train; re-save into the same directory, killed right after the
    previous checkpoint was moved aside. Loading must give A back, bit for bit; the next
    save must succeed and clean up."""
    import os
    from unittest import mock

    from megatron_muon.checkpoint import load_checkpoint, save_checkpoint

    spec = M.TinyModelSpec(kind="gqa")
    batches = M.synthetic_batches(spec, GBS, 3)
    chunks, model, opt, sched = build(spec)
    assert M.train_step(model, opt, batches[0], MBS, spec)[1]
    save_checkpoint(ckpt, model, opt, extra={"iteration": 1})
    saved = M.gather_canonical_optimizer_state(model, opt)
    assert M.train_step(model, opt, batches[1], MBS, spec)[1]

    real_rename = os.rename

    def rename_then_die(src, dst):
        real_rename(src, dst)
        if str(src) == ckpt:  # the swap's first rename (the writers rename their own files)
            raise _Killed()

    out = {}
    # The two-rename swap of filesystems that cannot exchange directories atomically.
    with mock.patch("os.rename", side_effect=rename_then_die), mock.patch(
        "megatron_muon.checkpoint.publish._exchange", return_value=False
    ):
        try:
            save_checkpoint(ckpt, model, opt, extra={"iteration": 2})
        except _Killed:
            out["killed"] = True
    out["on_disk"] = sorted(p for p in os.listdir(os.path.dirname(ckpt)))
    chunks2, model2, opt2, _ = build(spec)
    out["extra"] = load_checkpoint(ckpt, model2, opt2)
    loaded = M.gather_canonical_optimizer_state(model2, opt2)
    merged_saved, merged_loaded = M.merge_canonical_states([saved]), M.merge_canonical_states([loaded])
    out["equal"] = merged_saved.keys() == merged_loaded.keys() and all(
        torch.equal(merged_saved[k], merged_loaded[k]) for k in merged_saved
    )
    save_checkpoint(ckpt, model, opt, extra={"iteration": 2})
    out["after_next_save"] = sorted(os.listdir(os.path.dirname(ckpt)))
    out["extra_next"] = load_checkpoint(ckpt, model2, opt2)
    return out


@pytest.mark.timeout(300)
def test_resave_killed_between_renames_loads_the_last_good_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    (r,) = run_distributed(_killed_resave, 1, ckpt, timeout_s=280)
    assert r["killed"]
    assert r["on_disk"] == ["ckpt.old", "ckpt.tmp"], r["on_disk"]  # no ckpt: the window
    assert r["extra"] == {"iteration": 1} and r["equal"]
    assert r["after_next_save"] == ["ckpt"]
    assert r["extra_next"] == {"iteration": 2}


# ---------------------------------------------------------------------------------------
# Inside Megatron-LM: its own save_checkpoint / load_checkpoint, with use_megatron_muon()
# ---------------------------------------------------------------------------------------


def _tree(root) -> dict:
    """Every file under ``root``: relative path -> contents."""
    import os

    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(dirpath, name), "rb") as f:
                out[os.path.relpath(os.path.join(dirpath, name), root)] = f.read()
    return out


def _megatron_lm_checkpoints(ckpt_root):
    """In every rank (2 ranks, DP2), Megatron-LM's own save_checkpoint / load_checkpoint with
    use_megatron_muon(): each save goes through a staging directory and carries the record
    and the manifest; a save of the iteration just saved is not repeated; a save killed
    while hashing, or a re-save killed before its swap, leaves the tracker and the previous
    copy byte-identical; loading refuses another vocabulary padding, a deleted manifest and
    a flipped byte (every rank, the same message), and an empty tracker resumes from the
    newest iteration that verifies."""
    import io
    import os
    from contextlib import redirect_stdout
    from unittest import mock

    import megatron.training.arguments as arguments
    import megatron.training.checkpointing as checkpointing
    import megatron.training.training as training
    import torch.distributed as dist
    from megatron.training import global_vars

    from megatron_muon.checkpoint import CheckpointError
    from megatron_muon.checkpoint.integrity import MANIFEST, RECORD, CheckpointIntegrityError
    from megatron_muon.checkpoint import publish
    from megatron_muon.checkpoint.save_lock import LOCK
    from megatron_muon.megatron_lm import integration as I
    from tests.helpers.megatron_lm import ARGV, parse_and_validate

    I.use_megatron_muon()
    args = parse_and_validate(arguments, ARGV + ["--save", ckpt_root, "--load", ckpt_root, "--save-interval", "1"])
    global_vars.set_args(args)
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

    init_num_microbatches_calculator(dist.get_rank(), None, args.global_batch_size, args.micro_batch_size,
                                     args.data_parallel_size)
    spec = M.TinyModelSpec()
    args.padded_vocab_size = spec.vocab_size  # what Megatron-LM sets once the tokenizer is built
    chunks = M.build_model_chunks(spec)
    M.canonical_init_(chunks, seed=0)
    model = training.wrap_model_chunks_with_ddp(
        chunks, chunks[0].config, training.get_megatron_ddp_config(args),
        use_layer_wise_distributed_optimizer=args.use_layer_wise_distributed_optimizer)
    config, overrides = training.get_megatron_optimizer_config(args)
    opt = training.get_megatron_optimizer(config, model, config_overrides=overrides)
    batches = M.synthetic_batches(spec, 4, 3)
    assert M.train_step(model, opt, batches[0], 1, spec)[1]
    tracker = checkpointing.get_checkpoint_tracker_filename(ckpt_root)

    def tracked() -> str:
        with open(tracker) as f:
            return f.read().strip()

    def save(iteration):
        said = io.StringIO()
        with redirect_stdout(said):
            checkpointing.save_checkpoint(iteration, model, opt, None, 0)
        dist.barrier()
        return said.getvalue()

    out = {}
    save(1)
    first = checkpointing.get_checkpoint_name(ckpt_root, 1, return_base_dir=True)
    out["manifest_files"] = sorted(json.load(open(os.path.join(first, MANIFEST)))["files"])
    out["after_save"] = sorted(set(os.listdir(ckpt_root)) - {LOCK})  # the job's lock on its --save stays
    out["tracker_after_save"] = tracked()
    saved_1 = _tree(first)

    # The same iteration again, no step since (the rerun state machine's save when it stops).
    out["again_said"] = save(1)
    out["again_unchanged"] = _tree(first) == saved_1

    # A save that dies while the manifest is written: the tracker stays on iteration 1.
    assert M.train_step(model, opt, batches[1], 1, spec)[1]
    with mock.patch.object(publish, "write_manifest", side_effect=_Killed()):
        try:
            save(2)
        except _Killed:
            out["killed"] = True
    dist.barrier()
    out["tracker_after_killed_save"] = tracked()

    # A re-save of iteration 1 with other state (as after --ckpt-step), killed just before
    # its swap: iteration 1 byte-identical; then completed: replaced, and it verifies.
    checkpointing.dist_checkpointing._guards.current = None

    real_verify = publish.verify_manifest

    def verify_then_die(*a, **kw):  # every rank, after the new copy verified, before the swap
        real_verify(*a, **kw)
        raise _Killed()

    with mock.patch.object(publish, "verify_manifest", verify_then_die):
        try:
            save(1)
        except _Killed:
            out["resave_killed"] = True
    dist.barrier()
    out["resave_killed_kept"] = _tree(first) == saved_1
    save(1)
    out["resave_replaced"] = _tree(first) != saved_1 and RECORD in _tree(first)

    # An asynchronous save: the manifest comes with the finalize steps, after the writes.
    from megatron.core.utils import unwrap_model

    from megatron_muon.checkpoint.integrity import has_manifest, verify_manifest

    async_dir = os.path.join(ckpt_root, "async")
    dist.barrier()
    request = checkpointing.dist_checkpointing.save(
        {"model": unwrap_model(model)[0].sharded_state_dict()}, async_dir, async_sharded_save=True,
        async_strategy="mcore")
    out["async_manifest_before_writes"] = has_manifest(async_dir)
    request.execute_sync()
    verify_manifest(async_dir)
    out["async_manifest_after"] = has_manifest(async_dir)

    def attempt_load() -> str:
        said = io.StringIO()
        try:
            with redirect_stdout(said):
                return f"loaded {checkpointing.load_checkpoint(model, opt, None)[0]}: {said.getvalue()}"
        except (CheckpointError, CheckpointIntegrityError) as e:
            return str(e)

    out["clean"] = attempt_load()
    args.padded_vocab_size += 64
    out["vocabulary"] = attempt_load()
    args.padded_vocab_size -= 64
    if dist.get_rank() == 0:
        with open(tracker, "w"):
            pass  # what Megatron-LM's open-with-truncate left when killed
    dist.barrier()
    out["empty_tracker"] = attempt_load()
    if dist.get_rank() == 0:
        with open(tracker, "w") as f:
            f.write("1")
        os.rename(os.path.join(first, MANIFEST), os.path.join(ckpt_root, "moved"))
    dist.barrier()
    out["no_manifest"] = attempt_load()
    if dist.get_rank() == 0:
        os.rename(os.path.join(ckpt_root, "moved"), os.path.join(first, MANIFEST))
        name = "__1_0.distcp"
        _flip_byte(os.path.join(first, name), os.path.getsize(os.path.join(first, name)) // 2)
    dist.barrier()
    out["corrupt"] = attempt_load()
    return out


@pytest.mark.timeout(300)
def test_megatron_lm_save_and_load_checkpoint_carry_the_manifest(tmp_path):
    pytest.importorskip("megatron.training")
    ranks = run_distributed(_megatron_lm_checkpoints, 2, str(tmp_path / "ckpts"), timeout_s=280)
    for r in ranks:
        assert "__0_0.distcp" in r["manifest_files"] and "megatron_muon.json" in r["manifest_files"]
        assert r["after_save"] == ["iter_0000001", "latest_checkpointed_iteration.txt"], r["after_save"]
        assert r["tracker_after_save"] == "1" and r["again_unchanged"]
        assert r["killed"] and r["tracker_after_killed_save"] == "1"
        assert r["resave_killed"] and r["resave_killed_kept"] and r["resave_replaced"]
        assert not r["async_manifest_before_writes"] and r["async_manifest_after"]
        assert r["clean"].startswith("loaded 1"), r["clean"]
        assert "padded to" in r["vocabulary"] and "--make-vocab-size-divisible-by" in r["vocabulary"], r["vocabulary"]
        assert r["empty_tracker"].startswith("loaded 1"), r["empty_tracker"]
        assert "saved with a manifest" in r["no_manifest"], r["no_manifest"]
        assert "__1_0.distcp: contents changed" in r["corrupt"], r["corrupt"]
    assert "already holds this iteration" in ranks[0]["again_said"]
    assert "resuming from iter_0000001, the newest iteration that verifies" in ranks[0]["empty_tracker"]
    assert ranks[0]["corrupt"] == ranks[1]["corrupt"]


# ---------------------------------------------------------------------------------------
# Fewer query groups than TP ranks (reproduction 5): the QKV split gathers K and V from the
# TP ranks that hold them, equal to the single-process reference
# ---------------------------------------------------------------------------------------

ONE_KV_GROUP = dict(kind="gqa", num_query_groups=1)
QKV_VARIANTS = {
    "part": {},
    "head": dict(muon_qkv_granularity="head"),
    "duplicated": dict(muon_tp_mode="duplicated", muon_qkv_granularity="group"),
}


def _qkv_references():
    from tests.helpers.training import reference

    return reference(ONE_KV_GROUP, {"part": {}, "head": dict(muon_qkv_granularity="head"),
                                    "duplicated": dict(muon_qkv_granularity="group")})


@pytest.mark.timeout(400)
def test_qkv_split_with_fewer_query_groups_than_tp_ranks_equals_reference():
    from tests.helpers.training import max_rel_err, train

    ref = run_distributed(_qkv_references, 1, timeout_s=300)[0]
    results = run_distributed(train, 2, ONE_KV_GROUP, QKV_VARIANTS, timeout_s=380, tp=2)
    for name in QKV_VARIANTS:
        full = M.merge_canonical_states([r[name]["state"] for r in results])
        ref_state = M.merge_canonical_states([ref[name][1]])
        err, key = max_rel_err(full, ref_state, "fro")
        assert err <= 1e-5, f"{name}: {key} differs from the reference by {err:.2e}"
        qkv = {k: v for k, v in ref_state.items() if "linear_qkv.weight" in k}
        err, key = max_rel_err(full, qkv, "max")
        assert err <= 1e-5, f"{name}: {key} differs from the reference by {err:.2e}"
    computed = results[0]["part"]["computed"] + results[1]["part"]["computed"]
    # One K and one V matrix, gathered from TP rank 1 (which holds all of them); Q from both.
    assert sorted(n.rsplit("[", 1)[1] for n in computed if "layers.0.self_attention.linear_qkv" in n) == [
        "k]", "q]", "v]"]


# ---------------------------------------------------------------------------------------
# The manifest on one process: per-item CRCs across read blocks, the command line
# ---------------------------------------------------------------------------------------


def test_item_checksums_do_not_depend_on_read_blocks(tmp_path, monkeypatch):
    import hashlib
    import os
    import zlib

    from megatron_muon.checkpoint import integrity

    data = os.urandom(1000)
    path = tmp_path / "f.distcp"
    path.write_bytes(data)
    items = [(0, 10, "a"), (10, 333, "b"), (400, 1, "c"), (401, 599, "d")]
    for block in (7, 64, 1 << 20):
        monkeypatch.setattr(integrity, "_BLOCK", block)
        sha, size, crcs = integrity._hash_file(str(path), items)
        assert sha == hashlib.sha256(data).hexdigest() and size == 1000
        assert crcs == [zlib.crc32(data[o:o + n]) for o, n, _ in items], block


def test_integrity_command_line(tmp_path, capsys):
    from megatron_muon.checkpoint import integrity

    (tmp_path / "a.bin").write_bytes(b"0123456789")
    (tmp_path / "b.bin").write_bytes(b"abc")
    assert integrity.main(["verify", str(tmp_path)]) == 1  # no manifest yet
    assert "no integrity.json" in capsys.readouterr().err
    assert integrity.main(["write", str(tmp_path)]) == 0
    assert integrity.main(["verify", str(tmp_path)]) == 0
    (tmp_path / "a.bin").write_bytes(b"0123456788")
    assert integrity.main(["verify", str(tmp_path)]) == 1
    assert "a.bin: contents changed" in capsys.readouterr().err
    # Megatron-core's own verifier reads our manifest.
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.validation import verify_integrity_manifest

    (tmp_path / "a.bin").write_bytes(b"0123456789")
    verify_integrity_manifest(str(tmp_path))
    (tmp_path / "b.bin").unlink()
    with pytest.raises(CheckpointingException, match="b.bin"):
        verify_integrity_manifest(str(tmp_path))
    assert integrity.main(["verify", str(tmp_path / "nope")]) == 2
