#!/usr/bin/env python
"""Pretrain GPT with Megatron-LM's own training loop and megatron_muon's Muon.

The shape of Megatron-LM's ``pretrain_gpt.py`` (that script is not in the megatron-core
wheel; the training code it calls is): the model is Megatron-LM's ``GPTModelConfig`` from
the arguments with our layer spec (:func:`megatron_muon.megatron_lm.layer_spec.megatron_lm_layer_spec`),
:func:`forward_step` and :func:`train_valid_test_datasets_provider` follow Megatron-LM's, and
``megatron.training.pretrain`` runs everything else: initialisation, ``--load/--save``
(torch_dist), the training loop, evaluation, logging, TensorBoard. Our layers on top
(:func:`megatron_muon.megatron_lm.launch.prepare`): ``--recipe``, ``--optimizer muon`` and the
``--muon-*`` flags, the built-in byte corpus when no data is named, and the CPU path.

    python tools/pretrain_gpt.py --recipe tiny_gqa --train-iters 30
    torchrun --nproc-per-node 2 tools/pretrain_gpt.py --recipe tiny_gqa --tensor-model-parallel-size 2
"""

import os

LAUNCHER_PID = os.getppid()  # first: the process that started this one (a rank ties itself to it)
if "RANK" in os.environ:  # a launcher's rank ends with it, even while the imports below run (seconds)
    from megatron_muon.megatron_lm.process_lifetime import tie_to_launcher

    tie_to_launcher(LAUNCHER_PID)

import argparse  # noqa: E402
import sys  # noqa: E402
from functools import partial  # noqa: E402
from typing import List, Optional, Sequence  # noqa: E402

import torch  # noqa: E402

from megatron_muon.megatron_lm import cpu  # noqa: E402

if not cpu.use_cuda():
    # Before Megatron-core is imported: its import-time notices that transformer-engine /
    # Apex are absent are expected without a GPU and would bury a one-line argument error.
    cpu.quiet_missing_extension_notices()

with cpu.plain_fused_functions():  # Megatron-core's first import (seconds less on the CPU)
    from megatron_muon.megatron_lm import corpus
    from megatron_muon.megatron_lm.launch import checkpoint_errors_as_one_line, model_mismatch_as_one_line, prepare
    from megatron_muon.megatron_lm.layer_spec import gpt_model_config

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
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
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
            machine.validate_result(
                result=loss,
                rejection_func=check,
                tolerance=0.0,
                fatal=True,
                message=f"found {what} in local forward loss calculation",
            )
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
    if corpus.uses_builtin_corpus(args):  # ours: no data named
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
# Main
# ---------------------------------------------------------------------------------------


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Our layers and Megatron-LM's arguments (:func:`prepare`), then Megatron-LM's ``pretrain``."""
    from megatron.core.enums import ModelType
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.training import pretrain

    args = prepare(argv)
    config = pretrain_cfg_container_from_args(args, gpt_model_config(args))
    with checkpoint_errors_as_one_line(), model_mismatch_as_one_line():
        pretrain(config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step)
    shut_down_process_groups()
    return 0


def shut_down_process_groups() -> None:
    """Megatron-LM's orderly shutdown (its SIGTERM handler's): a barrier, then every process
    group destroyed. ``pretrain()`` returns with the groups alive; a gloo rank torn down by
    the interpreter with them alive aborts now and then ("terminate called without an active
    exception", SIGABRT), which fails a finished run."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
