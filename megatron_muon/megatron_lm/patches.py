"""Every change megatron_muon makes to Megatron-LM's, Megatron-core's and torch's code: the table.

Each row (:class:`~megatron_muon.patching.Patch`) names the attribute replaced, the function
that builds its replacement, why, and what it was checked against; ``tests/unit/test_patches.py``
fails, naming the row and its reason, when the installed Megatron no longer has the target or
its signature (or, where the replacement restates part of it, its source) changed. The rows
are installed in groups, each by one caller, all through :mod:`megatron_muon.patching`:

* :data:`INTEGRATION` and :data:`CHECKPOINTS`, :data:`EXPERT_BIAS`, :data:`WRITER_QUEUE`,
  :data:`READERS`: ``integration.use_megatron_muon`` (any device);
* the ``*_SCOPE`` rows: in force only while one call of ours runs (a listing held back, a
  save's DCP call staged);
* :data:`LAUNCH`: ``launch.install_launch_validation`` (``tools/pretrain_gpt.py``);
* :data:`MTP_LAYERS`: ``layer_spec.install_mtp_layer_spec``, when a run builds our layer spec;
* :data:`~megatron_muon.megatron_fsdp_fix.SINGLE_RANK_GROUPS`, the core's one row (declared
  there): ``fix_gradient_accumulation_on_single_rank_groups()``, which the library user, the
  glue and the harness call before wrapping a model in Megatron-FSDP;
* the ``cpu_only`` rows (:data:`CPU_CORE`, :data:`CPU_INITIALIZATION` and the others): ``cpu.install``
  on a machine without a GPU only; :data:`WHEEL` on any device.

docs/design.md ("Inside Megatron-LM") says where each hooks in.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

from megatron_muon.checkpoint.reading import READERS
from megatron_muon.megatron_fsdp_fix import SINGLE_RANK_GROUPS
from megatron_muon.patching import Patch

MCORE = "megatron-core 0.19.2"
TORCH = "torch 2.11.0"
_I = "megatron_muon.megatron_lm.integration"
_C = "megatron_muon.megatron_lm.checkpoint_guards"
ARGUMENTS = "megatron.training.arguments"
TRAINING = "megatron.training.training"
_CKPT = "megatron.training.checkpointing"
DDP_BUILDER = "megatron.training.models.dist_utils"

INTEGRATION: Tuple[Patch, ...] = (
    Patch(
        ARGUMENTS,
        "add_megatron_arguments",
        f"{_I}:_wrap_add_megatron_arguments",
        "adds --muon-impl and the --muon-* flags Megatron-LM lacks; records which of its own were given",
        MCORE,
    ),
    Patch(
        ARGUMENTS,
        "validate_args",
        f"{_I}:_wrap_validate_args",
        "--optimizer muon is validated as Megatron's DistributedOptimizer ('muon' would select its "
        "LayerWise one), our checks first; builds the run's MuonConfig",
        MCORE,
        stack=3,
    ),
    Patch(
        TRAINING,
        "get_megatron_optimizer",
        f"{_I}:_wrap_get_megatron_optimizer",
        "--optimizer muon --muon-impl megatron_muon builds megatron_muon's optimizer",
        MCORE,
    ),
    Patch(
        TRAINING,
        "clip_qk",
        f"{_I}:_wrap_clip_qk",
        "our step already clipped the fp32 masters: report its max logit instead of clipping the model again",
        MCORE,
    ),
    Patch(
        TRAINING,
        "training_log",
        f"{_I}:_wrap_training_log",
        "Muon's statistics as TensorBoard / W&B scalars; a job's first logged iteration logged as any other",
        MCORE,
    ),
    Patch(
        TRAINING,
        "calc_params_l2_norm",
        f"{_I}:_wrap_calc_params_l2_norm",
        "--log-params-norm reads the parameters: a step pending for the next forward is finished first",
        MCORE,
    ),
    Patch(
        TRAINING,
        "wrap_model_chunks_with_ddp",
        f"{_I}:_wrap_wrap_model_chunks_with_ddp",
        "get_model's DDP gets our owner-aligned buffer layout (Megatron-LM lays it out from a flat list)",
        MCORE,
    ),
    Patch(
        DDP_BUILDER,
        "DistributedDataParallel",
        f"{_I}:_owner_aligned_ddp",
        "the model-config path's DDP (looked up at call time) gets our owner-aligned buffer layout",
        MCORE,
    ),
)

VALIDATION_SCOPE: Tuple[Patch, ...] = (
    Patch(
        ARGUMENTS,
        "_print_args",
        f"{_I}:_held_listing",
        "inside our validate_args: the argument listing held back until our checks after Megatron's passed",
        MCORE,
        stack=3,
    ),
)

ITERATION_LINE_SCOPE: Tuple[Patch, ...] = (
    Patch(
        TRAINING,
        "print_rank_last",
        f"{_I}:_line_with_max_logit",
        "inside training_log with --qk-clip / --log-max-attention-logit: the console line gets the max logit",
        MCORE,
    ),
)

CHECKPOINTS: Tuple[Patch, ...] = (
    Patch(
        _CKPT,
        "dist_checkpointing",
        f"{_C}:_guarded_dist_checkpointing",
        "a torch_dist save is staged, carries a manifest, is verified and swapped into place",
        MCORE,
    ),
    Patch(
        _CKPT,
        "maybe_msc",
        f"{_C}:_atomic_tracker_writes",
        "the tracker file is replaced atomically (a kill never leaves it empty)",
        MCORE,
    ),
    Patch(
        _CKPT,
        "_load_global_dist_base_checkpoint",
        f"{_C}:_wrap_load_global_dist_base_checkpoint",
        "a torch_dist checkpoint is verified before it is read; optional states it lacks start at zero; "
        "a different padded vocabulary is refused",
        MCORE,
    ),
    Patch(
        _CKPT,
        "_load_base_checkpoint",
        f"{_C}:_wrap_load_base_checkpoint",
        "an fsdp_dtensor checkpoint's padded vocabulary is checked on the first read",
        MCORE,
    ),
    Patch(
        _CKPT,
        "_get_checkpoint_format",
        f"{_C}:_wrap_get_checkpoint_format",
        "an fsdp_dtensor checkpoint is verified before DCP reads it (Megatron-LM may call it 'unknown')",
        MCORE,
    ),
    Patch(
        _CKPT,
        "preprocess_fsdp_dtensor_state_dict",
        f"{_C}:_wrap_preprocess",
        "replaced by fsdp_state_dict.preprocess_state_dict (Megatron-LM's fails for our state); a load "
        "checks the checkpoint holds every tensor it reads",
        MCORE,
    ),
    Patch(
        _CKPT,
        "read_metadata",
        f"{_C}:_wrap_read_metadata",
        "an empty tracker is an error naming --ckpt-step (Megatron-LM exits 0, a job that trained nothing); "
        "the iteration chosen in its place is read",
        MCORE,
    ),
    *(
        Patch(
            module,
            name,
            f"{_C}:_wrap_{name}",
            why,
            MCORE,
        )
        for module in (_CKPT, TRAINING)
        for name, why in (
            (
                "load_checkpoint",
                "an owned directory's leftovers undone first; an iteration chosen when the tracker cannot say; "
                "one error line",
            ),
            (
                "save_checkpoint",
                "a failed save (a full disk) is one line; fsdp_dtensor saves are staged like torch_dist ones",
            ),
        )
    ),
)

DCP_SAVE_SCOPE: Tuple[Patch, ...] = (
    Patch(
        "torch.distributed.checkpoint",
        "save",
        f"{_C}:_guarded_dcp_save",
        "inside save_checkpoint with --ckpt-format fsdp_dtensor: its one DCP save is staged like a torch_dist one",
        TORCH,
    ),
)

EXPERT_BIAS: Tuple[Patch, ...] = (
    Patch(
        "megatron.core.distributed.finalize_model_grads",
        "_update_router_expert_bias",
        "megatron_muon.megatron_lm.expert_bias:_wrap_update_router_expert_bias",
        "the router's expert bias is computed where Megatron computes it but kept aside until the step is taken",
        MCORE,
    ),
    Patch(
        TRAINING,
        "train_step",
        "megatron_muon.megatron_lm.expert_bias:_wrap_train_step",
        "applies the kept expert bias only when the step was taken (not skipped, no stop on a NaN)",
        MCORE,
    ),
)

WRITER_QUEUE: Tuple[Patch, ...] = (
    Patch(
        "megatron.core.dist_checkpointing.strategies.filesystem_async",
        "get_write_results_queue",
        "megatron_muon.megatron_lm.process_lifetime:_write_results_queue_dying_with_this_rank",
        "the checkpoint writers' results manager is forked from the rank and dies with it",
        MCORE,
    ),
)

MTP_LAYERS: Tuple[Patch, ...] = (
    Patch(
        "megatron.training.models.gpt",
        "mtp_block_spec",
        "megatron_muon.megatron_lm.layer_spec:_with_our_mtp_layers",
        "Megatron-LM builds the MTP layers from its default decoder layer spec, not the model's: with our local "
        "layer spec they get our modules too (MLA head sizes, QK-Clip's max logits, TP-correct MLA)",
        MCORE,
    ),
)

_L = "megatron_muon.megatron_lm.launch"
LAUNCH: Tuple[Patch, ...] = (
    Patch(
        ARGUMENTS,
        "validate_args",
        f"{_L}:_wrap_validate_args",
        "tools/pretrain_gpt.py's checks of values Megatron-LM reports late or not at all, before its validation; "
        "--qk-clip hidden from its transformer-engine check where our recording attention runs",
        MCORE,
        stack=4,
    ),
)

RESTORED_LISTING_SCOPE: Tuple[Patch, ...] = (
    Patch(
        ARGUMENTS,
        "_print_args",
        f"{_L}:_restored_then_printed",
        "inside the launch validation: the listing shows the QK-Clip flags hidden from Megatron-LM's check",
        MCORE,
        stack=2,
    ),
)

LISTING_SCOPE: Tuple[Patch, ...] = (
    Patch(
        ARGUMENTS,
        "_print_args",
        f"{_I}:_held_listing",
        "while tools/pretrain_gpt.py parses and validates: the listing printed after the checks that follow, "
        "so bad input is the last line",
        MCORE,
        stack=1,
    ),
)

PARSE_SCOPE: Tuple[Patch, ...] = (
    Patch(
        ARGUMENTS,
        "parse_args",
        f"{_L}:_parse_args_then_checks",
        "while tools/pretrain_gpt.py parses: tokenizer, data, save and load checks before Megatron-LM's "
        "validation, which fails on some of the same flags without naming the fix",
        MCORE,
    ),
)

_CPU = "megatron_muon.megatron_lm.cpu"
_TP_RANDOM = "megatron.core.tensor_parallel.random"
_DISTRIB = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer"
CPU_CORE: Tuple[Patch, ...] = (
    Patch(
        "torch.cuda",
        "current_device",
        f"{_CPU}:_device_cpu",
        "Megatron-core places buffers on torch.cuda.current_device(): the CPU",
        TORCH,
        cpu_only=True,
        builds=False,
    ),
    Patch(
        "torch.cuda", "device_count", f"{_CPU}:_one_device", "one 'device' per rank", TORCH, cpu_only=True, builds=False
    ),
    Patch("torch.cuda", "set_device", f"{_CPU}:_nothing", "no device to select", TORCH, cpu_only=True, builds=False),
    Patch(
        "torch.cuda",
        "get_rng_state",
        f"{_CPU}:_cpu_rng_state",
        "the tensor-parallel RNG tracker's 'CUDA' generator is the CPU's",
        TORCH,
        cpu_only=True,
        builds=False,
    ),
    Patch(
        "torch.cuda",
        "set_rng_state",
        f"{_CPU}:_set_cpu_rng_state",
        "the tensor-parallel RNG tracker's 'CUDA' generator is the CPU's",
        TORCH,
        cpu_only=True,
        builds=False,
    ),
    Patch(
        "torch.cuda",
        "manual_seed",
        f"{_CPU}:_nothing",
        "no CUDA generator to seed (the CPU's is seeded by Megatron-core too)",
        TORCH,
        cpu_only=True,
        builds=False,
    ),
    Patch(
        "torch.cuda",
        "manual_seed_all",
        f"{_CPU}:_nothing",
        "no CUDA generator to seed",
        TORCH,
        cpu_only=True,
        builds=False,
    ),
    Patch(
        "torch.cuda",
        "synchronize",
        f"{_CPU}:_nothing",
        "CPU work is already ordered",
        TORCH,
        cpu_only=True,
        builds=False,
    ),
    Patch("torch.cuda", "empty_cache", f"{_CPU}:_nothing", "no CUDA cache", TORCH, cpu_only=True, builds=False),
    Patch(
        "torch.cuda",
        "Stream",
        f"{_CPU}:_Stream",
        "CUDA streams: CPU work is already ordered",
        TORCH,
        cpu_only=True,
        builds=False,
    ),
    Patch("torch.cuda", "Event", f"{_CPU}:_Event", "CUDA events: always complete", TORCH, cpu_only=True, builds=False),
    Patch(
        "torch.cuda",
        "current_stream",
        f"{_CPU}:_cpu_stream",
        "CUDA streams: CPU work is already ordered",
        TORCH,
        cpu_only=True,
        builds=False,
    ),
    Patch(
        "torch.cuda",
        "default_stream",
        f"{_CPU}:_cpu_stream",
        "CUDA streams: CPU work is already ordered",
        TORCH,
        cpu_only=True,
        builds=False,
    ),
    Patch(
        "torch.cuda",
        "stream",
        f"{_CPU}:_no_stream_context",
        "CUDA streams: CPU work is already ordered",
        TORCH,
        cpu_only=True,
        builds=False,
    ),
    Patch(
        "torch.cuda",
        "memory_allocated",
        f"{_CPU}:_no_bytes",
        "Megatron-LM's memory reports: nothing on a GPU",
        TORCH,
        cpu_only=True,
        builds=False,
    ),
    Patch(
        "torch.cuda",
        "max_memory_allocated",
        f"{_CPU}:_no_bytes",
        "Megatron-LM's memory reports: nothing on a GPU",
        TORCH,
        cpu_only=True,
        builds=False,
    ),
    Patch(
        "torch.cuda",
        "memory_reserved",
        f"{_CPU}:_no_bytes",
        "Megatron-LM's memory reports: nothing on a GPU",
        TORCH,
        cpu_only=True,
        builds=False,
    ),
    Patch(
        "torch.cuda",
        "max_memory_reserved",
        f"{_CPU}:_no_bytes",
        "Megatron-LM's memory reports: nothing on a GPU",
        TORCH,
        cpu_only=True,
        builds=False,
    ),
    Patch(
        "torch.cuda",
        "memory_stats",
        f"{_CPU}:_no_memory_stats",
        "Megatron-LM's memory reports: nothing on a GPU",
        TORCH,
        cpu_only=True,
        builds=False,
    ),
    Patch(
        "torch.cuda",
        "get_device_capability",
        f"{_CPU}:_no_capability",
        "compute capability 0.0: checks for GPU kernels fail with their own message",
        TORCH,
        cpu_only=True,
        builds=False,
    ),
    Patch(
        "torch.cuda",
        "default_generators",
        f"{_CPU}:_NO_GENERATORS",
        "no CUDA generators",
        TORCH,
        cpu_only=True,
        builds=False,
    ),
    Patch(
        _TP_RANDOM,
        "_get_cuda_rng_state",
        f"{_CPU}:_cpu_rng_state",
        "the tracker's 'CUDA' RNG state is the CPU generator's",
        MCORE,
        cpu_only=True,
        builds=False,
    ),
    Patch(
        _TP_RANDOM,
        "_set_cuda_rng_state",
        f"{_CPU}:_set_cpu_rng_state",
        "the tracker's 'CUDA' RNG state is the CPU generator's",
        MCORE,
        cpu_only=True,
        builds=False,
    ),
    Patch(
        "megatron.core.transformer.moe.moe_utils",
        "te_general_gemm",
        f"{_CPU}:_no_te_general_gemm",
        "without transformer-engine the name is never bound, yet the router reads it",
        MCORE,
        cpu_only=True,
        adds=True,
    ),
    Patch(
        _DISTRIB,
        "_set_main_param_and_optimizer_states",
        f"{_CPU}:_set_states_keeping_step",
        "without transformer-engine / Apex (torch AdamW) a load shares one step tensor, drops or misplaces the "
        "step, and copies into a leaf's view outside no_grad",
        MCORE,
        cpu_only=True,
    ),
    Patch(
        _DISTRIB,
        "sharded_state_dict",
        f"{_CPU}:_sharded_state_dict_loadable",
        "without transformer-engine / Apex a fresh optimizer cannot build the state dict it loads into",
        MCORE,
        cpu_only=True,
    ),
    Patch(
        "megatron.core.distributed.fsdp.mcore_fsdp_adapter:FullyShardedDataParallel",
        "__init__",
        f"{_CPU}:_fsdp_on_cpu",
        "Megatron-FSDP makes torch.device(f'cuda:{torch.cuda.current_device()}') whatever device is passed",
        MCORE,
        cpu_only=True,
    ),
)

DEVICE_INDEX_SCOPE: Tuple[Patch, ...] = (
    Patch(
        "torch.cuda",
        "current_device",
        f"{_CPU}:_device_zero",
        "inside Megatron-FSDP's constructor: 'cuda:{current_device()}' must evaluate (it is then built for the CPU)",
        TORCH,
        cpu_only=True,
        builds=False,
        stack=1,
    ),
)

PLAIN_COMPILE_SCOPE: Tuple[Patch, ...] = (
    Patch(
        "torch",
        "compile",
        f"{_CPU}:_plain_compile",
        "while Megatron-core is first imported on the CPU path: its torch.compile decorators import inductor "
        "(about 2 s per process) for functions that run eagerly anyway",
        TORCH,
        cpu_only=True,
        builds=False,
    ),
)

WHEEL: Tuple[Patch, ...] = (
    Patch(
        "megatron.core.datasets.utils",
        "compile_helpers",
        f"{_CPU}:_compile_helpers_unless_compiled",
        "the wheel ships helpers_cpp compiled but not its Makefile: initialize_megatron's `make` is skipped "
        "when it imports (any device)",
        MCORE,
    ),
)

CPU_INITIALIZATION: Tuple[Patch, ...] = (
    Patch(
        TRAINING,
        "initialize_megatron",
        f"{_CPU}:_allow_no_cuda",
        "pretrain calls initialize_megatron without allow_no_cuda, Megatron's own switch past its CUDA assert",
        MCORE,
        cpu_only=True,
    ),
)

CPU_DEVICE_ARCHITECTURE: Tuple[Patch, ...] = (
    Patch(
        ARGUMENTS,
        "get_device_arch_version",
        f"{_CPU}:_device_zero",
        "validate_args asks the GPU's architecture with TP or CP > 1 to choose a warning: 0 without a GPU",
        MCORE,
        cpu_only=True,
        builds=False,
    ),
    Patch(
        ARGUMENTS,
        "validate_args",
        f"{_CPU}:_max_connections_for_the_engine",
        "CUDA_DEVICE_MAX_CONNECTIONS as validation requires it (1, or unset with Megatron-FSDP): it orders no "
        "GPU kernels here",
        MCORE,
        cpu_only=True,
        stack=1,
    ),
)

CPU_NO_PREMUL_SUM: Tuple[Patch, ...] = (
    Patch(
        ARGUMENTS,
        "validate_args",
        f"{_CPU}:_no_gradient_reduce_div_fusion",
        "Megatron-FSDP divides inside the reduction (ReduceOp.PREMUL_SUM), which only NCCL has: divide first",
        MCORE,
        cpu_only=True,
        stack=2,
    ),
)

CPU_JIT_WARMUP: Tuple[Patch, ...] = (
    Patch(
        "megatron.training.initialize",
        "_warmup_jit_function",
        f"{_CPU}:_warmup_keeping_the_rng",
        "the fused functions' warm-up draws from the 'CUDA' generator, the CPU's here, which also initializes "
        "the routers: it leaves the generator as it found it, as on a GPU",
        MCORE,
        cpu_only=True,
    ),
)

MEGATRON_LM: Tuple[Patch, ...] = INTEGRATION + CHECKPOINTS + EXPERT_BIAS + WRITER_QUEUE + READERS
"""What ``use_megatron_muon()`` installs on Megatron-LM's own modules."""

PATCHES: Tuple[Patch, ...] = (
    MEGATRON_LM
    + VALIDATION_SCOPE
    + ITERATION_LINE_SCOPE
    + DCP_SAVE_SCOPE
    + LAUNCH
    + RESTORED_LISTING_SCOPE
    + LISTING_SCOPE
    + PARSE_SCOPE
    + CPU_CORE
    + DEVICE_INDEX_SCOPE
    + PLAIN_COMPILE_SCOPE
    + WHEEL
    + CPU_INITIALIZATION
    + CPU_DEVICE_ARCHITECTURE
    + CPU_NO_PREMUL_SUM
    + CPU_JIT_WARMUP
    + MTP_LAYERS
    + SINGLE_RANK_GROUPS
)
"""Every row (what is assigned on an object, not on Megatron's code, is listed in tests/unit/test_patches.py)."""

# What each target was when its row was written: ``patching.signature_text(original)`` and, where the
# replacement restates part of the original (a reader, the writers' queue, the fsdp_dtensor
# preprocessing), ``patching.fingerprint`` of its source. A Megatron upgrade that changes one fails
# tests/unit/test_patches.py naming the row: read the new code, then update the row and this entry.
WRITTEN_AGAINST: Dict[Tuple[str, str], Tuple[str, Optional[str]]] = {
    ("megatron.training.arguments", "add_megatron_arguments"): (
        "(parser: argparse.ArgumentParser)",
        None,
    ),
    ("megatron.training.arguments", "validate_args"): (
        "(args, defaults={})",
        None,
    ),
    ("megatron.training.training", "get_megatron_optimizer"): (
        "(config: megatron.core.optimizer.optimizer_config.OptimizerConfig, model_chunks: List[megatron.core.transformer.module.MegatronModule], config_overrides: Optional[Dict[megatron.core.optimizer.optimizer_config.ParamKey, megatron.core.optimizer_param_scheduler.ParamGroupOverride]] = None, use_gloo_process_groups: bool = True, pg_collection: Optional[megatron.core.process_groups_config.ProcessGroupCollection] = None, dump_param_to_param_group_map: Optional[str] = None) -> megatron.core.optimizer.optimizer.MegatronOptimizer",
        None,
    ),
    ("megatron.training.training", "clip_qk"): (
        "(model, log_max_only=False) -> float",
        None,
    ),
    ("megatron.training.training", "training_log"): (
        "(loss_dict, total_loss_dict, learning_rate: float | None, iteration, loss_scale, report_memory_flag, skipped_iter, grad_norm, params_norm, num_zeros_in_grad, max_attention_logit, pg_collection=None, is_first_iteration=False, seqlen_squared_sum_in_batch: float | None = None, total_real_tokens_in_batch: float | None = None)",
        None,
    ),
    ("megatron.training.training", "calc_params_l2_norm"): (
        "(model, force_create_fp32_copy=False)",
        None,
    ),
    ("megatron.training.training", "wrap_model_chunks_with_ddp"): (
        "(model_chunks, config, ddp_config, *, use_layer_wise_distributed_optimizer=False, use_layer_wise_param_layout=True, DP=<class 'megatron.core.distributed.distributed_data_parallel.DistributedDataParallel'>, pg_collection=None, bucket_sizes=None, disable_bucketing_per_chunk=None)",
        None,
    ),
    ("megatron.training.models.dist_utils", "DistributedDataParallel"): (
        "(config: megatron.core.transformer.transformer_config.TransformerConfig, ddp_config: megatron.core.distributed.distributed_data_parallel_config.DistributedDataParallelConfig, module: torch.nn.modules.module.Module, disable_bucketing: bool = False, pg_collection: Optional[megatron.core.process_groups_config.ProcessGroupCollection] = None, full_param_layout: Optional[megatron.core.optimizer.param_layout.FullParamLayout] = None)",
        None,
    ),
    ("megatron.training.checkpointing", "_load_global_dist_base_checkpoint"): (
        "(load_dir, args, rank0, sharded_state_dict, iteration, release, checkpointing_context=None, dp_cp_group=None, expt_dp_group=None)",
        None,
    ),
    ("megatron.training.checkpointing", "_load_base_checkpoint"): (
        "(load_dir, args, rank0=False, sharded_state_dict=None, checkpointing_context=None, dp_cp_group=None, expt_dp_group=None, gpt_compat_layer_maps=None)",
        None,
    ),
    ("megatron.training.checkpointing", "_get_checkpoint_format"): (
        "(checkpoint_name, args)",
        None,
    ),
    ("megatron.training.checkpointing", "preprocess_fsdp_dtensor_state_dict"): (
        "(args, raw_state_dict, model)",
        "9628937ae6813de4",
    ),
    ("megatron.training.checkpointing", "read_metadata"): (
        "(tracker_filename)",
        None,
    ),
    ("megatron.training.checkpointing", "load_checkpoint"): (
        "(ddp_model, optimizer, opt_param_scheduler, load_arg='load', strict=True, checkpointing_context=None, skip_load_to_model_and_opt=False, tp_group: Optional[torch.distributed.distributed_c10d.ProcessGroup] = None, pp_group: Optional[torch.distributed.distributed_c10d.ProcessGroup] = None, dp_cp_group: Optional[torch.distributed.distributed_c10d.ProcessGroup] = None, dp_group: Optional[torch.distributed.distributed_c10d.ProcessGroup] = None, expt_dp_group: Optional[torch.distributed.distributed_c10d.ProcessGroup] = None, rng_state_key_prefix: str = '')",
        None,
    ),
    ("megatron.training.checkpointing", "save_checkpoint"): (
        "(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far, checkpointing_context=None, pipeline_rank=None, expert_rank=None, tensor_rank=None, pipeline_parallel=None, expert_parallel=None, non_persistent_ckpt=False, train_data_iterator=None, preprocess_common_state_dict_fn=None, release=False, tp_group: Optional[torch.distributed.distributed_c10d.ProcessGroup] = None, pp_group: Optional[torch.distributed.distributed_c10d.ProcessGroup] = None, dp_cp_group: Optional[torch.distributed.distributed_c10d.ProcessGroup] = None, dp_group: Optional[torch.distributed.distributed_c10d.ProcessGroup] = None, expt_dp_group: Optional[torch.distributed.distributed_c10d.ProcessGroup] = None, rng_state_key_prefix: str = '')",
        None,
    ),
    ("megatron.training.training", "load_checkpoint"): (
        "(ddp_model, optimizer, opt_param_scheduler, load_arg='load', strict=True, checkpointing_context=None, skip_load_to_model_and_opt=False, tp_group: Optional[torch.distributed.distributed_c10d.ProcessGroup] = None, pp_group: Optional[torch.distributed.distributed_c10d.ProcessGroup] = None, dp_cp_group: Optional[torch.distributed.distributed_c10d.ProcessGroup] = None, dp_group: Optional[torch.distributed.distributed_c10d.ProcessGroup] = None, expt_dp_group: Optional[torch.distributed.distributed_c10d.ProcessGroup] = None, rng_state_key_prefix: str = '')",
        None,
    ),
    ("megatron.training.training", "save_checkpoint"): (
        "(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far, checkpointing_context=None, pipeline_rank=None, expert_rank=None, tensor_rank=None, pipeline_parallel=None, expert_parallel=None, non_persistent_ckpt=False, train_data_iterator=None, preprocess_common_state_dict_fn=None, release=False, tp_group: Optional[torch.distributed.distributed_c10d.ProcessGroup] = None, pp_group: Optional[torch.distributed.distributed_c10d.ProcessGroup] = None, dp_cp_group: Optional[torch.distributed.distributed_c10d.ProcessGroup] = None, dp_group: Optional[torch.distributed.distributed_c10d.ProcessGroup] = None, expt_dp_group: Optional[torch.distributed.distributed_c10d.ProcessGroup] = None, rng_state_key_prefix: str = '')",
        None,
    ),
    ("megatron.core.distributed.finalize_model_grads", "_update_router_expert_bias"): (
        "(model: List[torch.nn.modules.module.Module], config: megatron.core.transformer.transformer_config.TransformerConfig, tp_dp_cp_group: Optional[torch.distributed.distributed_c10d.ProcessGroup] = None)",
        None,
    ),
    ("megatron.training.training", "train_step"): (
        "(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config, forward_backward_func, iteration=None, pg_collection: Union[megatron.core.process_groups_config.ProcessGroupCollection, megatron.core.process_groups_config.MultiModuleProcessGroupCollection, NoneType] = None, p2p_communicator: Optional[megatron.core.pipeline_parallel.p2p_communication.P2PCommunicator] = None)",
        None,
    ),
    ("megatron.core.dist_checkpointing.strategies.filesystem_async", "get_write_results_queue"): (
        "(mp_mode: str = 'spawn') -> <bound method BaseContext.Queue of <multiprocessing.context.DefaultContext object>>",
        "e395fb0e86a062e2",
    ),
    ("torch.distributed.checkpoint.filesystem:FileSystemReader", "read_metadata"): (
        "(self, *args: Any, **kwargs: Any) -> torch.distributed.checkpoint.metadata.Metadata",
        "8586ce344a523602",
    ),
    ("torch.distributed.checkpoint.filesystem:FileSystem", "create_stream"): (
        "(self, path: str | os.PathLike, mode: str) -> collections.abc.Generator[io.IOBase, None, None]",
        "a705de3a308bc1fb",
    ),
    ("torch.distributed.checkpoint.default_planner:DefaultLoadPlanner", "load_bytes"): (
        "(self, read_item: torch.distributed.checkpoint.planner.ReadItem, value: _io.BytesIO) -> None",
        "666701f9808c4bc2",
    ),
    ("megatron.core.dist_checkpointing.strategies.common", "load_common"): (
        "(checkpoint_dir: str)",
        "fa5a3b6e11b5b985",
    ),
    ("megatron.core.dist_checkpointing.serialization", "load_common"): (
        "(checkpoint_dir: str)",
        "fa5a3b6e11b5b985",
    ),
    ("megatron.training.arguments", "_print_args"): (
        "(title, args)",
        None,
    ),
    ("megatron.training.training", "print_rank_last"): (
        "(message)",
        None,
    ),
    ("torch.distributed.checkpoint", "save"): (
        "(state_dict: dict[str, typing.Any], *, checkpoint_id: str | os.PathLike | None = None, storage_writer: torch.distributed.checkpoint.storage.StorageWriter | None = None, planner: torch.distributed.checkpoint.planner.SavePlanner | None = None, process_group: torch.distributed.distributed_c10d.ProcessGroup | None = None, no_dist: bool = False, use_collectives: bool = True) -> torch.distributed.checkpoint.metadata.Metadata",
        None,
    ),
    ("megatron.training.arguments", "parse_args"): (
        "(extra_args_provider=None, ignore_unknown_args=False)",
        None,
    ),
    ("torch.cuda", "current_device"): (
        "() -> int",
        None,
    ),
    ("torch.cuda", "device_count"): (
        "() -> int",
        None,
    ),
    ("torch.cuda", "set_device"): (
        "(device: torch.device | str | int | None) -> None",
        None,
    ),
    ("torch.cuda", "get_rng_state"): (
        "(device: int | str | torch.device = 'cuda') -> torch.Tensor",
        None,
    ),
    ("torch.cuda", "set_rng_state"): (
        "(new_state: torch.Tensor, device: int | str | torch.device = 'cuda') -> None",
        None,
    ),
    ("torch.cuda", "manual_seed"): (
        "(seed: int) -> None",
        None,
    ),
    ("torch.cuda", "manual_seed_all"): (
        "(seed: int) -> None",
        None,
    ),
    ("torch.cuda", "synchronize"): (
        "(device: torch.device | str | int | None = None) -> None",
        None,
    ),
    ("torch.cuda", "empty_cache"): (
        "() -> None",
        None,
    ),
    ("torch.cuda", "Stream"): (
        "(device=None, priority=0, **kwargs)",
        None,
    ),
    ("torch.cuda", "Event"): (
        "(enable_timing=False, blocking=False, interprocess=False, external=False)",
        None,
    ),
    ("torch.cuda", "current_stream"): (
        "(device: torch.device | str | int | None = None) -> torch.cuda.streams.Stream",
        None,
    ),
    ("torch.cuda", "default_stream"): (
        "(device: torch.device | str | int | None = None) -> torch.cuda.streams.Stream",
        None,
    ),
    ("torch.cuda", "stream"): (
        "(stream: Optional[ForwardRef('torch.cuda.Stream')]) -> torch.cuda.StreamContext",
        None,
    ),
    ("torch.cuda", "memory_allocated"): (
        "(device: 'Device' = None) -> int",
        None,
    ),
    ("torch.cuda", "max_memory_allocated"): (
        "(device: 'Device' = None) -> int",
        None,
    ),
    ("torch.cuda", "memory_reserved"): (
        "(device: 'Device' = None) -> int",
        None,
    ),
    ("torch.cuda", "max_memory_reserved"): (
        "(device: 'Device' = None) -> int",
        None,
    ),
    ("torch.cuda", "memory_stats"): (
        "(device: 'Device' = None) -> dict[str, typing.Any]",
        None,
    ),
    ("torch.cuda", "get_device_capability"): (
        "(device: torch.device | str | int | None = None) -> tuple[int, int]",
        None,
    ),
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"): (
        "(device: 'Union[int, str, torch.device]' = 'cuda', clone: 'bool' = False, graph_safe: 'bool' = False) -> 'torch.Tensor'",
        None,
    ),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"): (
        "(new_state: 'torch.Tensor', device: 'int' = -1, graph_safe: 'bool' = False)",
        None,
    ),
    ("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer", "_set_main_param_and_optimizer_states"): (
        "(self, model_param, tensors)",
        None,
    ),
    ("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer", "sharded_state_dict"): (
        "(self, model_sharded_state_dict: Dict[str, Any] = {}, is_loading: bool = False, sharding_type: Optional[str] = None, metadata: Optional[dict] = None)",
        None,
    ),
    ("megatron.core.distributed.fsdp.mcore_fsdp_adapter:FullyShardedDataParallel", "__init__"): (
        "(self, config: megatron.core.transformer.transformer_config.TransformerConfig, ddp_config: megatron.core.distributed.distributed_data_parallel_config.DistributedDataParallelConfig, module: torch.nn.modules.module.Module, fsdp_unit_modules: Optional[List[torch.nn.modules.module.Module]] = None, disable_bucketing: bool = False, device: Optional[torch.device] = None, pg_collection: Optional[megatron.core.process_groups_config.ProcessGroupCollection] = None)",
        None,
    ),
    ("torch", "compile"): (
        "(model: collections.abc.Callable[~_InputT, ~_RetT] | None = None, *, fullgraph: bool = False, dynamic: bool | None = None, backend: str | collections.abc.Callable = 'inductor', mode: str | None = None, options: dict[str, str | int | bool | collections.abc.Callable] | None = None, disable: bool = False) -> collections.abc.Callable[[collections.abc.Callable[~_InputT, ~_RetT]], collections.abc.Callable[~_InputT, ~_RetT]] | collections.abc.Callable[~_InputT, ~_RetT]",
        None,
    ),
    ("megatron.core.datasets.utils", "compile_helpers"): (
        "()",
        None,
    ),
    ("megatron.training.training", "initialize_megatron"): (
        "(allow_no_cuda=False, skip_mpu_initialization=False, get_embedding_ranks=None, get_position_embedding_ranks=None, store=None, skip_model_parallel_init=False, seed_pp_group=None, seed_dp_group=None, seed_tp_group=None, seed_ep_group=None, seed_etp_group=None, skip_random_seed=False)",
        None,
    ),
    ("megatron.training.arguments", "get_device_arch_version"): (
        "()",
        None,
    ),
    ("megatron.training.initialize", "_warmup_jit_function"): (
        "(tp_size=None)",
        None,
    ),
    ("megatron.training.models.gpt", "mtp_block_spec"): (
        "(config: 'GPTModelConfig', transformer_layer_spec: megatron.core.transformer.spec_utils.ModuleSpec, vp_stage: int | None = None) -> megatron.core.transformer.spec_utils.ModuleSpec | None",
        None,
    ),
    ("megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer:DataParallelBuffer", "__init__"): (
        "(self, ddp_config: megatron.core.distributed.distributed_data_parallel_config.DistributedDataParallelConfig, params: List[torch.nn.parameter.Parameter], is_data_distributed: bool, bucket_id: int, dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None, data_parallel_group: Optional[torch.distributed.distributed_c10d.ProcessGroup] = None, dp_rank: Optional[int] = None, temporary_bucket_allocator: Optional[megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer.TemporaryBucketAllocator] = None, is_transpose_buffer: bool = False, gradient_scaling_factor: Optional[float] = None, chunk_size_factor: int = 1, mem_alloc_context: Optional[Callable] = None, item_index_map: Optional[Dict[int, megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer.TensorItemIndex]] = None, bucket_index: Optional[megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer.BucketIndex] = None, shard_bucket_index: Optional[megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer.ShardBucketIndex] = None) -> None",
        None,
    ),
}
