"""GPT pretraining with Megatron-LM's own training loop and megatron_muon's Muon.

The shape of Megatron-LM's ``pretrain_gpt.py`` (the script is not in the megatron-core
wheel; its training code is): the arguments are Megatron-LM's (``parse_and_validate_args``),
the model is Megatron-LM's ``GPTModelConfig`` from them with our layer spec
(:func:`megatron_muon.layer_specs.megatron_lm_layer_spec`), :func:`forward_step` and :func:`train_valid_test_datasets_provider`
are Megatron-LM's recipe, and ``megatron.training.pretrain`` runs everything else:
initialisation, checkpoints (``--load/--save``, torch_dist), the training loop, evaluation,
logging, TensorBoard. ``use_megatron_muon()`` routes ``--optimizer muon`` to our optimizer.

Ours on top, each thin: ``--recipe NAME|FILE`` (YAML of Megatron-LM flags; the command line
overrides it), the ``--muon-*`` flags, the built-in byte corpus when no data is given
(:mod:`.corpus`), and the CPU path (:mod:`.cpu`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from functools import partial
from typing import List, Optional, Sequence

import torch

from . import corpus, cpu, recipes
from .integration import use_megatron_muon

DEFAULTS = {"tokenizer_type": "NullTokenizer", "vocab_size": corpus.BYTE_VOCAB_SIZE}
"""Megatron-LM's ``args_defaults``: the built-in byte corpus's tokenizer when none is named."""
NO_TE_DEFAULTS = {"transformer_impl": "local", "apply_rope_fusion": False, "no_persist_layer_norm": True,
                  "gradient_accumulation_fusion": False}
"""Defaults without transformer-engine (Megatron-LM's assume it): its fused kernels are absent."""


# ---------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------


def gpt_model_config(args: argparse.Namespace):
    """Megatron-LM's ``GPTModelConfig`` from the arguments, with our layer spec
    (:func:`megatron_muon.layer_specs.megatron_lm_layer_spec`) unless ``--spec`` names one."""
    from megatron.training.argument_utils import gpt_config_from_args

    from megatron_muon.layer_specs import megatron_lm_layer_spec

    config = gpt_config_from_args(args)
    if args.spec is None:
        config.transformer_layer_spec = megatron_lm_layer_spec
    return config


# ---------------------------------------------------------------------------------------
# Forward step (Megatron-LM's pretrain_gpt.py recipe)
# ---------------------------------------------------------------------------------------


def get_batch(data_iterator, vp_stage: Optional[int] = None):
    """This rank's micro-batch, as Megatron-LM's ``get_batch``: TP rank 0 reads it and
    broadcasts it over the TP group, then each CP rank keeps its part of the sequence."""
    from megatron.core import parallel_state as mpu
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None
    args = get_args()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        batch = {k: (v.cuda(non_blocking=True) if torch.is_tensor(v) else v) for k, v in next(data_iterator).items()}
        batch.setdefault("attention_mask", None)
    batch = get_batch_on_this_tp_rank(
        batch, has_cu_seqlens=False, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(), cp_size=args.context_parallel_size,
        tp_rank=tp_rank, micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
        mtp_on_this_rank=False, pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(), is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group())
    return batch["tokens"], batch["labels"], batch["loss_mask"], batch["attention_mask"], batch["position_ids"]


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Summed token loss, token count, and the ``lm loss`` report; with
    ``--check-for-nan-in-loss-and-grad`` a NaN / Inf loss stops the run (Megatron-LM's
    rerun state machine, fatal)."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    if get_args().check_for_nan_in_loss_and_grad:
        machine = get_rerun_state_machine()
        for check, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            machine.validate_result(result=loss, rejection_func=check, tolerance=0.0, fatal=True,
                                    message=f"found {what} in local forward loss calculation")
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    """Megatron-LM's GPT forward step: batch, model, and the loss function to apply."""
    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training import get_timers

    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(
        data_iterator, get_attr_wrapped_model(model, "vp_stage")
    )
    timers("batch-generator").stop()
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


# ---------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------


def dataset_config(args: argparse.Namespace):
    """``GPTDatasetConfig`` from the arguments, as Megatron-LM's ``pretrain_gpt.py``."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.training import get_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples: List[int], vp_stage: Optional[int] = None):
    """Megatron's GPT datasets (``MockGPTDataset`` with ``--mock-data``), on the first and
    last pipeline stages' TP rank 0; the built-in corpus when no data is named."""
    from megatron.core import parallel_state
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
    from megatron.training import get_args, print_rank_0
    from megatron.training.utils import is_first_or_last_pipeline_stage

    args = get_args()
    if corpus.uses_builtin_corpus(args):
        args.data_path, args.split = [corpus.stdlib_corpus_prefix(args)], args.split or corpus.STDLIB_SPLIT
    config = dataset_config(args)
    cls = MockGPTDataset if args.mock_data else GPTDataset
    if not args.mock_data:
        corpus.check_splits_not_empty(config, train_val_test_num_samples)

    def built_on_rank() -> bool:
        return is_first_or_last_pipeline_stage(vp_stage) and parallel_state.get_tensor_model_parallel_rank() == 0

    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = BlendedMegatronDatasetBuilder(cls, train_val_test_num_samples, built_on_rank, config).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


train_valid_test_datasets_provider.is_distributed = True  # called on every rank (Megatron-LM's flag)


# ---------------------------------------------------------------------------------------
# Arguments: recipes, CPU defaults
# ---------------------------------------------------------------------------------------


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--recipe`` (expanded before parsing, listed here for ``--help``) and the CPU defaults
    (gloo, the local transformer implementation) where there is no GPU / transformer-engine."""
    group = parser.add_argument_group("megatron_muon")
    group.add_argument("--recipe", default=None, metavar="NAME|FILE",
                       help="YAML file (or name under recipes/) of Megatron-LM flags; the command line overrides it. "
                       f"Available: {', '.join(recipes.available_recipes())}.")
    parser.error = functools.partial(_one_line_error, parser.prog)  # not Megatron-LM's 3,000-line usage
    if not cpu.use_cuda():
        parser.set_defaults(distributed_backend="gloo")
    if not _have_transformer_engine():
        parser.set_defaults(**NO_TE_DEFAULTS)
    return parser


def _one_line_error(prog: str, message: str) -> None:
    """Bad input: one line on stderr, exit code 2 (argparse's code), nothing built."""
    lines = str(message).strip().splitlines()
    print(f"{os.path.basename(prog)}: error: {lines[0] if lines else message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def expand_recipe(argv: Sequence[str]) -> List[str]:
    """``argv`` with ``--recipe X`` replaced by the recipe's flags, placed first (so the
    command line overrides them). Raises ``RecipeError``."""
    import megatron.training.arguments as arguments

    argv = list(argv)
    given = [i for i, a in enumerate(argv) if a == "--recipe" or a.startswith("--recipe=")]
    if not given:
        return argv
    if len(given) > 1:
        raise recipes.RecipeError("--recipe given more than once")
    i = given[0]
    if argv[i] == "--recipe":
        if i + 1 >= len(argv):
            raise recipes.RecipeError("--recipe needs a name or a file")
        name, rest = argv[i + 1], argv[:i] + argv[i + 2:]
    else:
        name, rest = argv[i].split("=", 1)[1], argv[:i] + argv[i + 1:]
    parser = extra_args_provider(arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    return recipes.recipe_to_argv(recipes.load_recipe(name), parser) + rest


def accept_qk_clip_with_recording_attention() -> None:
    """Megatron-LM's ``validate_args`` refuses ``--qk-clip`` / ``--log-max-attention-logit``
    without transformer-engine >= 2.9 (TE's attention records the max logits). Our local
    layer spec's ``RecordingDotProductAttention`` records them too, so with
    ``--transformer-impl local`` (and no ``--spec`` of the user's) the flags are hidden
    from that one check and restored after it; everything else validates as before."""
    import megatron.training.arguments as arguments

    inner = arguments.validate_args
    if getattr(inner, "__megatron_muon_qk_clip__", False):
        return

    @functools.wraps(inner)
    def validate_args(args, *a, **kw):
        ours = args.transformer_impl == "local" and args.spec is None
        saved = (args.qk_clip, args.log_max_attention_logit)
        if ours:
            args.qk_clip = args.log_max_attention_logit = False
        try:
            return inner(args, *a, **kw)
        finally:
            if ours:
                args.qk_clip, args.log_max_attention_logit = saved

    validate_args.__megatron_muon_qk_clip__ = True
    arguments.validate_args = validate_args


def parse_and_validate(argv: Sequence[str]) -> argparse.Namespace:
    """Megatron-LM's ``parse_and_validate_args`` on ``argv`` with the recipe expanded.

    Bad input (unknown recipe, invalid ``--muon-*`` value, a flag Megatron-LM rejects) ends
    the process with one line on stderr and exit code 2, before any model is built.
    """
    from megatron.training.arguments import parse_and_validate_args

    with _errors_as_one_line():
        sys.argv = [_prog()] + expand_recipe(argv)
        args = parse_and_validate_args(extra_args_provider=extra_args_provider, args_defaults=DEFAULTS)
        corpus.check_tokenizer(args)
        check_checkpoint_to_load(args)
    return args


def check_checkpoint_to_load(args: argparse.Namespace) -> None:
    """With ``--exit-on-missing-checkpoint``, a ``--load`` without a checkpoint fails here
    (exit code 2, nothing built or written). Megatron-LM stops too, but with ``sys.exit()``,
    status 0, which a launch script reads as a finished run."""
    from megatron.training.checkpointing import get_checkpoint_tracker_filename

    if not (args.load and args.exit_on_missing_checkpoint) or os.path.isfile(get_checkpoint_tracker_filename(args.load)):
        return
    if args.ckpt_step is not None and os.path.isdir(os.path.join(args.load, f"iter_{args.ckpt_step:07d}")):
        return
    raise ValueError(f"--load {args.load} holds no checkpoint (no latest_checkpointed_iteration.txt"
                     f"{'' if args.ckpt_step is None else f' and no iter_{args.ckpt_step:07d}'}) and "
                     "--exit-on-missing-checkpoint is set: check the path")


def validated_args(argv: Sequence[str], world_size: int = 1) -> argparse.Namespace:
    """Megatron-LM's parsed and validated arguments for ``argv`` as ``world_size`` ranks would
    see them, without starting anything (for tools that read a configuration, e.g. a recipe)."""
    import megatron.training.arguments as arguments

    install_argument_layers()
    if not cpu.use_cuda():
        cpu.no_device_architecture()  # validation reads it with TP > 1
    with _errors_as_one_line():
        sys.argv = [_prog()] + expand_recipe(argv)
        args = arguments.parse_args(extra_args_provider)
        args.rank, args.world_size = 0, world_size
        # Only a GPU kernel's availability is checked for it (torch.cuda, absent here).
        grouped, args.moe_grouped_gemm = args.moe_grouped_gemm, args.moe_grouped_gemm and cpu.use_cuda()
        arguments.validate_args(args, DEFAULTS)
        args.moe_grouped_gemm = grouped
    return args


def _prog() -> str:
    return sys.argv[0] if sys.argv else "pretrain_gpt.py"


@contextlib.contextmanager
def _errors_as_one_line():
    """Validation errors (Megatron-LM asserts, our ValueErrors) as :func:`_one_line_error`."""
    saved = list(sys.argv)
    try:
        yield
    except (recipes.RecipeError, corpus.CorpusError, ValueError, AssertionError) as exc:
        _one_line_error(saved[0] if saved else "pretrain_gpt.py", str(exc) or type(exc).__name__)
    finally:
        sys.argv = saved


def install_argument_layers() -> None:
    """Our layers on Megatron-LM's argument handling: ``--optimizer muon`` and the
    ``--muon-*`` flags (``use_megatron_muon``) and QK-Clip with our recording attention."""
    use_megatron_muon()
    accept_qk_clip_with_recording_attention()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse, then run Megatron-LM's ``pretrain``. Returns the exit status."""
    from megatron.core.enums import ModelType
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.training import pretrain

    argv = sys.argv[1:] if argv is None else list(argv)
    cpu.install()
    if "RANK" not in os.environ:  # plain `python pretrain_gpt.py`: one process, no launcher
        from megatron_muon.cpu import set_single_process_rendezvous

        set_single_process_rendezvous()
    install_argument_layers()
    args = parse_and_validate(argv)
    config = pretrain_cfg_container_from_args(args, gpt_model_config(args))
    pretrain(config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
