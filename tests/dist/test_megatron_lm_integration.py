"""``megatron_muon.megatron_lm.integration``: our optimizer inside Megatron-LM's own training.

The first part needs only argparse and stand-in modules. The second runs Megatron-LM's own
``megatron.training`` (its parser, ``validate_args``, DDP wrapping, optimizer config and the
checkpoint metadata) where it is importable: megatron-core 0.19.2's wheel ships it; a
Megatron-LM checkout on ``PYTHONPATH`` provides it otherwise.
"""

from __future__ import annotations

import argparse
import types

import pytest
import torch

from megatron_muon import MuonConfig
from megatron_muon.megatron_lm import integration as I
from tests.helpers.megatron_lm import ARGV, megatron_functions_of_its_own, parse_and_validate

# ---------------------------------------------------------------------------------------
# Without Megatron-LM: a parser with Megatron-LM's optimizer and --muon-* flags (arguments.py)
# ---------------------------------------------------------------------------------------

MEGATRON_TP_MODES = ["blockwise", "duplicated", "distributed"]


def add_megatron_like_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--optimizer", default="adam", choices=["adam", "sgd", "muon", "dist_muon", "lion"])
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--optimizer-cpu-offload", action="store_true")
    p.add_argument("--use-megatron-fsdp", action="store_true")
    p.add_argument("--use-torch-fsdp2", action="store_true")
    p.add_argument("--data-parallel-sharding-strategy", default="optim_grads_params")
    p.add_argument("--overlap-grad-reduce", action="store_true")
    p.add_argument("--num-distributed-optimizer-instances", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--save", default=None)
    p.add_argument("--ckpt-format", default="torch_dist")
    p.add_argument("--muon-momentum", type=float, default=0.9)
    p.add_argument("--muon-no-split-qkv", action="store_false", default=True, dest="muon_split_qkv")
    p.add_argument("--muon-nesterov", action="store_true")
    p.add_argument("--muon-scale-mode", default="spectral", choices=["spectral", "unit_rms_norm", "shape_scaling"])
    p.add_argument("--muon-coefficient-type", default="quintic")
    p.add_argument("--muon-num-ns-steps", type=int, default=5)
    p.add_argument("--muon-tp-mode", default="blockwise", choices=list(MEGATRON_TP_MODES))
    p.add_argument("--muon-scalar-optimizer", default="adam", choices=["adam", "lion"])
    return p


def megatron_like_parser() -> argparse.ArgumentParser:
    return add_megatron_like_arguments(argparse.ArgumentParser(allow_abbrev=False))


def parse(*argv: str) -> argparse.Namespace:
    return I.add_muon_arguments(megatron_like_parser()).parse_args(list(argv))


def test_given_flags_reach_the_muon_config():
    args = parse("--optimizer", "muon", "--lr", "0.02", "--muon-momentum", "0.9", "--muon-tp-mode", "distributed",
                 "--no-muon-nesterov", "--muon-no-split-qkv", "--muon-ns-dtype", "fp32",
                 "--muon-exclude-patterns", "*.linear_proj.weight")
    cfg = I.muon_config_from_megatron(args)
    assert isinstance(cfg, MuonConfig) and cfg.optimizer == "muon" and cfg.lr == 0.02
    assert cfg.muon_momentum == 0.9  # given, although it is Megatron-LM's default
    assert cfg.muon_tp_mode == "exact"  # Megatron's 'distributed' is exact
    assert cfg.muon_nesterov is False and cfg.muon_split_qkv is False
    assert cfg.muon_ns_dtype == torch.float32 and cfg.muon_exclude_patterns == ("*.linear_proj.weight",)
    assert cfg.muon_scale_mode == "moonlight"  # not given: ours, not Megatron-LM's 'spectral'


def test_megatron_defaults_do_not_override_ours():
    cfg, ours = I.muon_config_from_megatron(parse("--optimizer", "muon")), MuonConfig()
    for name in ("muon_momentum", "muon_nesterov", "muon_tp_mode", "muon_scale_mode", "muon_split_qkv",
                 "muon_coefficient_type", "muon_num_ns_steps", "muon_ns_dtype", "muon_qkv_granularity"):
        assert getattr(cfg, name) == getattr(ours, name), name


def test_our_values_on_megatron_flags_and_idempotence():
    parser = I.add_muon_arguments(I.add_muon_arguments(megatron_like_parser()))  # twice: no clash
    args = parser.parse_args(["--optimizer", "muon", "--muon-tp-mode", "exact", "--muon-scale-mode", "none",
                              "--muon-nesterov", "--muon-impl", "megatron_muon"])
    cfg = I.muon_config_from_megatron(args)
    assert (cfg.muon_tp_mode, cfg.muon_scale_mode, cfg.muon_nesterov) == ("exact", "none", True)
    assert "--muon-impl" in parser.format_help() and args.muon_impl == "megatron_muon"


# Stand-ins for megatron.training.arguments / .training with the functions we patch.


def standin_modules():
    arguments, training = types.ModuleType("arguments"), types.ModuleType("training")
    calls = []

    def validate_args(args, defaults={}):
        # What Megatron-LM does to an emerging optimizer (arguments.py:1670-1682).
        args.use_layer_wise_distributed_optimizer = False
        if args.optimizer not in ("sgd", "adam") and args.use_distributed_optimizer:
            args.use_layer_wise_distributed_optimizer, args.use_distributed_optimizer = True, False
        args.params_dtype = torch.float32
        calls.append(("validate", args.optimizer))
        arguments._print_args("arguments", args)  # as Megatron-LM's validate_args ends
        return args

    def get_megatron_optimizer(config, model_chunks, config_overrides=None, use_gloo_process_groups=True,
                               pg_collection=None, dump_param_to_param_group_map=None):
        calls.append(("megatron", config.optimizer))
        return "megatron's"

    def clip_qk(model, log_max_only=False):
        calls.append(("megatron clip_qk", log_max_only))
        return 0

    training.clip_qk = clip_qk
    arguments.add_megatron_arguments, arguments.validate_args = add_megatron_like_arguments, validate_args
    arguments._print_args = lambda title, args: calls.append(("print", args.optimizer))
    training.get_megatron_optimizer = get_megatron_optimizer
    training.get_args = lambda: training.args
    return arguments, training, calls


def standin_parse(arguments, *argv):
    return arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_args(list(argv))


def test_patches_install_route_and_uninstall(monkeypatch):
    from megatron.core.optimizer import OptimizerConfig

    arguments, training, calls = standin_modules()
    originals = (arguments.add_megatron_arguments, arguments.validate_args, training.get_megatron_optimizer,
                 training.clip_qk)
    undo = I.use_megatron_muon(arguments, training)
    assert training.clip_qk([]) == 0 and calls[-1] == ("megatron clip_qk", False)  # nothing of ours built yet
    assert I.use_megatron_muon(arguments, training) is undo  # installed once
    assert all(getattr(f, "__megatron_muon_undo__", None) is undo for f in
               (arguments.add_megatron_arguments, arguments.validate_args, training.get_megatron_optimizer))
    built = {}
    ours = types.SimpleNamespace(qk_clip=object(), max_attention_logit=12.5)
    monkeypatch.setattr(I, "get_muon_optimizer", lambda cfg, chunks, **kw: built.update(cfg=cfg, **kw) or ours)

    args = standin_parse(arguments, "--optimizer", "muon", "--use-distributed-optimizer", "--lr", "0.1")
    arguments.validate_args(args)  # validated as the DistributedOptimizer, printed as muon
    assert calls[-2:] == [("validate", "adam"), ("print", "muon")]
    assert args.optimizer == "muon" and args.use_distributed_optimizer
    assert not args.use_layer_wise_distributed_optimizer
    training.args = args
    config = OptimizerConfig(optimizer="muon", lr=0.1, use_distributed_optimizer=True)
    opt = training.get_megatron_optimizer(config, [], config_overrides={"k": 1}, use_gloo_process_groups=False)
    assert opt is ours
    # Megatron-LM's train_step calls clip_qk after our step: ours already clipped; report only.
    n_calls = len(calls)
    assert training.clip_qk([], log_max_only=False) == 12.5 and len(calls) == n_calls
    assert built["cfg"].lr == 0.1 and built["cfg"].muon_tp_mode == "exact"
    assert built["config_overrides"] == {"k": 1} and built["use_gloo_process_groups"] is False
    with pytest.raises(ValueError, match="--dump-param-to-param-group-map"):
        training.get_megatron_optimizer(config, [], None, True, None, "map.json")

    # Anything else is Megatron's.
    training.args = standin_parse(arguments, "--optimizer", "adam")
    assert training.get_megatron_optimizer(OptimizerConfig(optimizer="adam"), []) == "megatron's"
    training.args = args = standin_parse(arguments, "--optimizer", "muon", "--muon-impl", "megatron",
                                         "--use-distributed-optimizer", "--bf16")
    arguments.validate_args(args)
    assert args.use_layer_wise_distributed_optimizer  # Megatron's own Muon, untouched
    assert training.get_megatron_optimizer(config, []) == "megatron's"
    training.get_args = lambda: (_ for _ in ()).throw(AssertionError("args is not initialized."))
    assert training.get_megatron_optimizer(config, []) == "megatron's"  # no Megatron-LM arguments: theirs

    undo()
    assert (arguments.add_megatron_arguments, arguments.validate_args, training.get_megatron_optimizer,
            training.clip_qk) == originals
    assert not hasattr(standin_parse(arguments), "muon_impl")


@pytest.mark.parametrize("argv,match", [
    (["--optimizer", "muon"], "--use-distributed-optimizer"),
    (["--optimizer", "dist_muon", "--use-distributed-optimizer"], "dist_muon is deprecated"),
    (["--optimizer", "muon", "--use-distributed-optimizer", "--optimizer-cpu-offload"], "--muon-cpu-offload"),
    (["--optimizer", "muon", "--use-distributed-optimizer", "--use-torch-fsdp2"], "use --use-megatron-fsdp"),
    (["--optimizer", "muon", "--use-distributed-optimizer", "--use-megatron-fsdp", "--data-parallel-sharding-strategy",
      "no_shard"], "'no_shard' is not supported"),
    (["--optimizer", "muon", "--use-distributed-optimizer", "--use-megatron-fsdp", "--data-parallel-sharding-strategy",
      "optim"], "--overlap-grad-reduce"),
    (["--optimizer", "muon", "--use-distributed-optimizer", "--use-megatron-fsdp", "--pipeline-model-parallel-size",
      "2"], "--pipeline-model-parallel-size 1"),
    (["--optimizer", "muon", "--use-distributed-optimizer", "--save", "d", "--ckpt-format", "torch"],
     "--ckpt-format torch_dist"),
    (["--optimizer", "muon", "--use-distributed-optimizer", "--muon-scalar-optimizer", "lion"],
     "muon_scalar_optimizer='lion'"),
    (["--optimizer", "muon", "--muon-impl", "megatron", "--bf16", "--muon-tp-mode", "exact"], "--muon-tp-mode exact"),
    (["--optimizer", "muon", "--muon-impl", "megatron"], "runs only with --bf16"),
])
def test_unsupported_combinations_name_the_flag(argv, match):
    arguments, training, _ = standin_modules()
    I.use_megatron_muon(arguments, training)
    with pytest.raises(ValueError, match=match):
        arguments.validate_args(standin_parse(arguments, *argv))


# ---------------------------------------------------------------------------------------
# With Megatron-LM's megatron.training
# ---------------------------------------------------------------------------------------

@pytest.fixture
def megatron_lm():
    pytest.importorskip("megatron.training", reason="Megatron-LM's megatron.training is not importable: no "
                        "Megatron-LM checkout on PYTHONPATH, and this megatron-core wheel does not ship it")
    import megatron.training.arguments as arguments
    import megatron.training.training as training

    with megatron_functions_of_its_own():  # whatever layers an earlier test left in this worker
        undo = I.use_megatron_muon()
        yield arguments, training
        undo()


def test_model_config_path_ddp_is_wrapped_and_restored():
    """``build_distributed_models`` looks ``DistributedDataParallel`` up in ``dist_utils`` at call
    time: installed, it is our layout-choosing constructor; undone, Megatron's class again."""
    pytest.importorskip("megatron.training")
    import megatron.training.models.dist_utils as dist_utils
    from megatron.core.distributed import DistributedDataParallel

    undo = I.use_megatron_muon()
    try:
        assert dist_utils.DistributedDataParallel.__wrapped__ is DistributedDataParallel
    finally:
        undo()
    assert dist_utils.DistributedDataParallel is DistributedDataParallel


def test_megatron_lm_parser_and_validation(megatron_lm):
    arguments, training = megatron_lm
    args = parse_and_validate(arguments, ARGV + ["--muon-tp-mode", "distributed", "--no-muon-nesterov"])
    assert (args.optimizer, args.use_distributed_optimizer, args.use_layer_wise_distributed_optimizer) == (
        "muon", True, False)
    config, overrides = training.get_megatron_optimizer_config(args)
    cfg = I.with_optimizer_config(I.muon_config_from_megatron(args), config)
    assert (cfg.lr, cfg.muon_tp_mode, cfg.muon_nesterov, cfg.muon_momentum) == (0.02, "exact", False, 0.95)
    assert training.get_megatron_optimizer.__megatron_muon_undo__ is not None
    with pytest.raises(ValueError, match="--use-distributed-optimizer"):
        parse_and_validate(arguments, [a for a in ARGV if a != "--use-distributed-optimizer"])
    # Megatron-LM's Adam offload line (it asserts --use-precision-aware-optimizer) + ours
    offload = ["--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--muon-cpu-offload"]
    args = parse_and_validate(arguments, ARGV + offload)
    config, _ = training.get_megatron_optimizer_config(args)
    cfg = I.with_optimizer_config(I.muon_config_from_megatron(args), config)
    assert (cfg.optimizer_cpu_offload, cfg.optimizer_offload_fraction, cfg.muon_cpu_offload) == (True, 1.0, True)
    assert not cfg.use_precision_aware_optimizer
    with pytest.raises(ValueError, match="optimizer_offload_fraction=0.5"):
        parse_and_validate(arguments, ARGV + offload + ["--optimizer-offload-fraction", "0.5"])


def _max_rel_diff(a: dict, b: dict) -> float:
    """Largest relative difference between two ``gather_canonical_state`` results."""
    assert a.keys() == b.keys()
    return max((x - y).abs().max().item() / max(y.abs().max().item(), 1e-12)
               for k in a for (_, x), (_, y) in zip(a[k], b[k], strict=True))


def _through_megatron_lm(ckpt_dir: str) -> dict:
    """One rank: Megatron-LM's own argument handling, DDP wrapping and optimizer call
    (as in ``setup_model_and_optimizer``) and its checkpoint calls, against our optimizer
    built directly on a plainly wrapped copy of the model."""
    import megatron.training.arguments as arguments
    import megatron.training.checkpointing as checkpointing
    import megatron.training.training as training
    from megatron.core import dist_checkpointing
    from megatron.core.utils import unwrap_model
    from megatron.training import global_vars

    from megatron_muon import get_muon_optimizer
    from megatron_muon.buffer_layout import is_owner_aligned
    from megatron_muon import MuonChainedOptimizer
    from megatron_muon.testing import models as M

    I.use_megatron_muon()
    args = parse_and_validate(arguments, ARGV)
    global_vars.set_args(args)
    # QK-Clip on, with a threshold low enough that heads get clipped every step.
    spec = M.TinyModelSpec(extra=dict(qk_clip=True, qk_clip_threshold=0.04))
    batches = M.synthetic_batches(spec, 4, 3)
    chunks, ref_chunks = M.build_model_chunks(spec), M.build_model_chunks(spec)
    M.canonical_init_(chunks, seed=0)
    M.canonical_init_(ref_chunks, seed=0)
    model = training.wrap_model_chunks_with_ddp(
        chunks, chunks[0].config, training.get_megatron_ddp_config(args),
        use_layer_wise_distributed_optimizer=args.use_layer_wise_distributed_optimizer)
    config, overrides = training.get_megatron_optimizer_config(args)
    opt = training.get_megatron_optimizer(
        config, model, config_overrides=overrides, use_gloo_process_groups=args.use_gloo_process_groups,
        dump_param_to_param_group_map=args.dump_param_to_param_group_map)
    assert isinstance(opt, MuonChainedOptimizer)
    ref_config = I.with_optimizer_config(I.muon_config_from_megatron(args), config)
    ref_model = M.wrap_ddp(ref_chunks, ref_chunks[0].config, muon_config=ref_config)
    ref_opt = get_muon_optimizer(ref_config, ref_model)
    owner_aligned = is_owner_aligned(model)
    initial = M.gather_canonical_state(chunks)
    logged = []
    for tokens in batches[:2]:
        assert M.train_step(model, opt, tokens, 1, spec)[1] and M.train_step(ref_model, ref_opt, tokens, 1, spec)[1]
        # What Megatron-LM's train_step does after optimizer.step() with --qk-clip (training.py:2480).
        logged.append((training.clip_qk(model, log_max_only=False), opt.max_attention_logit))
    moved = _max_rel_diff(M.gather_canonical_state(chunks), initial)
    vs_direct = _max_rel_diff(M.gather_canonical_state(chunks), M.gather_canonical_state(ref_chunks))

    # Megatron-LM's torch_dist calls: sharded state dicts of the unwrapped model (save_checkpoint
    # and load_checkpoint unwrap it, generate_state_dict), load_state_dict on the DDP model.
    metadata = checkpointing._build_sharded_state_dict_metadata(args)
    unwrapped = unwrap_model(model)
    state = {"model": unwrapped[0].sharded_state_dict(metadata=metadata)}
    state["optimizer"] = opt.sharded_state_dict(state, metadata=metadata)
    dist_checkpointing.save(state, ckpt_dir)
    M.train_step(model, opt, batches[2], 1, spec)
    continued = M.gather_canonical_state(chunks)
    state = {"model": unwrapped[0].sharded_state_dict(metadata=metadata)}
    state["optimizer"] = opt.sharded_state_dict(state, metadata=metadata, is_loading=True)
    loaded = dist_checkpointing.load(state, ckpt_dir)
    model[0].load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    steps_after_load = opt.num_steps
    M.train_step(model, opt, batches[2], 1, spec)
    resumed = _max_rel_diff(M.gather_canonical_state(chunks), continued)
    return dict(moved=moved, vs_direct=vs_direct, resumed=resumed, steps_after_load=steps_after_load, logged=logged,
                owner_aligned=owner_aligned)


@pytest.mark.timeout(600)
def test_megatron_lm_builds_trains_and_checkpoints_our_optimizer(megatron_lm, tmp_path):
    from megatron_muon.testing import run_distributed

    results = run_distributed(_through_megatron_lm, 2, str(tmp_path))
    for r in results:
        assert r["moved"] > 1e-3, r
        assert r["owner_aligned"], r  # Megatron-LM's wrap_model_chunks_with_ddp got our buffer layout
        assert r["vs_direct"] < 1e-6, r  # Megatron-LM's DDP wrapping and its clip_qk call change nothing
        assert all(reported == ours > 0.04 for reported, ours in r["logged"]), r["logged"]  # clipped, reported
        assert r["steps_after_load"] == 2 and r["resumed"] < 1e-6, r


def test_undo_then_install_again_validates_once(megatron_lm):
    """The undo of ``use_megatron_muon`` also removes the launch validation stacked on it, so
    installing the driver's layers again validates a QK-Clip recipe. (The undo used to leave
    validate_args wrapped under the launch layer and a second install wrapped it again: the
    launch checks then ran inside our validation, where Megatron-LM sees 'adam', and refused
    the recipe's --qk-clip; a CI run hit it through the docs' DeepSeek-V3 launch line.)"""
    from megatron_muon.megatron_lm import launch

    arguments, training = megatron_lm
    launch.install_argument_layers()
    training.get_megatron_optimizer.__megatron_muon_undo__()
    assert not getattr(arguments.validate_args, "__megatron_muon_launch__", False)
    launch.install_argument_layers()
    args = launch.validated_args(["--recipe", "tiny_moe_mla"])
    assert args.optimizer == "muon" and args.qk_clip


def test_update_rms_is_measured_for_the_logs_that_report_it():
    """A step measures its update RMS when a TensorBoard log reports it: its own iteration's;
    with the step finished in the next forward also the next iteration's log, which reports
    it once the forward has finished it (measuring never finishes a pending step, so the
    overlap holds at every log interval)."""
    whole, pending = types.SimpleNamespace(pending=None), types.SimpleNamespace(pending=object())
    for tensorboard in (1, 3, 5):
        args = types.SimpleNamespace(tensorboard_log_interval=tensorboard, log_interval=1)
        for iteration in range(12):
            logged = (iteration + 1) % tensorboard == 0
            assert I.measure_next_step(args, whole, iteration) == logged
            assert I.measure_next_step(args, pending, iteration) == (logged or (iteration + 2) % tensorboard == 0)
