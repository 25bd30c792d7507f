"""Route ``--optimizer muon`` to megatron_muon inside Megatron-LM's own ``pretrain_gpt.py``.

With a Megatron-LM checkout, call this before ``parse_and_validate_args`` (right after the
imports of its ``pretrain_gpt.py``)::

    from megatron_muon.megatron_lm.integration import use_megatron_muon
    use_megatron_muon()

then launch as before with ``--optimizer muon --use-distributed-optimizer`` and any
``--muon-*`` flag; ``--muon-impl megatron`` selects Megatron-core's own Muon. The wrappers
replace module globals Megatron-LM looks up at call time: arguments, validation, optimizer
factory, ``clip_qk``, ``calc_params_l2_norm`` and DDP construction here, checkpoint saves and loads
in ``checkpoint_guards``.
docs/design.md ("Inside Megatron-LM") maps each one to the Megatron-LM lines it relies on.

Megatron-LM's own ``--muon-*`` flags are reused; a value counts only when given on the
command line (else MuonConfig's default: exact TP mode, Nesterov, 'moonlight' scale). Our
coefficient names differ: ``quintic`` is Keller Jordan's set (Megatron's ``simple``),
Megatron's ``quintic`` schedule is our ``megatron_quintic``. Checkpoints are torch_dist;
Megatron-LM refuses a TP/PP change on load unless the save had
``--dist-ckpt-optim-fully-reshardable`` (a metadata label: our state reshards anyway).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import inspect
import re
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

from megatron_muon import patching
from megatron_muon.checkpoint import formats
from megatron_muon.checkpoint.format import CheckpointFormat
from megatron_muon.config import SCALAR_OPTIMIZERS, SCALE_MODES, TP_MODES, MuonConfig
from megatron_muon.factory import get_muon_optimizer
from megatron_muon.storage import DistributedOptimizerStorage, MegatronFSDPStorage
from megatron_muon.storage.megatron_fsdp import fix_gradient_accumulation_on_single_rank_groups
from megatron_muon.support import Settings, refusals

from . import muon_args, patches
from .patches import ITERATION_LINE_SCOPE, VALIDATION_SCOPE

__all__ = ["use_megatron_muon", "add_muon_arguments", "muon_config_from_megatron", "check_supported"]

IMPLS = ("megatron_muon", "megatron")
UNSET = "megatron_muon_unset"
"""Namespace attribute: fields whose Megatron-LM flag was not given (MuonConfig default applies)."""
_OUR_CHOICES = {"muon_tp_mode": TP_MODES, "muon_scale_mode": SCALE_MODES, "muon_scalar_optimizer": SCALAR_OPTIMIZERS}
_MEGATRON_CHOICES: Dict[str, Tuple[str, ...]] = {}
"""Megatron-LM's own choices of the flags whose choices we extended."""


class _RecordsGiven:
    """Mixin for an existing argparse action: giving the option removes its dest from UNSET."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, UNSET, [n for n in getattr(namespace, UNSET, []) if n != self.dest])
        super().__call__(parser, namespace, values, option_string)  # type: ignore[misc]


def add_muon_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--muon-impl`` and the ``--muon-*`` flags Megatron-LM lacks; returns ``parser``.

    Usable as (or inside) Megatron-LM's ``extra_args_provider``; a second call is a no-op.
    """
    if "--muon-impl" in parser._option_string_actions:
        return parser
    fields = [f.name for f in muon_args.muon_fields()]
    reused = sorted({a.dest for a in parser._actions} & set(fields))
    muon_args.add_muon_arguments(parser, reuse_existing=True)
    megatron_muon_group(parser).add_argument(
        "--muon-impl",
        choices=IMPLS,
        default="megatron_muon",
        help="Which Muon --optimizer muon builds: 'megatron_muon' (exact distributed Muon, "
        "megatron_muon.get_muon_optimizer; needs --use-distributed-optimizer) or 'megatron' "
        "(Megatron-core's own). Default: megatron_muon.",
    )
    recording: Dict[type, type] = {}
    for action in parser._actions:
        if action.dest not in reused:
            continue
        cls = type(action)
        if not issubclass(cls, _RecordsGiven):
            action.__class__ = recording.setdefault(cls, type(cls.__name__, (_RecordsGiven, cls), {}))
        if action.choices is not None and action.dest in _OUR_CHOICES:
            _MEGATRON_CHOICES[action.dest] = tuple(action.choices)
            action.choices = list(action.choices) + [c for c in _OUR_CHOICES[action.dest] if c not in action.choices]
    escape_unformattable_help(parser)
    missing = [f for f in set(fields) - set(muon_args.non_cli_fields()) if f not in {a.dest for a in parser._actions}]
    if missing:
        raise RuntimeError(f"megatron_muon: no command-line flag reaches MuonConfig fields {missing} (a flag clash?).")
    parser.set_defaults(**{UNSET: reused})
    return parser


def megatron_muon_group(parser: argparse.ArgumentParser):
    """The parser's ``megatron_muon`` argument group (made on first use): our flags that are
    not ``MuonConfig`` fields (``--muon-impl``, ``--recipe``) are listed together."""
    for group in parser._action_groups:
        if group.title == "megatron_muon":
            return group
    return parser.add_argument_group("megatron_muon")


def escape_unformattable_help(parser: argparse.ArgumentParser) -> None:
    """Make every help string survive argparse's ``%``-formatting (``--help``).

    megatron-core 0.19.2's help for ``--moe-paged-stash-buffer-size-factor-cuda`` has a bare
    ``%``, so Megatron-LM's ``--help`` fails with "unsupported format character". A help
    string that does not format is escaped (every ``%`` not starting ``%(name)s``
    doubled); the others are left as they are."""
    for action in parser._actions:
        if not isinstance(action.help, str) or "%" not in action.help:
            continue
        try:
            action.help % dict(vars(action), prog=parser.prog)
        except (ValueError, TypeError, KeyError):
            action.help = re.sub(r"%(?!\()", "%%", action.help)


def _optimizer_fields(source: Any) -> Dict[str, Any]:
    """The non-Muon fields of Megatron's ``OptimizerConfig`` that ``source`` has."""
    from megatron.core.optimizer import OptimizerConfig

    return {
        f.name: getattr(source, f.name)
        for f in dataclasses.fields(OptimizerConfig)
        if f.init and not f.name.startswith("muon_") and hasattr(source, f.name)
    }


def muon_config_from_megatron(args: argparse.Namespace) -> MuonConfig:
    """``MuonConfig`` from Megatron-LM's parsed arguments: non-Muon fields as Megatron's
    ``get_megatron_optimizer_config`` reads them, ``muon_*`` fields from the flags given
    (MuonConfig's defaults for Megatron-LM flags left unset)."""
    kw = _optimizer_fields(args)
    unset = set(getattr(args, UNSET, ()))
    kw.update({k: v for k, v in muon_args.muon_kwargs(args).items() if k not in unset})
    kw.update(optimizer="muon", use_layer_wise_distributed_optimizer=False)
    return MuonConfig(**kw)


def record_effective_settings(args: argparse.Namespace, config: MuonConfig) -> None:
    """Write the Muon settings that run into Megatron-LM's arguments, which its argument
    listing, TensorBoard's text and the W&B config record: every command-line ``muon_*``
    field of ``config`` (a Megatron-LM flag left unset holds Megatron-core's Muon default
    there, not the value our optimizer uses), and ``muon_step_overlap`` as 'auto' resolves
    it ('forward' or 'none'; the optimizer decides the same from the DDP settings these
    arguments make)."""
    from megatron_muon.pipeline import step_overlap_for

    kinds = set(muon_args.non_cli_fields())
    for f in muon_args.muon_fields():
        if f.name not in kinds:
            setattr(args, f.name, getattr(config, f.name))
    if hasattr(args, "overlap_param_gather"):  # Megatron-LM's DDP settings (a stand-in parser may lack them)
        args.muon_step_overlap = step_overlap_for(config, [args], _storage(args))


def with_optimizer_config(muon_config: MuonConfig, base: Any) -> MuonConfig:
    """``muon_config`` with the non-Muon fields of the ``OptimizerConfig`` Megatron-LM built
    (``base``: timers, lr, ... as its training setup filled them in)."""
    kw = _optimizer_fields(base)
    kw.update(optimizer="muon", use_layer_wise_distributed_optimizer=False)
    return dataclasses.replace(muon_config, **kw)


def _ours(args: argparse.Namespace) -> bool:
    """Whether ``--optimizer muon`` (or ``dist_muon``) is meant for megatron_muon."""
    return getattr(args, "optimizer", None) in ("muon", "dist_muon") and getattr(args, "muon_impl", None) == IMPLS[0]


def _storage(args: argparse.Namespace) -> type:
    """The storage backend a run's arguments choose (Megatron-FSDP or the distributed optimizer)."""
    return MegatronFSDPStorage if getattr(args, "use_megatron_fsdp", False) else DistributedOptimizerStorage


def _checkpoint_format(args: argparse.Namespace) -> CheckpointFormat:
    """The one checkpoint format of a run: its storage backend's (fsdp_dtensor on
    Megatron-FSDP, else torch_dist)."""
    return _storage(args).checkpoint_format


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Megatron-LM's arguments, before its validation, as the support matrix reads them
    (``support.Settings``): the optimizer's and the engine's settings carry the same names,
    read as what they will become: no precision-aware optimizer with ``--optimizer-cpu-offload``
    (Megatron-LM demands one for its own offload; :func:`_as_ours` drops it), and
    ``--megatron-fsdp-main-params-dtype auto`` as the None its validation maps it to."""
    view = argparse.Namespace(**vars(args))
    view.use_precision_aware_optimizer = getattr(args, "use_precision_aware_optimizer", False) and not getattr(
        args, "optimizer_cpu_offload", False
    )
    if getattr(args, "megatron_fsdp_main_params_dtype", None) == "auto":
        view.megatron_fsdp_main_params_dtype = None
    return Settings(view, (view,))


NO_PARAM_GROUP_MAP = "does not support --dump-param-to-param-group-map: drop it"
WHO = "megatron_muon (--optimizer muon --muon-impl megatron_muon)"


def check_supported(args: argparse.Namespace) -> None:
    """Raise ``ValueError`` (naming the flag and the fix) for what megatron_muon cannot run:
    the support matrix (``support.refusals``, as ``get_muon_optimizer`` reads it), and what
    only the command line can ask for."""

    def on(name: str, default: Any = False) -> Any:
        return getattr(args, name, default)

    if args.optimizer == "dist_muon":
        raise ValueError(
            f"{WHO} --optimizer dist_muon is deprecated: use --optimizer muon --use-distributed-optimizer."
        )
    for refusal in refusals(settings_from_args(args), _storage(args)):
        raise ValueError(f"{WHO}: {refusal}.")
    runs = _checkpoint_format(args)
    asked = formats.named(getattr(args, "ckpt_format", None))
    problems = [
        (
            on("use_torch_fsdp2"),
            "does not support Torch FSDP2 (nor does Megatron-LM's distributed optimizer): use --use-megatron-fsdp",
        ),
        (on("dump_param_to_param_group_map", None) is not None, NO_PARAM_GROUP_MAP),
        (
            any(on(k, None) for k in ("save", "load", "pretrained_checkpoint")) and not runs.requested_by(args),
            f"saves and loads only --ckpt-format {runs.name} {runs.engine} (got {on('ckpt_format', None)!r}): use it",
        ),
        (
            on("async_save") and asked is not None and not asked.async_save,
            f"saves {on('ckpt_format', None)} checkpoints synchronously only (the async writer bypasses the staging "
            "directory and manifest): drop --async-save",
        ),
        (
            on("async_save") and not _on_a_gpu(),
            "saves synchronously on the CPU: a save hands the writer the optimizer's own state tensors, which "
            "Megatron-core's writer copies off a GPU before the save returns but on the CPU writes while training "
            "goes on (a checkpoint of two iterations): drop --async-save",
        ),
    ]
    for bad, why in problems:
        if bad:
            raise ValueError(f"{WHO} {why}.")


def _on_a_gpu() -> bool:
    from .cpu import use_cuda

    return use_cuda()


def _check_megatron_choices(args: argparse.Namespace) -> None:
    """``--optimizer muon --muon-impl megatron`` (Megatron-core's Muon): our flags' values it
    lacks, and the precisions it cannot run, refused in one line."""
    if getattr(args, "optimizer", None) not in ("muon", "dist_muon"):
        return
    if not getattr(args, "bf16", False):
        # megatron-core 0.19.2 wraps its Muon in a mixed-precision optimizer only for bf16:
        # in fp32 the step fails (no get_loss_scale), and fp16 it refuses itself.
        raise ValueError(
            "megatron_muon: --muon-impl megatron (Megatron-core's Muon) runs only with --bf16 in megatron-core "
            "0.19.2: add --bf16, or use --muon-impl megatron_muon (any precision)"
        )
    for dest, allowed in _MEGATRON_CHOICES.items():
        value = getattr(args, dest, None)
        if value is not None and value not in allowed and dest not in getattr(args, UNSET, ()):
            flag = muon_args.flag_name(dest)
            raise ValueError(
                f"megatron_muon: {flag} {value} exists only with --muon-impl megatron_muon; "
                f"Megatron-core's Muon accepts {list(allowed)}."
            )


def _wrap_add_megatron_arguments(original: Callable, installed: "_Installation") -> Callable:
    return functools.wraps(original)(lambda parser, *a, **kw: add_muon_arguments(original(parser, *a, **kw)))


def _as_ours(args: argparse.Namespace) -> None:
    """After Megatron's checks (run as for Adam): ``optimizer='muon'``, and no precision-aware
    optimizer, which Megatron-LM demands with ``--optimizer-cpu-offload`` because its offload
    reuses TE's precision-aware Adam; ours keeps its own fp32 masters (on the CPU)."""
    args.optimizer = "muon"
    args.use_precision_aware_optimizer = False


class _Installation:
    """What one ``use_megatron_muon()`` shares between its wrappers (the context of its
    ``patching`` layer): the modules it patches, the ``MuonConfig`` its ``validate_args``
    built from the arguments (the only place one is built from them), the optimizer its
    ``get_megatron_optimizer`` built, which its ``clip_qk`` asks for the max logit, and the
    state of the checkpoint and expert-bias wrappers."""

    def __init__(self, arguments: types.ModuleType, training: types.ModuleType) -> None:
        from .checkpoint_guards import CheckpointGuards
        from .expert_bias import PendingExpertBias

        self.arguments, self.training = arguments, training
        self.muon_config: Optional[MuonConfig] = None
        self.optimizer: Optional[Any] = None
        self.checkpoint_guards = CheckpointGuards()
        self.expert_bias = PendingExpertBias()


def _wrap_validate_args(original: Callable, installed: _Installation) -> Callable:
    """Megatron's checks as for its DistributedOptimizer (``muon`` would select its LayerWise
    one), ours before them, ``optimizer='muon'`` again after."""

    @functools.wraps(original)
    def validate_args(args, *a, **kw):
        installed.muon_config = None
        if not _ours(args):
            _check_megatron_choices(args)
            return original(args, *a, **kw)
        check_supported(args)
        # validate_args ends by printing the arguments (hundreds of lines): printed once our
        # checks below have passed (a bad --muon-* value is then the last line), showing what runs.
        print_args = getattr(installed.arguments, "_print_args", None)
        deferred: List[Tuple[tuple, dict]] = []
        args.optimizer = "adam"
        try:
            with patching.scoped(VALIDATION_SCOPE, deferred, {VALIDATION_SCOPE[0].target: installed.arguments}):
                result = original(args, *a, **kw)
        finally:
            _as_ours(args)
        args.use_layer_wise_distributed_optimizer = False
        if not args.use_distributed_optimizer:  # e.g. --freeze-all-layers switches it off
            raise ValueError(
                "megatron_muon: Megatron-LM's validation switched off --use-distributed-optimizer "
                "(--freeze-all-layers?), which --optimizer muon needs."
            )
        installed.muon_config = muon_config_from_megatron(args)  # bad --muon-* values fail here
        record_effective_settings(args, installed.muon_config)
        for pa, pkw in deferred:
            print_args(*pa, **pkw)
        return result

    return validate_args


def _held_listing(original: Callable, held: List[Tuple[tuple, dict]]) -> Callable:
    """Megatron-LM's ``_print_args`` that holds its calls in ``held`` (printed later)."""
    return lambda *a, **kw: held.append((a, kw))


def _global_args(module: Any) -> Optional[argparse.Namespace]:
    """Megatron-LM's global arguments, or None where they were never set."""
    try:
        return module.get_args()
    except AssertionError:
        return None


def _wrap_clip_qk(original: Callable, installed: _Installation) -> Callable:
    """With our optimizer: report our step's max logit instead of clipping again. With any
    other and ``--log-max-attention-logit`` only: measure it with our ``QKClip`` (Megatron's
    ``clip_qk`` assumes a ``Float16Module`` and fails on an fp32 model); clipping with another
    optimizer is refused at start-up (``launch.check_values``)."""

    @functools.wraps(original)
    def clip_qk(model, log_max_only=False):
        optimizer = installed.optimizer
        if optimizer is not None and getattr(optimizer, "qk_clip", None) is not None:
            # Already done inside our step, on the fp32 master shards: report, do not clip twice.
            return optimizer.max_attention_logit
        if not log_max_only:
            return original(model, log_max_only=log_max_only)
        from megatron.core import parallel_state

        from megatron_muon.qk_clip import QKClip

        recorders = QKClip.from_model(
            model,
            parallel_state.get_data_parallel_group(with_context_parallel=True),
            parallel_state.get_model_parallel_group(),
        )
        if recorders is None:
            return 0.0
        recorders.measure()
        recorders.reset()
        return recorders.max_attention_logit

    return clip_qk


def measure_next_step(args: argparse.Namespace, optimizer: Any, iteration: int) -> bool:
    """Whether the step of iteration ``iteration + 1`` measures its update RMS: when a
    TensorBoard log will report it. That is the log of its own iteration; with the step
    finished in the next forward, also the log one iteration later, which reports it once
    the forward has finished it (:meth:`MuonChainedOptimizer.log_statistics`): measuring
    never finishes a pending step early."""
    interval = max(1, args.tensorboard_log_interval)
    later = 2 if getattr(optimizer, "pending", None) is not None else 1
    return any((iteration + lag) % interval == 0 for lag in range(1, later + 1))


def _wrap_training_log(original: Callable, installed: _Installation) -> Callable:
    """Megatron-LM's log, then Muon's numbers (``MuonChainedOptimizer.log_statistics``) as
    TensorBoard scalars ``muon/...`` at every ``--tensorboard-log-interval`` (with
    ``--tensorboard-dir``), and as W&B ones with ``--wandb-project``; the update RMS is
    measured only in the steps whose statistics a log reports (:func:`measure_next_step`,
    ``measure_updates`` set for the next step here). The statistics are collective: every
    rank computes them, the rank holding Megatron-LM's writers writes.

    A job's first iteration that is also a logged one (``iteration % --log-interval == 0``:
    every iteration at ``--log-interval 1``, the first after a resume from a save on the
    interval) is logged as any logged iteration: Megatron-LM logs a job's first iteration
    without resetting its loss sums (so that an interval's average holds all of its
    iterations), and at a logged iteration the next line then averaged two iterations (a
    resumed run's second loss was not the uninterrupted run's)."""
    signature, module = inspect.signature(original), installed.training

    @functools.wraps(original)
    def training_log(*a, **kw):
        bound = signature.bind(*a, **kw)
        iteration, args = bound.arguments["iteration"], _global_args(module)
        if bound.arguments.get("is_first_iteration") and args is not None:
            if iteration % max(1, args.log_interval) == 0:
                bound.arguments["is_first_iteration"] = False
                a, kw = bound.args, bound.kwargs
        with _max_logit_in_the_iteration_line(module, args, bound.arguments.get("max_attention_logit")):
            result = original(*a, **kw)
        optimizer = installed.optimizer
        if args is None or optimizer is None or not getattr(args, "tensorboard_dir", None):
            return result
        interval = max(1, args.tensorboard_log_interval)
        optimizer.measure_updates = measure_next_step(args, optimizer, iteration)
        if iteration % interval:
            return result
        stats = optimizer.log_statistics()  # of the step just taken
        writer = module.get_tensorboard_writer()
        if writer:
            for name, value in stats.items():
                writer.add_scalar(f"muon/{name}", value, iteration)
            wandb_writer = module.get_wandb_writer()
            if wandb_writer:  # as Megatron-LM's own scalars: only beside a TensorBoard writer
                wandb_writer.log({f"muon/{name}": value for name, value in stats.items()}, iteration)
        return result

    return training_log


@contextlib.contextmanager
def _max_logit_in_the_iteration_line(module: Any, args: Optional[argparse.Namespace], value: Optional[float]):
    """With --qk-clip or --log-max-attention-logit, Megatron-LM's console line of an iteration
    gets ``max attention logit: X |`` (it writes the number to TensorBoard only)."""
    if args is None or value is None or not (args.qk_clip or args.log_max_attention_logit):
        yield
        return
    with patching.scoped(ITERATION_LINE_SCOPE, value, {ITERATION_LINE_SCOPE[0].target: module}):
        yield


def _line_with_max_logit(original: Callable, value: float) -> Callable:
    """``print_rank_last`` adding ``max attention logit: value |`` to an iteration's line."""

    def print_rank_last(message, *a, **kw):
        if isinstance(message, str) and " iteration " in message and message.rstrip().endswith("|"):
            message = f"{message} max attention logit: {float(value):.3f} |"
        return original(message, *a, **kw)

    return print_rank_last


def _wrap_calc_params_l2_norm(original: Callable, installed: _Installation) -> Callable:
    """``--log-params-norm`` reads every parameter right after the step: with
    ``--muon-step-overlap forward`` the step is finished first (for that iteration it then
    overlaps nothing)."""

    @functools.wraps(original)
    def calc_params_l2_norm(*a, **kw):
        optimizer = installed.optimizer
        if optimizer is not None:
            optimizer.finish_pending_step()
        return original(*a, **kw)

    return calc_params_l2_norm


def _wrap_get_megatron_optimizer(original: Callable, installed: _Installation) -> Callable:
    """Ours for ``--optimizer muon --muon-impl megatron_muon``, Megatron's otherwise."""
    signature, module = inspect.signature(original), installed.training

    @functools.wraps(original)
    def get_megatron_optimizer(config, model_chunks, *a, **kw):
        args = _global_args(module) if getattr(config, "optimizer", None) == "muon" else None
        if args is None or not _ours(args):
            return original(config, model_chunks, *a, **kw)
        if (
            installed.muon_config is None
            or getattr(args, "use_layer_wise_distributed_optimizer", False)
            or not config.use_distributed_optimizer
        ):
            raise RuntimeError(
                "megatron_muon: the arguments were validated without megatron_muon (LayerWise optimizer "
                "selected); call use_megatron_muon() before parse_and_validate_args (--yaml-cfg is not supported)."
            )
        call = signature.bind(config, model_chunks, *a, **kw)
        call.apply_defaults()
        p = call.arguments
        if p.get("dump_param_to_param_group_map") is not None:  # a direct call (the flag fails validation)
            raise ValueError(f"{WHO} {NO_PARAM_GROUP_MAP}.")
        optimizer = get_muon_optimizer(
            with_optimizer_config(installed.muon_config, config),
            model_chunks,
            pg_collection=p.get("pg_collection"),
            config_overrides=p.get("config_overrides"),
            use_gloo_process_groups=p.get("use_gloo_process_groups", True),
        )
        # The first step's update RMS is measured when TensorBoard will log it; later ones
        # only for the iterations it logs (``_wrap_training_log``).
        optimizer.measure_updates = bool(getattr(args, "tensorboard_dir", None))
        installed.optimizer = optimizer
        _say_where_the_step_runs(installed.muon_config, optimizer)
        return optimizer

    return get_megatron_optimizer


def _say_where_the_step_runs(config: MuonConfig, optimizer: Any) -> None:
    """One console line: where the Muon step runs, and why when 'auto' chose it."""
    from megatron.training.utils import print_rank_0

    forward = getattr(optimizer, "pending", None) is not None
    where = "during the next forward" if forward else "whole inside optimizer.step()"
    why = ""
    if config.muon_step_overlap == "auto":
        why = " (with --overlap-param-gather)" if forward else " (no --overlap-param-gather, or it cannot overlap here)"
    print_rank_0(f"megatron_muon: the Muon step runs {where}: --muon-step-overlap {config.muon_step_overlap}{why}")


def _owner_aligned_config(installed: _Installation, ddp_config: Any) -> Optional[MuonConfig]:
    """Our MuonConfig when DDP should get the owner-aligned layout (``muon`` with
    ``muon_buffer_layout='owner_aligned'`` on the distributed optimizer), else None."""
    config = installed.muon_config
    if config is None or not getattr(ddp_config, "use_distributed_optimizer", False):
        return None
    return config if config.muon_buffer_layout == "owner_aligned" else None


def _owner_aligned_ddp(ddp_class: Callable, installed: _Installation) -> Callable:
    """``ddp_class`` whose chunks are laid out by :func:`~megatron_muon.owner_aligned_param_layout`
    when :func:`_owner_aligned_config` says so. Megatron-LM computes the distributed optimizer's layout
    from a flat param list (no modules, which the logical-matrix rules need); a layout it hands
    over is replaced by ours, its bucket sizes and per-chunk ``disable_bucketing`` are kept."""
    from megatron_muon.buffer_layout import owner_aligned_param_layout

    @functools.wraps(ddp_class, updated=())
    def distributed_data_parallel(*, config, ddp_config, module, disable_bucketing=False, full_param_layout=None, **kw):
        muon_config = _owner_aligned_config(installed, ddp_config)
        if muon_config is not None:
            full_param_layout = owner_aligned_param_layout(
                muon_config,
                module,
                ddp_config,
                disable_bucketing=disable_bucketing,
                pg_collection=kw.get("pg_collection"),
            )
        return ddp_class(
            config=config,
            ddp_config=ddp_config,
            module=module,
            disable_bucketing=disable_bucketing,
            full_param_layout=full_param_layout,
            **kw,
        )

    return distributed_data_parallel


def _wrap_wrap_model_chunks_with_ddp(original: Callable, installed: _Installation) -> Callable:
    """``get_model``'s path: with our layout, hand it a ``DP`` that builds it (Megatron-LM then
    computes no layout of its own)."""
    from megatron.core.distributed import DistributedDataParallel

    @functools.wraps(original)
    def wrap_model_chunks_with_ddp(model_chunks, config, ddp_config, *a, **kw):
        if (
            _owner_aligned_config(installed, ddp_config) is not None
            and kw.get("DP", DistributedDataParallel) is DistributedDataParallel
            and not kw.get("use_layer_wise_distributed_optimizer")
        ):
            kw["DP"] = _owner_aligned_ddp(DistributedDataParallel, installed)
        return original(model_chunks, config, ddp_config, *a, **kw)

    return wrap_model_chunks_with_ddp


def use_megatron_muon(
    arguments_module: Optional[types.ModuleType] = None, training_module: Optional[types.ModuleType] = None
) -> Callable[[], None]:
    """Install the patches (``patches.MEGATRON_LM``; see the module docstring); returns a
    function undoing them.

    The modules default to ``megatron.training.arguments`` / ``megatron.training.training``
    (stand-ins get the argument and optimizer wrappers, and the checkpoint ones of Megatron-LM's
    ``checkpointing`` module). Calling it again while installed changes nothing (and returns
    the same undo function).
    """
    import megatron.training.arguments as real_arguments
    import megatron.training.training as real_training

    arguments_module = arguments_module or real_arguments
    training_module = training_module or real_training
    real = training_module is real_training
    owners: Dict[str, Any] = {patches.ARGUMENTS: arguments_module, patches.TRAINING: training_module}
    rows = patches.MEGATRON_LM
    if not real:
        owners[patches.DDP_BUILDER] = None  # the stand-ins build no model
        rows = tuple(p for p in rows if p not in patches.EXPERT_BIAS)
    layer = patching.install(rows, _Installation(arguments_module, training_module), owners)
    if real:
        # A Megatron-FSDP defect fix, for every optimizer; kept when the rest is undone.
        fix_gradient_accumulation_on_single_rank_groups()
    return layer.undo
