"""Megatron-LM's command-line arguments (the subset this driver implements), same names,
defaults and meaning as Megatron-LM's ``megatron/training/arguments.py``.

``parse_args(argv)`` applies a ``--recipe`` first (a YAML of the same flags), then the
command line, then derives what Megatron-LM derives (``ffn_hidden_size``, ``kv_channels``,
query groups, virtual pipeline size, global batch size...) and checks the combination.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import List, Optional, Sequence

import torch

from . import muon_args, recipes


def moe_freq_type(value: str):
    """``--moe-layer-freq``: an int N (one MoE layer every N) or a Python list expression
    such as ``'([0]*3+[1]*58)'`` (0 dense, 1 MoE), as in Megatron-LM."""
    text = str(value).strip().strip("'\"")
    if "[" in text:
        pattern = eval(text, {"__builtins__": {}}, {})  # noqa: S307 - list arithmetic only
        if not isinstance(pattern, list) or any(x not in (0, 1) for x in pattern):
            raise argparse.ArgumentTypeError(f"--moe-layer-freq {value!r} must give a list of 0/1")
        return pattern
    return int(text)


def _model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    a = g.add_argument
    a("--num-layers", type=int, default=None)
    a("--hidden-size", type=int, default=None)
    a("--ffn-hidden-size", type=int, default=None, help="default: 4h, or 8h/3 rounded to 64 with --swiglu")
    a("--num-attention-heads", type=int, default=None)
    a("--group-query-attention", action="store_true")
    a("--num-query-groups", type=int, default=1)
    a("--kv-channels", type=int, default=None, help="default: hidden-size / num-attention-heads")
    a("--seq-length", type=int, default=None)
    a("--max-position-embeddings", type=int, default=None, help="default: seq-length")
    a("--swiglu", action="store_true")
    a("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    a("--norm-epsilon", type=float, default=1e-5)
    a("--position-embedding-type", default="learned_absolute", choices=["learned_absolute", "rope", "none"])
    a("--rotary-base", type=int, default=10000)
    a("--rotary-percent", type=float, default=1.0)
    a("--rotary-interleaved", action="store_true")
    a("--rope-type", default=None, choices=["rope", "yarn"], help="MLA uses yarn by default")
    a("--rotary-scaling-factor", type=float, default=1.0)
    a("--mscale", type=float, default=1.0)
    a("--mscale-all-dim", type=float, default=0.0)
    a("--untie-embeddings-and-output-weights", action="store_true")
    a("--disable-bias-linear", dest="add_bias_linear", action="store_false")
    a("--add-qkv-bias", action="store_true")
    a("--qk-layernorm", action="store_true")
    a("--init-method-std", type=float, default=0.02)
    a("--hidden-dropout", type=float, default=0.1)
    a("--attention-dropout", type=float, default=0.1)
    a("--vocab-size", type=int, default=None,
      help="model vocabulary (>= the tokenizer's); default: the tokenizer's")
    a("--make-vocab-size-divisible-by", type=int, default=128)
    a("--transformer-impl", default=None, choices=["local", "transformer_engine"],
      help="default: transformer_engine if installed and on GPU, else local")
    g = parser.add_argument_group("mixture of experts")
    a = g.add_argument
    a("--num-experts", type=int, default=None)
    a("--moe-layer-freq", type=moe_freq_type, default=1)
    a("--moe-router-topk", type=int, default=2)
    a("--moe-ffn-hidden-size", type=int, default=None)
    a("--moe-shared-expert-intermediate-size", type=int, default=None)
    a("--moe-grouped-gemm", action="store_true")
    a("--moe-token-dispatcher-type", default="allgather", choices=["allgather", "alltoall", "flex"])
    a("--moe-router-load-balancing-type", default="aux_loss",
      choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"])
    a("--moe-aux-loss-coeff", type=float, default=0.0)
    a("--moe-z-loss-coeff", type=float, default=None)
    a("--moe-router-score-function", default="softmax", choices=["softmax", "sigmoid"])
    a("--moe-router-topk-scaling-factor", type=float, default=None)
    a("--moe-router-enable-expert-bias", action="store_true")
    a("--moe-router-bias-update-rate", type=float, default=1e-3)
    a("--moe-router-num-groups", type=int, default=None)
    a("--moe-router-group-topk", type=int, default=None)
    a("--moe-router-pre-softmax", action="store_true")
    a("--moe-router-dtype", default=None, choices=["fp32", "fp64"])
    a("--moe-permute-fusion", action="store_true")
    a("--moe-expert-capacity-factor", type=float, default=None)
    g = parser.add_argument_group("multi-latent attention")
    a = g.add_argument
    a("--multi-latent-attention", action="store_true")
    a("--q-lora-rank", type=int, default=None)
    a("--kv-lora-rank", type=int, default=32)
    a("--qk-head-dim", type=int, default=128)
    a("--qk-pos-emb-head-dim", type=int, default=64)
    a("--v-head-dim", type=int, default=128)
    g = parser.add_argument_group("QK-Clip (TransformerConfig fields)")
    a = g.add_argument
    a("--qk-clip", action="store_true", help="MuonClip: clip W_q/W_k rows of heads whose max logit exceeds the threshold")
    a("--qk-clip-threshold", type=float, default=100.0)
    a("--qk-clip-alpha", type=float, default=0.5)
    a("--log-max-attention-logit", action="store_true")


def _parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallelism")
    a = g.add_argument
    a("--tensor-model-parallel-size", type=int, default=1)
    a("--pipeline-model-parallel-size", type=int, default=1)
    a("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    a("--virtual-pipeline-model-parallel-size", type=int, default=None)
    a("--decoder-first-pipeline-num-layers", type=int, default=None)
    a("--decoder-last-pipeline-num-layers", type=int, default=None)
    a("--expert-model-parallel-size", type=int, default=1)
    a("--expert-tensor-parallel-size", type=int, default=None)
    a("--context-parallel-size", type=int, default=1)
    a("--sequence-parallel", action="store_true")
    a("--use-distributed-optimizer", action="store_true",
      help="accepted; always on (except --optimizer sgd, which Megatron-core's DistributedOptimizer rejects)")
    a("--overlap-grad-reduce", action="store_true")
    a("--overlap-param-gather", action="store_true", help="accepted; not overlapped by this driver")
    a("--accumulate-allreduce-grads-in-fp32", action="store_true")
    a("--ddp-bucket-size", type=int, default=None)
    a("--distributed-backend", default=None, choices=["nccl", "gloo"], help="default: nccl on GPU, gloo on CPU")
    a("--distributed-timeout-minutes", type=int, default=10)


def _training_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    a = g.add_argument
    a("--micro-batch-size", type=int, default=None)
    a("--global-batch-size", type=int, default=None, help="default: micro-batch-size x data-parallel size")
    a("--train-iters", type=int, default=None)
    a("--exit-interval", type=int, default=None)
    a("--optimizer", default="adam", choices=["adam", "sgd", "muon"])
    a("--lr", type=float, default=None)
    a("--min-lr", type=float, default=0.0)
    a("--lr-decay-style", default="linear", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    a("--lr-decay-iters", type=int, default=None, help="default: train-iters")
    a("--lr-wsd-decay-style", default="exponential", choices=["exponential", "linear", "cosine", "minus_sqrt"])
    a("--lr-wsd-decay-iters", type=int, default=None)
    a("--lr-warmup-iters", type=int, default=0)
    a("--lr-warmup-fraction", type=float, default=None)
    a("--lr-warmup-init", type=float, default=0.0)
    a("--weight-decay", type=float, default=0.01)
    a("--start-weight-decay", type=float, default=None)
    a("--end-weight-decay", type=float, default=None)
    a("--weight-decay-incr-style", default="constant", choices=["constant", "linear", "cosine"])
    a("--clip-grad", type=float, default=1.0)
    a("--adam-beta1", type=float, default=0.9)
    a("--adam-beta2", type=float, default=0.999)
    a("--adam-eps", type=float, default=1e-8)
    a("--sgd-momentum", type=float, default=0.9)
    a("--bf16", action="store_true")
    a("--fp16", action="store_true")
    a("--loss-scale", type=float, default=None)
    a("--initial-loss-scale", type=float, default=2**32)
    a("--min-loss-scale", type=float, default=1.0)
    a("--loss-scale-window", type=float, default=1000)
    a("--hysteresis", type=int, default=2)
    a("--seed", type=int, default=1234)


def _data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data")
    a = g.add_argument
    a("--mock-data", action="store_true")
    a("--data-path", nargs="*", default=None, help="[weight] prefix [weight prefix ...] of .bin/.idx datasets")
    a("--split", default=None, help="train,valid,test weights; default 969,30,1 (98,2,0 for the stdlib corpus)")
    a("--data-cache-path", default=None, help="default: ~/.cache/megatron_muon (or $MEGATRON_MUON_CACHE)")
    a("--tokenizer-type", default="ByteTokenizer", choices=["ByteTokenizer", "NullTokenizer", "HuggingFaceTokenizer"])
    a("--tokenizer-model", default=None, help="local Hugging Face tokenizer (HuggingFaceTokenizer)")
    a("--num-workers", type=int, default=0, help="accepted; data is read in the training process")
    a("--reset-position-ids", action="store_true")
    a("--reset-attention-mask", action="store_true")
    a("--eod-mask-loss", action="store_true")


def _io_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpointing")
    a = g.add_argument
    a("--save", default=None)
    a("--load", default=None)
    a("--save-interval", type=int, default=None)
    a("--ckpt-step", type=int, default=None, help="load this iteration instead of the latest")
    a("--ckpt-format", default=None, choices=["torch", "torch_dist"],
      help="torch_dist (default with --optimizer muon): reshardable, loads into any parallel layout; "
           "torch (default otherwise): per-rank files, same-layout resume. Loading detects the format.")
    a("--no-save-optim", action="store_true")
    a("--no-load-optim", action="store_true")
    a("--no-load-rng", action="store_true")
    a("--finetune", action="store_true", help="load weights only; restart at iteration 0")
    g = parser.add_argument_group("logging")
    a = g.add_argument
    a("--log-interval", type=int, default=100)
    a("--eval-interval", type=int, default=1000)
    a("--eval-iters", type=int, default=100)
    a("--tensorboard-dir", default=None)
    a("--log-throughput", action="store_true", help="accepted; tokens/s is always logged")
    a("--metrics-file", default=None, help="also write every logged value, full precision, as JSON lines")


def build_parser() -> argparse.ArgumentParser:
    """The full parser (without recipe handling; see :func:`parse_args`)."""
    parser = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        usage="%(prog)s [--recipe NAME|FILE] [Megatron-LM flags ...]  (--help lists them)",
        description="Megatron-core GPT pretraining with Megatron-LM's arguments; --optimizer muon "
        "uses megatron_muon's exact distributed Muon.",
        allow_abbrev=False,
    )
    parser.add_argument("--recipe", default=None, help="recipe NAME (recipes/NAME.yaml) or YAML FILE; flags override it")
    for add in (_model_args, _parallel_args, _training_args, _data_args, _io_args):
        add(parser)
    _add_negations(parser)
    muon_args.add_muon_arguments(parser)
    return parser


def _add_negations(parser: argparse.ArgumentParser) -> None:
    """``--no-X`` for every switch ``--X`` (not in Megatron-LM; lets the command line turn
    off a switch a recipe turned on, e.g. ``--recipe deepseek_v3 --no-qk-clip``)."""
    group = parser.add_argument_group("negations", "--no-X turns off the switch --X (e.g. one set by a recipe)")
    for action in list(parser._actions):  # noqa: SLF001 - argparse offers no public listing
        if not isinstance(action, argparse._StoreTrueAction):  # noqa: SLF001
            continue
        flag = action.option_strings[0]
        if flag.startswith("--no-"):
            continue
        group.add_argument("--no-" + flag[2:], dest=action.dest, action="store_false", help=argparse.SUPPRESS)


def parse_args(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None) -> argparse.Namespace:
    """Recipe, then command line, then Megatron-LM's derived values and checks.

    ``world_size`` (default: ``$WORLD_SIZE`` or 1) is needed for the data-parallel size.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    recipe = _find_recipe_flag(argv)
    recipe_argv: List[str] = []
    if recipe is not None:
        try:
            recipe_argv = recipes.recipe_to_argv(recipes.load_recipe(recipe), parser)
        except (recipes.RecipeError, OSError) as exc:
            parser.error(str(exc))
    args = parser.parse_args(recipe_argv + argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        derive_and_validate(args, world_size)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def _find_recipe_flag(argv: Sequence[str]) -> Optional[str]:
    value = None
    for i, token in enumerate(argv):
        if token == "--recipe" and i + 1 < len(argv):
            value = argv[i + 1]
        elif token.startswith("--recipe="):
            value = token.split("=", 1)[1]
    return value


def derive_and_validate(args: argparse.Namespace, world_size: int) -> None:
    """Fill Megatron-LM's derived defaults in place; raise ``ValueError`` on bad combinations."""
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "train_iters"):
        if getattr(args, name) is None:
            raise ValueError(f"--{name.replace('_', '-')} is required (on the command line or in the recipe)")
    if args.lr is None:
        raise ValueError("--lr is required")
    if args.bf16 and args.fp16:
        raise ValueError("--bf16 and --fp16 are mutually exclusive")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64 if args.swiglu else 4 * args.hidden_size
    if args.kv_channels is None:
        if args.hidden_size % args.num_attention_heads:
            raise ValueError("--hidden-size must be divisible by --num-attention-heads (or set --kv-channels)")
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    if args.num_attention_heads % args.num_query_groups:
        raise ValueError("--num-attention-heads must be a multiple of --num-query-groups")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.num_experts is not None and args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    if args.num_experts is None and args.expert_model_parallel_size > 1:
        raise ValueError("--expert-model-parallel-size > 1 needs --num-experts")
    if args.num_experts is not None and args.num_experts % args.expert_model_parallel_size:
        raise ValueError("--num-experts must be divisible by --expert-model-parallel-size")
    if isinstance(args.moe_layer_freq, list) and len(args.moe_layer_freq) != args.num_layers:
        raise ValueError(f"--moe-layer-freq lists {len(args.moe_layer_freq)} layers, --num-layers is {args.num_layers}")
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if world_size % (tp * pp * cp):
        raise ValueError(f"world size {world_size} is not divisible by TP x PP x CP = {tp * pp * cp}")
    args.world_size = world_size
    args.data_parallel_size = world_size // (tp * pp * cp)
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp
    if args.num_layers_per_virtual_pipeline_stage is not None:
        if args.num_layers % (pp * args.num_layers_per_virtual_pipeline_stage):
            raise ValueError("--num-layers must be divisible by PP x --num-layers-per-virtual-pipeline-stage")
        args.virtual_pipeline_model_parallel_size = args.num_layers // pp // args.num_layers_per_virtual_pipeline_stage
        if args.virtual_pipeline_model_parallel_size == 1:
            args.virtual_pipeline_model_parallel_size = None
    if args.virtual_pipeline_model_parallel_size is not None and pp == 1:
        raise ValueError("virtual pipeline stages need --pipeline-model-parallel-size > 1")
    if tp == 1:
        args.sequence_parallel = False
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step:
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} is not a multiple of micro-batch-size x "
            f"data-parallel size = {per_step}"
        )
    args.num_microbatches = args.global_batch_size // per_step
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:
        args.lr_warmup_iters = int(math.floor(args.lr_warmup_fraction * args.lr_decay_iters))
    if args.lr_warmup_iters >= args.lr_decay_iters:
        raise ValueError(
            f"--lr-warmup-iters ({args.lr_warmup_iters}) must be smaller than --lr-decay-iters "
            f"({args.lr_decay_iters}; default --train-iters)"
        )
    if args.start_weight_decay is None:
        args.start_weight_decay = args.weight_decay
    if args.end_weight_decay is None:
        args.end_weight_decay = args.weight_decay
    if args.data_path and args.mock_data:
        raise ValueError("--mock-data and --data-path are mutually exclusive")
    if args.ckpt_format is None:
        args.ckpt_format = "torch_dist" if args.optimizer == "muon" else "torch"
    if args.ckpt_format == "torch_dist" and args.no_save_optim:
        raise ValueError("--no-save-optim: torch_dist checkpoints always hold the optimizer state; "
                         "use --ckpt-format torch for weights-only saves")
    if args.ckpt_format == "torch_dist" and args.optimizer != "muon":
        raise ValueError(
            f"--ckpt-format torch_dist saves Muon's reshardable optimizer state; with --optimizer "
            f"{args.optimizer} use --ckpt-format torch (per-rank files, same-layout resume)"
        )
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
    # Megatron-core's DistributedOptimizer takes only Adam-like optimizers (0.19: it asserts
    # on SGD), so SGD runs on Megatron's non-distributed optimizer, as in Megatron-LM.
    args.use_distributed_optimizer = args.optimizer != "sgd"
    args.params_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def format_args(args: argparse.Namespace) -> str:
    """Megatron-LM's start-up listing of every argument."""
    lines = ["------------------------ arguments ------------------------"]
    for key in sorted(vars(args)):
        value = getattr(args, key)
        lines.append(f"  {key} {'.' * max(1, 48 - len(key))} {value}")
    lines.append("-------------------- end of arguments ---------------------")
    return "\n".join(lines)
