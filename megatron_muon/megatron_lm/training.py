"""The training loop: Megatron-core's pipeline schedule, the optimizer step, evaluation.

The structure is Megatron-LM's ``train`` / ``train_step`` / ``evaluate``: zero the DDP grad
buffers, run ``get_forward_backward_func()`` over the global batch's micro-batches,
``optimizer.step()``, advance the scheduler by the global batch size when the update
succeeded (fp16 overflow skips it), log, evaluate and save at their intervals.
"""

from __future__ import annotations

import argparse
from functools import partial
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .data import MicroBatches, slice_for_context_parallel
from .distributed import print_rank_0, use_cuda
from .metrics import TrainLogger
from .model import unwrap
from .optim import current_lr

LOSS_KEY = "lm loss"


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Masked mean of the per-token cross entropy over the (context-parallel) sequence.

    Backward uses this rank's sum over the global token count, times CP: DDP averages
    gradients over data- and context-parallel ranks, so the CP ranks' parts add up.
    """
    from megatron.core import parallel_state

    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    local_sum = torch.sum(losses * mask)
    stats = torch.stack([local_sum.detach(), mask.sum()])
    cp = parallel_state.get_context_parallel_world_size()
    if cp > 1:
        torch.distributed.all_reduce(stats, group=parallel_state.get_context_parallel_group())
    count = stats[1].clamp(min=1.0)
    return local_sum / count * cp, {LOSS_KEY: stats[0] / count}


def forward_step(data_iterator, model):
    """Megatron's forward-step contract: ``(output, loss_func)`` for one micro-batch."""
    batch = slice_for_context_parallel(next(data_iterator))
    if use_cuda():
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def _reduce_losses(losses: List[Dict[str, torch.Tensor]]) -> Dict[str, float]:
    """Mean over micro-batches and data-parallel ranks (meaningful on the last stage)."""
    from megatron.core import parallel_state

    if not losses or not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return {}
    out = {}
    for key in losses[0]:
        value = torch.stack([x[key].float() for x in losses]).mean().reshape(1)
        group = parallel_state.get_data_parallel_group()
        torch.distributed.all_reduce(value, group=group)
        out[key] = float(value[0]) / group.size()
    return out


def setup_model_config(args: argparse.Namespace, model: List[torch.nn.Module], optimizer) -> None:
    """The callbacks Megatron-LM installs on the model config for its schedules."""
    from megatron.core.distributed import finalize_model_grads

    config = unwrap(model[0]).config
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    if args.overlap_grad_reduce:
        no_sync = [chunk.no_sync for chunk in model]
        config.no_sync_func = no_sync[0] if len(model) == 1 else no_sync


def _attention_layers(model: List[torch.nn.Module]):
    for chunk in model:
        for layer in getattr(unwrap(chunk).decoder, "layers", []):
            yield layer.self_attention


def max_attention_logit(model: List[torch.nn.Module], reset: bool) -> Optional[float]:
    """The largest pre-softmax attention logit of this step over all layers and ranks
    (from ``core_attention.current_max_attn_logits``); ``None`` when nothing recorded it."""
    local = torch.full((1,), float("-inf"), device="cuda" if use_cuda() else "cpu")
    for attn in _attention_layers(model):
        logits = getattr(attn.core_attention, "current_max_attn_logits", None)
        if logits is not None:
            local = torch.maximum(local, logits.detach().float().max().reshape(1).to(local.device))
            if reset:
                attn.core_attention.current_max_attn_logits = None
    torch.distributed.all_reduce(local, op=torch.distributed.ReduceOp.MAX)
    value = float(local[0])
    return value if value != float("-inf") else None


def apply_megatron_qk_clip(model: List[torch.nn.Module]) -> None:
    """Megatron-core's QK-Clip on the model weights (for optimizers without their own):
    per-head max logits all-reduced over data/context parallel ranks, then each attention
    layer's ``clip_qk()``."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    with torch.no_grad():
        for attn in _attention_layers(model):
            logits = getattr(attn.core_attention, "current_max_attn_logits", None)
            if logits is None or not hasattr(attn, "clip_qk"):
                continue
            torch.distributed.all_reduce(logits, op=torch.distributed.ReduceOp.MAX, group=group)
            attn.clip_qk()


def _optimizer_handles_logits(optimizer) -> bool:
    """megatron_muon's optimizer reads the recorded max logits itself in ``step()`` (QK-Clip
    on its fp32 master shards, and the value to log), then resets them. For other
    optimizers this loop reads them and, with ``--qk-clip``, runs Megatron's ``clip_qk`` on
    the model weights after the step, as Megatron-LM does."""
    return getattr(optimizer, "qk_clip", None) is not None or bool(getattr(optimizer, "applies_qk_clip", False))


def reset_attention_logits(model: List[torch.nn.Module]) -> None:
    for attn in _attention_layers(model):
        if getattr(attn.core_attention, "current_max_attn_logits", None) is not None:
            attn.core_attention.current_max_attn_logits = None


def train_step(args, model, optimizer, data_iterators) -> Tuple[Dict[str, float], bool, Optional[float], Optional[float]]:
    """One global batch. Returns ``(losses, update_successful, grad_norm, max_logit)``."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data_iterators if len(model) > 1 else data_iterators[0],
        model=model,
        num_microbatches=args.num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        forward_only=False,
    )
    want_logit = args.qk_clip or args.log_max_attention_logit
    if _optimizer_handles_logits(optimizer):
        update_successful, grad_norm, _ = optimizer.step()
        max_logit = getattr(optimizer, "max_attention_logit", None) if want_logit else None
    else:
        max_logit = max_attention_logit(model, reset=not args.qk_clip) if want_logit else None
        update_successful, grad_norm, _ = optimizer.step()
        if args.qk_clip:
            apply_megatron_qk_clip(model)
    norm = float(grad_norm) if grad_norm is not None else None
    return _reduce_losses(losses), bool(update_successful), norm, max_logit


@torch.no_grad()
def evaluate(args, model, dataset, dp_rank: int, dp_size: int) -> Dict[str, float]:
    """Mean loss over ``--eval-iters`` global batches of ``dataset`` (from its start)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in model:
        chunk.eval()
    iters = [MicroBatches(dataset, 0, args.micro_batch_size, dp_rank, dp_size, cycle=True) for _ in model]
    totals: Dict[str, float] = {}
    for _ in range(args.eval_iters):
        losses = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iters if len(model) > 1 else iters[0],
            model=model,
            num_microbatches=args.num_microbatches,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            forward_only=True,
        )
        for k, v in _reduce_losses(losses).items():
            totals[k] = totals.get(k, 0.0) + v
    reset_attention_logits(model)  # evaluation logits must not reach the next step's QK-Clip
    for chunk in model:
        chunk.train()
    return {k: v / args.eval_iters for k, v in totals.items()}


def train(
    args: argparse.Namespace,
    model: List[torch.nn.Module],
    optimizer,
    scheduler,
    datasets: Sequence,
    start_iteration: int,
    consumed_samples: int,
    save: Optional[Callable[[int, int], None]] = None,
) -> Tuple[int, int]:
    """Train from ``start_iteration`` to ``--train-iters``. Returns ``(iteration, consumed_samples)``."""
    from megatron.core import parallel_state

    train_ds, valid_ds = datasets[0], datasets[1]
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    setup_model_config(args, model, optimizer)
    iterators = [
        MicroBatches(train_ds, consumed_samples, args.micro_batch_size, dp_rank, dp_size, cycle=True) for _ in model
    ]
    logger = TrainLogger(args)
    iteration = start_iteration
    for chunk in model:
        chunk.train()
    print_rank_0(f"training from iteration {iteration} to {args.train_iters} ...")
    if iteration == 0 and args.eval_interval and args.eval_iters and valid_ds is not None:
        # Where the validation loss starts, so the first evaluation has something to beat.
        logger.record_eval(0, evaluate(args, model, valid_ds, dp_rank, dp_size), "validation")
    while iteration < args.train_iters:
        losses, ok, grad_norm, max_logit = train_step(args, model, optimizer, iterators)
        iteration += 1
        consumed_samples += args.global_batch_size
        if ok:
            scheduler.step(increment=args.global_batch_size)
        logger.record(
            iteration, consumed_samples, losses, current_lr(optimizer), grad_norm,
            float(optimizer.get_loss_scale()), skipped=not ok, max_logit=max_logit,
        )
        if args.eval_interval and args.eval_iters and valid_ds is not None and iteration % args.eval_interval == 0:
            logger.record_eval(iteration, evaluate(args, model, valid_ds, dp_rank, dp_size), "validation")
        if save is not None and args.save_interval and iteration % args.save_interval == 0:
            save(iteration, consumed_samples)
        if args.exit_interval and iteration % args.exit_interval == 0:
            print_rank_0(f"exiting at iteration {iteration} (--exit-interval)")
            break
    logger.close()
    return iteration, consumed_samples


def final_evaluation(args, model, datasets: Sequence, iteration: int) -> None:
    """Megatron-LM's evaluation after training, on the validation and test splits."""
    from megatron.core import parallel_state

    if not args.eval_iters:
        return
    logger = TrainLogger(argparse.Namespace(**{**vars(args), "tensorboard_dir": None}))
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    for label, dataset in (("validation", datasets[1]), ("test", datasets[2])):
        if dataset is not None and len(dataset) > 0:
            logger.record_eval(iteration, evaluate(args, model, dataset, dp_rank, dp_size), f"{label} (end of training)")
    logger.close()
