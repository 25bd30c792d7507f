"""``main()``: GPT pretraining with Megatron-LM's arguments (``megatron-muon-pretrain``).

Launch as Megatron-LM's ``pretrain_gpt.py``::

    torchrun --nproc-per-node 8 tools/pretrain_gpt.py --recipe llama3_8b --optimizer muon ...
    python tools/pretrain_gpt.py --recipe tiny_gqa --train-iters 30        # CPU, one rank
"""

from __future__ import annotations

import sys
import time
from typing import Optional, Sequence

import torch

from . import arguments, checkpointing, data, distributed, model as model_lib, optim, sizing, training
from .tokenizer import build_tokenizer, padded_vocab_size


def _describe(args, backend: str, vocab_size: int, num_params: int) -> str:
    from megatron.core import parallel_state

    device = torch.cuda.get_device_name() if distributed.use_cuda() else "CPU (gloo harness)"
    return "\n".join([
        f"> megatron-muon pretraining: {args.world_size} rank(s), {backend} on {device}",
        f"> layout: TP={args.tensor_model_parallel_size} PP={args.pipeline_model_parallel_size} "
        f"VPP={args.virtual_pipeline_model_parallel_size or 1} CP={args.context_parallel_size} "
        f"EP={args.expert_model_parallel_size} ETP={args.expert_tensor_parallel_size} DP={args.data_parallel_size}",
        f"> optimizer: {args.optimizer}; global batch {args.global_batch_size} = micro-batch "
        f"{args.micro_batch_size} x {args.num_microbatches} micro-batches x DP {args.data_parallel_size}",
        f"> model: {sizing.count_parameters(args, vocab_size)}; padded vocab size: {vocab_size}",
        f"> data: {data.describe_data(args)}",
        f"> number of parameters on (tensor, pipeline) model parallel rank "
        f"({parallel_state.get_tensor_model_parallel_rank()}, "
        f"{parallel_state.get_pipeline_model_parallel_rank()}): {num_params}",
    ])


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse, build, train, save. Returns the process exit status."""
    start = time.perf_counter()
    args = arguments.parse_args(argv, world_size=distributed.world_size_from_env())
    backend = distributed.init_distributed(args)
    distributed.print_rank_0(arguments.format_args(args))
    try:
        distributed.set_random_seed(args.seed)
        tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_size, args.tokenizer_model)
        if args.vocab_size is not None and args.vocab_size < tokenizer.vocab_size:
            raise ValueError(f"--vocab-size {args.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}")
        vocab_size = padded_vocab_size(
            max(tokenizer.vocab_size, args.vocab_size or 0), args.make_vocab_size_divisible_by,
            args.tensor_model_parallel_size,
        )
        args.padded_vocab_size = vocab_size  # as Megatron-LM; checkpoints record it
        config = model_lib.transformer_config(args)
        model = model_lib.build_model(args, config, vocab_size)
        optimizer = optim.build_optimizer(args, model)
        scheduler = optim.build_scheduler(args, optimizer)
        distributed.print_rank_0(_describe(args, backend, vocab_size, model_lib.count_parameters(model)))
        iteration, consumed = 0, 0
        if args.load:
            iteration, consumed = checkpointing.load_checkpoint(args, model, optimizer, scheduler)
        datasets = data.build_datasets(args, tokenizer)
        distributed.print_rank_0(f"> setup done in {time.perf_counter() - start:.1f} s")

        def save(it: int, samples: int) -> None:
            checkpointing.save_checkpoint(args, it, samples, model, optimizer, scheduler)

        if iteration < args.train_iters:
            iteration, consumed = training.train(
                args, model, optimizer, scheduler, datasets, iteration, consumed,
                save=save if args.save else None,
            )
            if args.save and not (args.save_interval and iteration % args.save_interval == 0):
                save(iteration, consumed)
        training.final_evaluation(args, model, datasets, iteration)
        distributed.print_logging_rank(f"> done: iteration {iteration}, {time.perf_counter() - start:.1f} s")
    finally:
        distributed.destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
