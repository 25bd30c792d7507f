"""Our thin layers on Megatron-LM's launch, for ``tools/pretrain_gpt.py``: ``--recipe``,
``--optimizer muon`` and the ``--muon-*`` flags, defaults where Megatron-LM's assume a GPU or
transformer-engine, the built-in corpus's tokenizer, QK-Clip with our recording attention,
and bad input as one line with exit code 2 before any model is built (docs/design.md,
"Inside Megatron-LM").
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import io
import math
import os
import re
import shlex
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Tuple

from megatron_muon import patching
from megatron_muon.checkpoint.errors import CheckpointError, CheckpointIntegrityError
from megatron_muon.checkpoint.reading import bounded

from . import corpus, cpu, patches, recipes, resume
from .checkpoint_dirs import (
    holds_a_run,
    iteration_dir_name,
    same_directory,
)
from .integration import megatron_muon_group, use_megatron_muon

DEFAULTS = {"tokenizer_type": "NullTokenizer", "vocab_size": corpus.BYTE_VOCAB_SIZE}
"""Megatron-LM's ``args_defaults``: the built-in byte corpus's tokenizer when none is named."""
NO_TE_DEFAULTS = {
    "transformer_impl": "local",
    "apply_rope_fusion": False,
    "no_persist_layer_norm": True,
    "gradient_accumulation_fusion": False,
}
"""Defaults without transformer-engine (Megatron-LM's assume it): its fused kernels are absent."""


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--recipe`` (expanded before parsing, listed here for ``--help``) and the CPU defaults
    (gloo, the local transformer implementation) where there is no GPU / transformer-engine."""
    megatron_muon_group(parser).add_argument(
        "--recipe",
        default=None,
        metavar="NAME|FILE",
        help="YAML file (or name under recipes/) of Megatron-LM flags; the command line overrides it. "
        f"Available: {', '.join(recipes.available_recipes())}.",
    )
    megatron_muon_group(parser).add_argument(
        "--start-over",
        action="store_true",
        help="Write into a --save directory that holds a run this job does not resume (--load names no "
        "checkpoint, or another run's directory); refused otherwise: this run replaces that run's later "
        "iterations as it saves. Never beside a live job (the directory's lock refuses that).",
    )
    parser.error = functools.partial(_one_line_error, parser.prog)  # not Megatron-LM's 3,000-line usage
    if not cpu.use_cuda():
        parser.set_defaults(distributed_backend="gloo")
    from megatron_muon.layer_specs import transformer_engine_available

    if not transformer_engine_available():
        parser.set_defaults(**NO_TE_DEFAULTS)
    return parser


def _one_line_error(prog: str, message: str) -> None:
    """Bad input: one line on stderr, exit code 2 (argparse's code), nothing built."""
    lines = str(message).strip().splitlines()
    print(f"{os.path.basename(prog)}: error: {lines[0] if lines else message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


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
        name, rest = argv[i + 1], argv[:i] + argv[i + 2 :]
    else:
        name, rest = argv[i].split("=", 1)[1], argv[:i] + argv[i + 1 :]
    parser = extra_args_provider(arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    recipe = recipes.fitted_to(recipes.load_recipe(name), rest, say=_say_on_first_rank)
    return recipes.recipe_to_argv(recipe, parser) + rest


def _say_on_first_rank(line: str) -> None:
    if _first_rank():
        print(line, flush=True)


def check_values(args: argparse.Namespace) -> None:
    """Values Megatron-LM reports late, under another flag's name (``--lr -0.01`` and
    ``--lr nan`` fail its ``min_lr <= lr`` check) or not at all (QK-Clip's threshold and
    alpha, whose checks :func:`install_launch_validation` hides with the flag): one line
    naming the flag."""
    from .integration import _ours

    for flag in ("lr", "min_lr"):
        value = getattr(args, flag, None)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"--{flag.replace('_', '-')} {value} is invalid: use a finite number >= 0")
    check_schedule(args)
    if getattr(args, "qk_clip", False):  # Megatron-LM's own checks of these are hidden with ours (see below)
        threshold, alpha = args.qk_clip_threshold, args.qk_clip_alpha
        if not (math.isfinite(threshold) and threshold > 0):
            raise ValueError(
                f"--qk-clip-threshold {threshold} is invalid: QK-Clip scales down a head whose max attention logit "
                "exceeds it; use a finite number > 0 (the default is 100)"
            )
        if not (math.isfinite(alpha) and 0 < alpha < 1):
            raise ValueError(
                f"--qk-clip-alpha {alpha} is invalid: the query takes gamma^alpha of a clip and the key the rest; "
                "use a number in (0, 1) (the default is 0.5)"
            )
    check_qk_clip_can_bound_the_logits(args)
    if getattr(args, "eval_interval", None) is None and not (
        getattr(args, "full_validation", False) or getattr(args, "skip_train", False)
    ):
        # Megatron-LM divides by it to size the validation set, once the model is built.
        raise ValueError(
            "--eval-interval is not set: Megatron-LM evaluates every --eval-interval iterations and sizes the "
            "validation set by it; add --eval-interval N (with --eval-iters 0 to never evaluate)"
        )
    if getattr(args, "qk_clip", False) and getattr(args, "use_distributed_optimizer", False) and not _ours(args):
        raise ValueError(
            f"--qk-clip with --optimizer {args.optimizer}: Megatron-core's QK-Clip scales the model weights, which "
            "the distributed optimizer's fp32 masters overwrite at the next step; use --optimizer muon "
            "(megatron_muon clips the masters) or drop --qk-clip"
        )


def check_qk_clip_can_bound_the_logits(args: argparse.Namespace) -> None:
    """What QK-Clip refuses once the model is built (:func:`~megatron_muon.qk_clip.clip_requirements`,
    read by ``QKClip.from_model``), from the flags, before the build."""
    if not getattr(args, "qk_clip", False) or getattr(args, "multi_latent_attention", False):
        return
    from megatron_muon.qk_clip import clip_requirements

    groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else None
    refusals = clip_requirements(
        bool(getattr(args, "qk_layernorm", False)),
        groups or args.num_attention_heads,
        args.tensor_model_parallel_size,
    )
    if refusals:
        raise ValueError(refusals[0])


def check_schedule(args: argparse.Namespace) -> None:
    """The learning-rate warm-up ends before the decay does, counted as Megatron-LM's
    scheduler counts them (it asserts this once the model is built, without a message)."""
    if getattr(args, "lr_warmup_fraction", None) is not None:
        return
    if getattr(args, "train_iters", None):
        unit, decay, warmup = "iters", args.lr_decay_iters or args.train_iters, args.lr_warmup_iters
        decay_flag = "--lr-decay-iters" if args.lr_decay_iters else "--train-iters"
    elif getattr(args, "train_samples", None):
        unit, decay, warmup = "samples", args.lr_decay_samples or args.train_samples, args.lr_warmup_samples
        decay_flag = "--lr-decay-samples" if args.lr_decay_samples else "--train-samples"
    else:
        return
    if warmup >= decay:
        raise ValueError(
            f"--lr-warmup-{unit} {warmup} is not below the learning-rate decay's {decay} {unit} ({decay_flag}): "
            f"Megatron-LM's scheduler warms up before it decays; lower --lr-warmup-{unit} or raise {decay_flag}"
        )


def install_launch_validation() -> None:
    """Our checks before Megatron-LM's ``validate_args`` (``tools/pretrain_gpt.py`` only):
    :func:`check_values`; and ``--qk-clip`` / ``--log-max-attention-logit`` with our recording
    attention. Megatron-LM refuses those flags without transformer-engine >= 2.9 (TE's
    attention records the max logits); our local layer spec's ``RecordingDotProductAttention``
    records them too, so with ``--transformer-impl local`` (and no ``--spec`` of the user's)
    they are hidden from that one check and restored after it (``patches.LAUNCH``; it sits
    above ``use_megatron_muon``'s validation whatever order they are installed in)."""
    patching.install(patches.LAUNCH)


def _wrap_validate_args(inner: Callable, context: Any = None) -> Callable:
    """Megatron-LM's ``validate_args`` after :func:`check_values`, with QK-Clip's flags hidden
    from its transformer-engine check when our recording attention runs
    (:func:`install_launch_validation`)."""

    @functools.wraps(inner)
    def validate_args(args, *a, **kw):
        check_values(args)
        if not (args.transformer_impl == "local" and args.spec is None):
            return inner(args, *a, **kw)
        saved = (args.qk_clip, args.log_max_attention_logit)

        def restore() -> None:  # the argument listing shows what runs
            args.qk_clip, args.log_max_attention_logit = saved

        args.qk_clip = args.log_max_attention_logit = False
        try:
            with patching.scoped(patches.RESTORED_LISTING_SCOPE, restore):
                return inner(args, *a, **kw)
        finally:
            restore()

    return validate_args


def _restored_then_printed(print_args: Callable, restore: Callable[[], None]) -> Callable:
    """Megatron-LM's ``_print_args`` after ``restore()`` (the flags hidden from validation)."""

    def restored_then_printed(*a, **kw):
        restore()
        return print_args(*a, **kw)

    return restored_then_printed


def parse_and_validate(argv: Sequence[str]) -> argparse.Namespace:
    """Megatron-LM's ``parse_and_validate_args`` on ``argv`` with the recipe expanded; bad input
    ends the process with one line and exit code 2 (:func:`_megatron_argv`), nothing built."""
    from megatron.training.arguments import parse_and_validate_args

    checks = (
        corpus.check_tokenizer_files,
        check_runnable_here,
        check_save_directory,
        check_checkpoint_to_load,
        corpus.check_data_prefixes,
    )
    # Every read of --load's checkpoint and --save's lock here is bounded in time: a hung
    # filesystem or a special file ends the job in one line instead of a silent wait.
    with (
        _megatron_argv(argv),
        bounded("what this job reads at start-up"),
        _checked_after_parsing(*checks),
        _listing_last() as print_listing,
    ):
        args = parse_and_validate_args(extra_args_provider=extra_args_provider, args_defaults=DEFAULTS)
        corpus.check_tokenizer(args)
        resume.check_checkpoint_format(args)
        resume.check_optimizer_to_load(args)
        resume.check_resumed_arguments(args)
        take_save_directory(args, shlex.join([os.path.basename(sys.argv[0]), *argv]))
    print_listing()
    return args


@contextlib.contextmanager
def _listing_last():
    """Megatron-LM's listing of every argument (printed at the end of its validation), held
    back inside the block and printed by the function the block yields: after the checks
    that follow validation, so bad input is the last line, not buried under the listing."""
    import megatron.training.arguments as arguments

    original, held = arguments._print_args, []
    with patching.scoped(patches.LISTING_SCOPE, held):
        yield lambda: [original(*a, **kw) for a, kw in held]


@contextlib.contextmanager
def _checked_after_parsing(*checks):
    """Inside the block, Megatron-LM's ``parse_args`` runs ``checks`` on what it parsed, before
    Megatron-LM's validation (which fails on some of the same flags without naming the fix,
    and sets its global arguments)."""
    with patching.scoped(patches.PARSE_SCOPE, checks):
        yield


def _parse_args_then_checks(original: Callable, checks: Sequence[Callable]) -> Callable:
    """Megatron-LM's ``parse_args``, then each of ``checks`` on what it parsed."""

    @functools.wraps(original)
    def parse_args(*a, **kw):
        args = original(*a, **kw)
        for check in checks:
            check(args)
        return args

    return parse_args


TOKENIZER_PACKAGES = {
    "HuggingFaceTokenizer": "transformers",
    "GPT2BPETokenizer": "transformers",
    "BertWordPieceLowerCase": "transformers",
    "BertWordPieceCase": "transformers",
    "SFTTokenizer": "transformers",
    "MultimodalTokenizer": "transformers",
    "SentencePieceTokenizer": "sentencepiece",
    "GPTSentencePieceTokenizer": "sentencepiece",
    "Llama2Tokenizer": "sentencepiece",
    "TikTokenizer": "tiktoken",
}
"""The package each ``--tokenizer-type`` imports when Megatron-core builds it
(megatron/core/tokenizers: its GPT-2 BPE and BERT word-piece tokenizers are Hugging Face's)."""

ECOSYSTEM_EXTRA = "pip install 'megatron-muon[ecosystem]'"
"""What installs every package of :func:`missing_package` (setup.py's ``ecosystem`` extra)."""


def missing_package(args: argparse.Namespace) -> Optional[Tuple[str, str]]:
    """``(flag, package)`` for the first optional package the arguments ask for that is not
    installed: wandb for ``--wandb-project``, the tokenizer's library (:data:`TOKENIZER_PACKAGES`).
    Megatron-LM imports them only once it runs (wandb when its writer starts, the tokenizer's
    library when it builds the tokenizer), where a missing one ends in a traceback."""
    wanted = []
    if getattr(args, "wandb_project", None):
        wanted.append(("--wandb-project", "wandb"))
    tokenizer = getattr(args, "tokenizer_type", None)
    if tokenizer in TOKENIZER_PACKAGES:
        wanted.append((f"--tokenizer-type {tokenizer}", TOKENIZER_PACKAGES[tokenizer]))
    for flag, package in wanted:
        if importlib.util.find_spec(package) is None:
            return flag, package
    return None


def check_wandb(args: argparse.Namespace) -> None:
    """What Megatron-LM's W&B writer needs that it does not check: a directory for its files
    (``--wandb-save-dir``, else ``--save``/wandb; with neither it fails on ``None``) and
    ``--tensorboard-dir`` (Megatron-LM logs to W&B inside its TensorBoard logging, so without
    it W&B gets the configuration and no scalar)."""
    if not getattr(args, "wandb_project", None):
        return
    if not (args.wandb_save_dir or args.save):
        raise ValueError("--wandb-project needs a directory for W&B's files: add --wandb-save-dir DIR (or --save)")
    if not args.tensorboard_dir:
        raise ValueError(
            "--wandb-project logs nothing without --tensorboard-dir (Megatron-LM writes its W&B scalars "
            "with its TensorBoard ones): add --tensorboard-dir DIR"
        )


TORCH_CHECKED = "2.11"
"""The torch release the suite runs on (setup.py requires 2.10 or later: torch before 2.10 has
CVE-2026-24747 in its weights_only unpickler)."""
TORCH_FAILS_FROM = (2, 15)
"""The first torch release found not to work with megatron-core 0.19.2 (tried 2026-11-28)."""


def check_torch_version(version: Optional[str] = None) -> None:
    """Refuse, in one line, a torch this package is known not to run on: from 2.15, DCP's
    ``TensorProperties`` has a ``strides`` field that megatron-core 0.19.2's torch_dist loader
    passes to ``torch.empty`` (every checkpoint load fails), and DCP's metadata pickles a
    ``SavePlan`` that our unpickler's allowlist does not admit. 2.12-2.14 were not tried."""
    import torch

    release = tuple(int(part) for part in re.findall(r"\d+", (version or torch.__version__).split("+")[0])[:2])
    if release >= TORCH_FAILS_FROM:
        raise ValueError(
            f"torch {version or torch.__version__} does not run megatron-core 0.19.2's checkpoints (its torch_dist "
            f"loader passes DCP's new TensorProperties.strides to torch.empty): install torch {TORCH_CHECKED} (checked; "
            "2.10 or later, before 2.15)"
        )


def check_runnable_here(args: argparse.Namespace) -> None:
    """What this machine cannot run, refused before any model is built (Megatron would fail
    late, deep in its code, or ignore the flag): transformer-engine's implementation without
    transformer-engine; an optional package a flag needs (:func:`missing_package`), W&B's
    settings (:func:`check_wandb`); grouped GEMM experts without transformer-engine's
    implementation; on gloo (no GPU) the all-to-all token dispatcher and the flash / fused
    attention backends."""
    from megatron.core.transformer.enums import AttnBackend

    from megatron_muon.layer_specs import transformer_engine_available

    check_torch_version()
    if args.transformer_impl == "transformer_engine" and not transformer_engine_available():
        raise ValueError(
            "--transformer-impl transformer_engine needs transformer-engine, which is not installed: use "
            "--transformer-impl local (or install megatron-muon[gpu] on a CUDA machine)"
        )
    check_wandb(args)
    missing = missing_package(args)
    if missing:
        flag, package = missing
        raise ValueError(f"{flag} needs the {package} package, which is not installed: {ECOSYSTEM_EXTRA}")
    experts = getattr(args, "num_experts", None)
    if experts and args.moe_grouped_gemm and args.transformer_impl != "transformer_engine":
        raise ValueError(
            "--moe-grouped-gemm needs --transformer-impl transformer_engine: Megatron-core 0.19's only grouped "
            "expert MLP is transformer-engine's TEGroupedMLP, and the local implementation builds one MLP per "
            "expert (SequentialMLP) whatever the flag; drop it"
        )
    if cpu.use_cuda():
        return
    if experts and args.moe_token_dispatcher_type == "alltoall":
        raise ValueError(
            "--moe-token-dispatcher-type alltoall does not run on gloo (no GPU): use "
            "--moe-token-dispatcher-type allgather"
        )
    if args.attention_backend in (AttnBackend.flash, AttnBackend.fused):
        raise ValueError(
            f"--attention-backend {args.attention_backend.name} needs a GPU: use --attention-backend auto "
            "(the CPU runs the local attention)"
        )


def check_checkpoint_to_load(args: argparse.Namespace) -> None:
    """A ``--load`` that names no checkpoint stops the job here (exit code 2, nothing built or
    written) unless it is Megatron-LM's first run of ``--load X --save X``, which starts a
    new run and says so in one line (as does ``--start-over``). Megatron-LM itself trains
    from scratch after one warning for any such ``--load``, a typo included, and with
    ``--exit-on-missing-checkpoint`` stops with ``sys.exit()``, status 0, which a launch
    script reads as a finished run."""
    # A tracker, or saved iterations without one (the load path then picks the newest that
    # verifies: checkpoint_guards), or the iteration --ckpt-step names.
    if not args.load or holds_a_run(args.load):
        return
    if args.ckpt_step is not None and os.path.isdir(os.path.join(args.load, iteration_dir_name(args.ckpt_step))):
        return
    what = (
        f"--load {args.load} holds no checkpoint (no latest_checkpointed_iteration.txt, no iterations"
        f"{'' if args.ckpt_step is None else f', no {iteration_dir_name(args.ckpt_step)}'})"
    )
    if args.exit_on_missing_checkpoint:
        raise ValueError(f"{what} and --exit-on-missing-checkpoint is set: check the path")
    first_run = same_directory(args.load, args.save)
    if not (first_run or args.start_over):
        raise ValueError(
            f"{what}: check the path; to start a new run drop --load, or give --load and --save the same "
            "directory (Megatron-LM's first run), or pass --start-over"
        )
    if _first_rank():
        print(
            f"megatron_muon: {what}: a new run starts from scratch"
            + (f" and saves into {args.save}" if args.save else "")
            + " (--exit-on-missing-checkpoint stops instead)",
            flush=True,
        )


def _first_rank() -> bool:
    """Whether this process is the job's first rank (a launcher sets ``RANK``; none: one process)."""
    return os.environ.get("RANK", "0") == "0"


def check_save_directory(args: argparse.Namespace) -> None:
    """A ``--save`` another live job writes into (its lock says), or that holds a run this
    job does not resume, is refused here, nothing built or touched: with ``--load`` naming no
    checkpoint (not given, or a typo), or naming another directory, Megatron-LM would train
    into it and replace that run's later iterations as it saves. ``--start-over`` asks for
    exactly that (never beside a live job)."""
    from megatron_muon.checkpoint import save_lock

    # On the first rank only: the others would find the lock their own first rank took.
    holder = save_lock.live_holder(args.save) if args.save and _first_rank() else None
    if holder is not None:  # the first thing to know: another job writes there right now
        raise ValueError(str(save_lock.refusal(args.save, holder)))
    if not args.save or args.start_over or not holds_a_run(args.save) or same_directory(args.load, args.save):
        return
    if holds_a_run(args.load):
        given = f"this job resumes --load {args.load}, another run"
    else:
        given = f"--load {args.load} holds no checkpoint" if args.load else "no --load is given"
    raise ValueError(
        f"--save {args.save} holds a run but {given}: resume it with --load {args.save}, save this run "
        "elsewhere (another --save), or pass --start-over to write into it (its later iterations are replaced "
        "as this run saves)"
    )


def take_save_directory(args: argparse.Namespace, command: str) -> None:
    """On the first rank, before anything is built: this job's lock on ``--save``
    (``checkpoint.save_lock``, naming ``command`` as the user typed it): a directory another
    live job writes into is refused in one line naming that job, an unwritable one here
    rather than at the first save."""
    if not args.save or not _first_rank():
        return
    from megatron_muon.checkpoint.save_lock import take

    try:
        take(args.save, f"tools/pretrain_gpt.py --save {args.save}", command)
    except CheckpointError as e:
        raise ValueError(str(e)) from e


def validated_args(argv: Sequence[str], world_size: int = 1) -> argparse.Namespace:
    """Megatron-LM's parsed and validated arguments for ``argv`` as ``world_size`` ranks would
    see them, without starting anything (for tools that read a configuration, e.g. a recipe)."""
    import megatron.training.arguments as arguments

    install_argument_layers()
    if not cpu.use_cuda():
        cpu.no_device_architecture()  # validation reads it with TP > 1
    with _megatron_argv(argv):
        args = arguments.parse_args(extra_args_provider)
        args.rank, args.world_size = 0, world_size
        # Only a GPU kernel's availability is checked for it (torch.cuda, absent here).
        grouped, args.moe_grouped_gemm = args.moe_grouped_gemm, args.moe_grouped_gemm and cpu.use_cuda()
        with contextlib.redirect_stdout(io.StringIO()):  # its listing of every argument
            arguments.validate_args(args, DEFAULTS)
        args.moe_grouped_gemm = grouped
    return args


@contextlib.contextmanager
def _megatron_argv(argv: Sequence[str]):
    """``sys.argv`` as Megatron-LM's parser reads it (``argv``, the recipe expanded) inside the
    block. Its errors (Megatron-LM asserts, our ValueErrors) end as :func:`_one_line_error`; a
    bare ``assert`` of Megatron-LM's (``--save`` without ``--save-interval``...) as its source
    line, which names the argument."""
    saved = list(sys.argv)
    prog = saved[0] if saved else "pretrain_gpt.py"
    try:
        sys.argv = [prog] + expand_recipe(argv)
        yield
    except (recipes.RecipeError, corpus.CorpusError, CheckpointError, ValueError, AssertionError) as exc:
        where = traceback.extract_tb(exc.__traceback__)[-1]
        bare = f"Megatron-LM's check `{where.line}` failed ({'/'.join(Path(where.filename).parts[-3:])}:{where.lineno})"
        _one_line_error(prog, str(exc) or bare)
    finally:
        sys.argv = saved


def install_argument_layers() -> None:
    """Our layers on Megatron-LM's argument handling: ``--optimizer muon`` and the
    ``--muon-*`` flags (``use_megatron_muon``), then :func:`install_launch_validation`."""
    use_megatron_muon()
    install_launch_validation()


def prepare(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Everything before ``pretrain()``: this rank's child processes tied to it
    (``process_lifetime``; the rank ties itself to its launcher in the script's first lines,
    before any heavy import), the CPU patches where there is no GPU, a one-process
    rendezvous for a plain ``python`` launch, our argument layers, then Megatron-LM's parsed
    and validated arguments (set as its global arguments, as ``parse_and_validate_args``
    does) and this job's lock on ``--save``."""
    from .process_lifetime import tie_forked_children_to_this_process

    argv = sys.argv[1:] if argv is None else list(argv)
    tie_forked_children_to_this_process()  # checkpoint writers and data workers end with their rank
    cpu.install()
    if "RANK" not in os.environ:  # plain `python pretrain_gpt.py`: one process, no launcher
        from megatron_muon.megatron_lm.cpu import set_single_process_rendezvous

        set_single_process_rendezvous()
    install_argument_layers()
    return parse_and_validate(argv)


@contextlib.contextmanager
def checkpoint_errors_as_one_line():
    """A checkpoint that cannot be loaded (corrupt, unverifiable, saved for another
    vocabulary padding) ends the job with one line on rank 0 and exit code 1; every rank
    raises the same error (the checks are collective), so every rank ends."""
    try:
        yield
    except CheckpointError as exc:
        fix = ""
        if isinstance(exc, CheckpointIntegrityError) and "is corrupt" in str(exc):
            fix = "; restore the files from a copy, or resume from an earlier iteration with --ckpt-step"
        if _first_rank():
            print(f"pretrain_gpt.py: error: {exc}{fix}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


@contextlib.contextmanager
def model_mismatch_as_one_line():
    """A setting that names what the built model does not have (a ``--muon-exclude-patterns``
    entry that matches no parameter) ends the job with one line on rank 0 and exit code 2;
    the check is collective, so every rank ends."""
    from megatron_muon.matrices import UnmatchedExcludePattern

    try:
        yield
    except UnmatchedExcludePattern as exc:
        if _first_rank():
            print(f"pretrain_gpt.py: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def pretrain_script() -> Path:
    """``tools/pretrain_gpt.py``: of this source checkout, or installed beside the recipes."""
    for candidate in (
        Path(__file__).resolve().parents[2] / "tools",
        Path(sys.prefix) / "share" / "megatron_muon" / "tools",
    ):
        script = candidate / "pretrain_gpt.py"
        if script.is_file():
            return script
    raise SystemExit("megatron-muon-pretrain: tools/pretrain_gpt.py is not installed (reinstall megatron-muon)")


def console_main() -> int:
    """``megatron-muon-pretrain``: runs ``tools/pretrain_gpt.py`` (installed beside the recipes)."""
    import runpy

    script = pretrain_script()
    sys.argv[0] = str(script)
    runpy.run_path(str(script), run_name="__main__")
    return 0
