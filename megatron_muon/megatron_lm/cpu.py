"""Run Megatron-core and Megatron-LM's training code where they did not expect to: with no
GPU (gloo, the CPU) and from a wheel.

* Megatron-core assumes a GPU in a handful of places (buffer placement via
  ``torch.cuda.current_device()``, CUDA streams and events, the tensor-parallel RNG
  tracker, literal ``device='cuda'`` and ``param.type() == 'torch.cuda.FloatTensor'``
  checks in the distributed optimizer, Megatron-FSDP's ``"cuda:<index>"`` device string),
  plus two Megatron bugs that only show without
  transformer-engine/Apex (torch AdamW's per-param ``step`` breaks building the state dict
  a fresh optimizer loads into, and loading a reshardable distributed-optimizer
  checkpoint). :func:`install_cpu_patches` replaces exactly those with CPU stand-ins,
  process-wide, so that a real ``GPTModel`` trains with TP/PP/EP/DP over gloo on a laptop.
* Megatron-LM's training code (the ``megatron.training`` of the megatron-core wheel) needs
  a few more: one small function per patch, applied with the core ones by :func:`install`
  (idempotent). Features that need a GPU (transformer-engine, FP8, CUDA graphs, NCCL-only
  options, fused kernels) stay unavailable on the CPU: docs/usage.md lists them.

Nothing here is applied on import. The main job (``launch.prepare``), the checkpoint
converter and the test harness's ranks call it. Checked against megatron-core 0.19.2 and
torch 2.11 (the CUDA build, run without a GPU).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import sys
import warnings
from typing import Any, Dict, Iterator

import torch
from torch.overrides import TorchFunctionMode

from megatron_muon import patching

from . import patches

_MODE: Dict[str, "CudaToCpuMode"] = {}
"""The CUDA-to-CPU torch function mode while :func:`install_cpu_patches` is in force."""


# --------------------------------------------------------------------------------------
# Megatron-core on the CPU
# --------------------------------------------------------------------------------------


class _Stream:
    """A CUDA stream stand-in: CPU work is already ordered, so every call is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *args: Any, **kwargs: Any) -> "_Event":
        return _Event()

    def query(self) -> bool:
        return True

    def __enter__(self) -> "_Stream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _Event:
    """A CUDA event stand-in (always complete)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: "_Event") -> float:
        return 0.0


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare integer device index means a CUDA ordinal in Megatron's code.
    return isinstance(device, int) and not isinstance(device, bool)


class CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA devices to the CPU and makes CPU tensors report CUDA type names.

    Megatron's distributed optimizer routes parameters by ``param.type()``
    ('torch.cuda.BFloat16Tensor', ...) and allocates a few tensors with a literal
    ``device='cuda'`` (or ``pin_memory=True``); this mode makes both work unchanged on the CPU.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            # Pinning needs a CUDA driver (the CP position-embedding split pins an index).
            kwargs["pin_memory"] = False
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.cuda:
            return args[0]
        if func in (torch.Tensor.to,) and args and _is_cuda_device(args[1] if len(args) > 1 else None):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _set_states_keeping_step(original: Any, context: Any = None) -> Any:
    """Megatron 0.19.2's distributed-optimizer load without transformer-engine or Apex (so on
    every CPU run, torch's AdamW), three defects:

    * its ``load_state_dict`` puts the checkpoint's step into every parameter's state as the
      *same* tensor, which torch's AdamW then increments once per parameter per step: the
      bias correction of the resumed run is wrong. Each parameter gets its own copy here;
    * the loaders pass a wrong ``step`` or none: the fully reshardable one drops it, then
      copies every state tensor, ``step`` included, and fails with ``KeyError: 'step'``; the
      dp-reshardable one (Megatron-LM's default) passes the placeholder step of the state it
      loads into (1), not the checkpoint's. The step ``load_state_dict`` restored from the
      checkpoint's parameter groups is kept;
    * an fp32 param's master is a view of the param itself, a leaf that requires grad, and
      the in-place copy into it runs outside ``no_grad`` ("a view of a leaf Variable ...")."""

    @functools.wraps(original)
    def _set_main_param_and_optimizer_states(self: Any, model_param: torch.nn.Parameter, tensors: dict) -> None:
        _set_keeping_step(original, self, model_param, tensors)

    return _set_main_param_and_optimizer_states


def _set_keeping_step(original: Any, self: Any, model_param: torch.nn.Parameter, tensors: dict) -> None:
    group_index, group_order = self.model_param_group_index_map[model_param]
    main_param = self.optimizer.param_groups[group_index]["params"][group_order]
    state = self.optimizer.state.get(main_param, {})
    step = state.get("step")
    if isinstance(step, torch.Tensor):
        state["step"] = step.detach().clone()
        tensors = {**tensors, "step": state["step"].clone()}
    with torch.no_grad():
        original(self, model_param, tensors)


def _sharded_state_dict_loadable(original: Any, context: Any = None) -> Any:
    """Megatron 0.19.2's DistributedOptimizer without transformer-engine or Apex (torch
    AdamW) reads the step from its state in ``state_dict()`` and asserts when no step has
    run yet: a fresh job cannot build the state dict it loads into. Give it Megatron's own
    remedy (``_init_optimizer_states_with_dummy_values``, used by its FSDP path) first; the
    load then replaces every dummy value. (With either of them installed: Megatron's own.)"""
    from megatron.core.optimizer import distrib_optimizer

    if getattr(distrib_optimizer, "HAVE_APEX_OR_TE", False):
        return patching.KEEP

    @functools.wraps(original)
    def sharded_state_dict(self: Any, *args: Any, **kwargs: Any) -> Any:
        is_loading = kwargs.get("is_loading", args[1] if len(args) > 1 else False)
        if is_loading and not self.optimizer.state:
            self._init_optimizer_states_with_dummy_values()
        return original(self, *args, **kwargs)

    return sharded_state_dict


@contextlib.contextmanager
def _cuda_device_index_zero():
    """``torch.cuda.current_device()`` answers 0 meanwhile (the patched one answers
    ``"cpu"``, which ``f"cuda:{torch.cuda.current_device()}"`` turns into ``"cuda:cpu"``)."""
    with patching.scoped(patches.DEVICE_INDEX_SCOPE):
        yield


def _fsdp_on_cpu(original: Any, context: Any = None) -> Any:
    """Megatron-FSDP's ``FullyShardedDataParallel.__init__`` (and the ``MegatronFSDP`` it
    builds) make ``torch.device(f"cuda:{torch.cuda.current_device()}")`` whatever device is
    passed: build it for the CPU, with that string evaluable."""

    @functools.wraps(original)
    def __init__(self, *args: Any, device: Any = None, **kwargs: Any) -> None:
        with _cuda_device_index_zero():
            original(self, *args, device=device if device is not None else torch.device("cpu"), **kwargs)

    return __init__


# The CPU stand-ins ``patches.CPU_CORE`` puts in place of torch's CUDA functions.


def _device_cpu(*a: Any, **k: Any) -> str:
    return "cpu"


def _device_zero(*a: Any, **k: Any) -> int:
    return 0


def _one_device(*a: Any, **k: Any) -> int:
    return 1


def _nothing(*a: Any, **k: Any) -> None:
    return None


def _no_bytes(*a: Any, **k: Any) -> int:
    """Megatron-LM's memory reports: nothing on a GPU."""
    return 0


def _no_memory_stats(*a: Any, **k: Any) -> dict:
    return {}


def _no_capability(*a: Any, **k: Any) -> tuple:
    """Compute capability 0.0: checks for GPU kernels fail with their own message."""
    return (0, 0)


def _cpu_rng_state(*a: Any, **k: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(state: torch.Tensor, *a: Any, **k: Any) -> None:
    torch.set_rng_state(state)


def _cpu_stream(*a: Any, **k: Any) -> _Stream:
    return _Stream()


def _no_stream_context(*a: Any, **k: Any) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


_NO_GENERATORS: tuple = ()


def _no_te_general_gemm(original: Any, context: Any = None) -> Any:
    """Without transformer-engine ``moe_utils.te_general_gemm`` is never bound, yet the router reads it."""
    return None if original is patching.MISSING else patching.KEEP


def install_cpu_patches() -> None:
    """Apply every CPU patch (``patches.CPU_CORE``; idempotent). Call before building Megatron models."""
    if _MODE:
        return
    patching.install(patches.CPU_CORE)
    # Megatron-FSDP then warns on every rank that the module's device (cpu) is not cuda:0.
    logging.getLogger("megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp").setLevel(logging.ERROR)
    mode = CudaToCpuMode()
    mode.__enter__()
    _MODE["mode"] = mode


def uninstall_cpu_patches() -> None:
    """Undo ``install_cpu_patches`` (used by tests that check for side effects)."""
    mode = _MODE.pop("mode", None)
    if mode is not None:
        mode.__exit__(None, None, None)
    patching.install(patches.CPU_CORE).undo()


@contextlib.contextmanager
def cpu_patches() -> Iterator[None]:
    """``install_cpu_patches`` in force inside the block, undone after it unless they were
    in force before it (reentrant: an installed process keeps them)."""
    ours = not _MODE
    if ours:
        install_cpu_patches()
    try:
        yield
    finally:
        if ours:
            uninstall_cpu_patches()


def patches_installed() -> bool:
    return bool(_MODE)


def free_port() -> int:
    """A TCP port free on the loopback interface now (for a one-process rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_single_process_rendezvous() -> None:
    """Point ``env://`` at this machine when no launcher did (plain ``python script.py``):
    ``MASTER_ADDR`` 127.0.0.1, ``RANK`` 0, ``WORLD_SIZE`` 1 and ``MASTER_PORT`` 0: the one
    process's store binds a port the kernel picks at that moment (a port found free here and
    bound later was taken in between once: ``EADDRINUSE``). Megatron-LM's in-process restart
    derives its own ports from ``MASTER_PORT``: with ``--inprocess-restart``, a port free now."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port()) if "--inprocess-restart" in sys.argv else "0"
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")


def compiles_on_cpu() -> bool:
    """Whether the CPU path compiles (``MEGATRON_MUON_CPU_COMPILE=1``); off by default:
    compiling Megatron's fused functions costs seconds each on the CPU and gains nothing."""
    return os.environ.get("MEGATRON_MUON_CPU_COMPILE", "0") == "1"


@contextlib.contextmanager
def plain_fused_functions() -> Iterator[None]:
    """Import Megatron-core inside this (before anything else imports it), on the CPU path:
    ``torch.compile`` applied as a decorator returns the function itself meanwhile.

    Megatron-core decorates its fused functions with ``torch.compile``
    (``megatron.core.jit.jit_fuser``) at import, and the decorator alone imports torch's
    inductor: about 2 s of CPU per process. On the CPU path dynamo is disabled
    (:func:`install`), so the compiled functions would run the same Python eagerly anyway.
    On a GPU, with ``MEGATRON_MUON_CPU_COMPILE=1``, or once Megatron-core is imported, this
    changes nothing."""
    if use_cuda() or compiles_on_cpu() or "megatron.core" in sys.modules:
        yield
        return
    with patching.scoped(patches.PLAIN_COMPILE_SCOPE):
        yield


def _plain_compile(model=None, **kwargs):
    """``torch.compile`` that compiles nothing: the function itself, or a decorator returning it."""
    return model if model is not None else (lambda fn: fn)


# --------------------------------------------------------------------------------------
# Megatron-LM's training code on the CPU
# --------------------------------------------------------------------------------------


def use_cuda() -> bool:
    """True when this process should run on a GPU."""
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def helpers_compiled() -> bool:
    """Whether Megatron-core's compiled dataset index helpers import."""
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def skip_helpers_build() -> None:
    """``initialize_megatron`` runs ``compile_helpers()`` (``make``) on rank 0, but the wheel
    ships the compiled ``helpers_cpp`` without its Makefile: skip the build when it imports."""
    patching.install(patches.WHEEL)


def _compile_helpers_unless_compiled(original: Any, context: Any = None) -> Any:
    if not helpers_compiled():
        return patching.KEEP

    @functools.wraps(original)
    def compile_helpers() -> None:
        if not helpers_compiled():
            original()

    return compile_helpers


def allow_cpu_initialization() -> None:
    """``pretrain`` calls ``initialize_megatron(allow_no_cuda=True)`` (Megatron's own switch
    past its ``torch.cuda.is_available()`` assert)."""
    patching.install(patches.CPU_INITIALIZATION)


def _allow_no_cuda(original: Any, context: Any = None) -> Any:
    return functools.wraps(original)(functools.partial(original, allow_no_cuda=True))


def no_device_architecture() -> None:
    """``validate_args`` asks the GPU's architecture (``get_device_arch_version``) with TP or
    CP > 1, only to choose a performance warning; without a GPU the answer is 0. The same
    check then requires ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (an ordering of GPU kernels, moot
    here) and Megatron-FSDP requires it unset or > 1: when validation starts, set it
    (unless set) without Megatron-FSDP, unset it with."""
    patching.install(patches.CPU_DEVICE_ARCHITECTURE)


def _max_connections_for_the_engine(original: Any, context: Any = None) -> Any:
    """``validate_args`` with ``CUDA_DEVICE_MAX_CONNECTIONS`` set as :func:`no_device_architecture` says."""

    @functools.wraps(original)
    def validate_args(args, *a, **kw):
        if getattr(args, "use_megatron_fsdp", False) or getattr(args, "use_torch_fsdp2", False):
            os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)  # orders no GPU kernels here
        else:
            os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        return original(args, *a, **kw)

    return validate_args


def no_premul_sum() -> None:
    """Megatron-FSDP divides gradients inside the reduction (``ReduceOp.PREMUL_SUM``), which
    only NCCL has: on gloo it divides first (``--no-gradient-reduce-div-fusion``), set when
    validation starts."""
    patching.install(patches.CPU_NO_PREMUL_SUM)


def _no_gradient_reduce_div_fusion(original: Any, context: Any = None) -> Any:
    @functools.wraps(original)
    def validate_args(args, *a, **kw):
        args.gradient_reduce_div_fusion = False
        return original(args, *a, **kw)

    return validate_args


def jit_warmup_keeps_the_rng() -> None:
    """Megatron-LM's start-up warms up its fused functions on random tensors of
    ``seq_length / context_parallel_size`` rows (``initialize._warmup_jit_function``), drawn
    from the CUDA generator on a GPU. Here the "CUDA" generator is the CPU's, which also
    initializes the MoE routers' weights (created on the CPU, outside the tracker's fork): the
    warm-up made them depend on the context-parallel size (CP2 started from other routers than
    DP2). It now leaves the CPU generator as it found it, as a GPU's warm-up does."""
    patching.install(patches.CPU_JIT_WARMUP)


def _warmup_keeping_the_rng(original: Any, context: Any = None) -> Any:
    @functools.wraps(original)
    def warmup(*a, **kw):
        state = torch.get_rng_state()
        try:
            return original(*a, **kw)
        finally:
            torch.set_rng_state(state)

    return warmup


def quiet_cpu_rng_warning() -> None:
    """On the CPU the "CUDA" RNG is the CPU generator, and Megatron's tracker warns about it
    at every tensor-parallel fork: silence that logger only."""
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)


def quiet_zero_grad_notice() -> None:
    """Megatron-core's ``zero_grad`` reads ``.grad`` of the distributed optimizer's fp32 shard
    views, which are not leaf tensors (its own comment: "throws grad-access warning"); on the
    CPU that read goes through :class:`CudaToCpuMode`, so torch's warning names this module.
    Silenced for this module only."""
    warnings.filterwarnings(
        "ignore", message="The .grad attribute of a Tensor that is not a leaf Tensor", module=__name__
    )


def quiet_missing_extension_notices() -> None:
    """Megatron-core warns at import, once per module, that transformer-engine / Apex are
    absent (and torch that CUDA is): expected without a GPU, so not repeated on every run."""
    for text in (
        ".*Transformer Engine and Apex are not installed",
        ".*Apex is not installed",
        ".*transformer-engine>=1.7.0 supports MoE experts",
        "'pin_memory' argument is set as true but no accelerator is found",  # Megatron-LM's data loaders
    ):
        warnings.filterwarnings("ignore", message=text)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)


def install() -> bool:
    """Apply the patches this machine needs. Returns whether the CPU path is in use."""
    if not use_cuda():
        quiet_missing_extension_notices()
    skip_helpers_build()
    if use_cuda():
        return False
    install_cpu_patches()
    allow_cpu_initialization()
    no_device_architecture()
    no_premul_sum()
    jit_warmup_keeps_the_rng()
    quiet_cpu_rng_warning()
    quiet_zero_grad_notice()
    if not compiles_on_cpu():
        torch._dynamo.config.disable = True
    return True
