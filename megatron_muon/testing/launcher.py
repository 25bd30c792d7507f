"""Spawn gloo ranks on this machine, initialise Megatron's ``parallel_state``, run a function.

``run_distributed(fn, world_size, tp=2)`` starts ``world_size`` fresh processes (never a fork
of the caller: Megatron and torch keep global state), each of which applies the CPU patches, joins a
gloo process group (rendezvous through a file in the run's directory), calls
``parallel_state.initialize_model_parallel`` with the requested layout and then
``fn(*args)``. Every rank writes its return value (or its traceback) to a file; the parent
waits for all of them, re-raises the first failure with the rank's own traceback, and kills
the whole group when ``timeout_s`` runs out so a hung collective fails a test instead of
hanging CI.

Ranks are forked from a forkserver: a clean process, started once per caller, that has
imported torch and Megatron-core and nothing else (no patches, no process groups, no
threads). A rank then starts in a fraction of a second instead of re-importing them for
about four seconds, which is most of a small multi-rank test. Each rank takes the caller's
current environment variables, as a spawned one would. ``MEGATRON_MUON_START_METHOD=spawn``
goes back to plain spawning (to rule the forkserver out when debugging).
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch
import torch.multiprocessing as mp


@dataclass(frozen=True)
class ParallelLayout:
    """The Megatron process layout of one spawned run (names as in Megatron-LM)."""

    world_size: int
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    context_parallel_size: int = 1

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
        )


class DistributedTestError(RuntimeError):
    """A rank failed; the message carries that rank's traceback."""


_PRELOAD = (
    "torch",
    "megatron.core.parallel_state",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.models.gpt",
    "megatron.core.dist_checkpointing",
    "megatron_muon",
)
"""Imported once by the forkserver (a missing one is skipped); never patched there."""


def _start_context():
    """The multiprocessing context ranks start from: forkserver with Megatron preloaded."""
    method = os.environ.get("MEGATRON_MUON_START_METHOD", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"MEGATRON_MUON_START_METHOD={method!r}: use 'forkserver' (default) or 'spawn'")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


def _rank_main(
    rank: int,
    layout: ParallelLayout,
    outdir: str,
    fn: Callable,
    args: tuple,
    seed: int,
    collective_timeout_s: float,
    environ: dict,
) -> None:
    # The forkserver's environment is the one it started with; take the caller's now.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    out = os.path.join(outdir, f"rank{rank}")
    # If this rank hangs, write its Python stacks shortly before the parent gives up, so the
    # TimeoutError says where each rank was waiting.
    stacks = open(os.path.join(outdir, f"stacks{rank}"), "w")
    faulthandler.dump_traceback_later(max(1.0, 0.9 * collective_timeout_s), file=stacks)
    # A rank killed by a fatal signal (a crash in a native library) writes its threads'
    # Python stacks there too, so the report says where it died, not only that it did.
    faulthandler.enable(file=stacks, all_threads=True)
    try:
        from megatron_muon import patching
        from megatron_muon.megatron_lm.cpu import install_cpu_patches
        from megatron_muon.megatron_lm.patches import WRITER_QUEUE

        install_cpu_patches()
        # As in the main job: Megatron-core's checkpoint writers report to a manager process
        # forked from the rank, not spawned (a spawned one imports torch again to unpickle the
        # first result: about 5 s of CPU per saving rank).
        patching.install(WRITER_QUEUE)
        import datetime

        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        os.environ["RANK"] = str(rank)
        os.environ["WORLD_SIZE"] = str(layout.world_size)
        os.environ["LOCAL_RANK"] = str(rank)
        # A file in the run's own directory, not a TCP port: a port picked free by the parent
        # can be taken by another process before rank 0 binds it (EADDRINUSE under load).
        torch.distributed.init_process_group(
            "gloo",
            init_method=f"file://{os.path.join(outdir, 'rendezvous')}",
            rank=rank,
            world_size=layout.world_size,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tensor_model_parallel_size,
            pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=layout.virtual_pipeline_model_parallel_size,
            context_parallel_size=layout.context_parallel_size,
            expert_model_parallel_size=layout.expert_model_parallel_size,
            expert_tensor_parallel_size=layout.expert_tensor_parallel_size,
        )
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        result = fn(*args)
        torch.save({"ok": True, "result": result}, out + ".tmp")
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        torch.save({"ok": False, "error": traceback.format_exc()}, out + ".tmp")
    os.replace(out + ".tmp", out)
    try:
        # Tear down cleanly so gloo does not report broken pipes from ranks that finished.
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    except Exception:  # noqa: BLE001 - teardown errors are irrelevant to the result
        pass


_NO_PYTHON_FRAME = re.compile(r"Thread 0x[0-9a-f]+ \(most recent call first\):\n  <no Python frame>\n*")
"""A thread faulthandler lists without Python code (gloo's, OpenMP's): dozens in a rank."""


def _stacks(outdir: str, ranks: List[int]) -> str:
    """The Python stacks the hung or crashed ranks dumped, innermost frames first (as
    faulthandler writes them, less the threads running no Python), for the error."""
    parts = []
    for rank in ranks:
        try:
            with open(os.path.join(outdir, f"stacks{rank}")) as f:
                text = _NO_PYTHON_FRAME.sub("", f.read()).strip()
        except OSError:
            continue
        if text:
            parts.append(f"--- rank {rank} was at:\n{text[:4000]}")
    return "\n".join(parts)


def _collect(outdir: str, world_size: int, results: dict) -> None:
    """Read every rank's result file that has appeared since the last call."""
    for rank in range(world_size):
        path = os.path.join(outdir, f"rank{rank}")
        if rank not in results and os.path.exists(path):
            results[rank] = torch.load(path, weights_only=False)


def _dead_without_result(procs: List[Any], outdir: str, results: dict) -> List[int]:
    return [
        r
        for r, p in enumerate(procs)
        if r not in results and not p.is_alive() and not os.path.exists(os.path.join(outdir, f"rank{r}"))
    ]


def _failure_report(procs: List[Any], outdir: str, results: dict, world_size: int) -> str:
    """Ranks that died without a result first (a signal is the likely root cause: its
    peers then fail on reset connections), then every rank's reported error."""
    lines = []
    dead = _dead_without_result(procs, outdir, results)
    for r in dead:
        code = procs[r].exitcode
        how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        lines.append(f"rank {r} of {world_size} died ({how}) without reporting a result")
    stacks = _stacks(outdir, dead)
    if stacks:  # a rank killed by SIGKILL wrote none
        lines.append(stacks)
    for r in sorted(results):
        if not results[r]["ok"]:
            lines.append(f"rank {r} of {world_size} failed:\n{results[r]['error']}")
    return "\n".join(lines)


def run_distributed(
    fn: Callable,
    world_size: int,
    *args: Any,
    tp: int = 1,
    pp: int = 1,
    vpp: Optional[int] = None,
    ep: int = 1,
    etp: Optional[int] = None,
    cp: int = 1,
    timeout_s: float = 300.0,
    seed: int = 1234,
) -> List[Any]:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks with the given Megatron layout.

    ``fn`` must be importable by name (a module-level function): ranks are new processes.
    Returns the list of per-rank return values (rank order). Raises
    ``DistributedTestError`` with the failing rank's traceback, or ``TimeoutError`` when
    the ranks do not all finish within ``timeout_s`` seconds.
    """
    layout = ParallelLayout(
        world_size=world_size,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        context_parallel_size=cp,
    )
    if world_size % (tp * pp * cp) != 0:
        raise ValueError(
            f"world_size={world_size} is not divisible by tp*pp*cp={tp * pp * cp}; "
            "choose a world size that is a multiple of the model-parallel size."
        )
    ctx = _start_context()
    with tempfile.TemporaryDirectory(prefix="megatron_muon_") as outdir:
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(rank, layout, outdir, fn, args, seed, timeout_s, dict(os.environ)),
                daemon=False,  # ranks may start helper processes (dist-checkpoint writers)
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        results: dict[int, dict] = {}
        try:
            while len(results) < world_size:
                _collect(outdir, world_size, results)
                failed = any(not r["ok"] for r in results.values())
                if failed or _dead_without_result(procs, outdir, results):
                    # The first error seen is often a consequence (a peer's crash resets its
                    # connections): let the others report or die, then name them all.
                    settle = time.monotonic() + 5
                    while any(p.is_alive() for p in procs) and time.monotonic() < settle:
                        time.sleep(0.05)
                    _collect(outdir, world_size, results)
                    raise DistributedTestError(_failure_report(procs, outdir, results, world_size))
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(results))
                    raise TimeoutError(
                        f"ranks {missing} of {world_size} did not finish within {timeout_s:.0f} s "
                        f"(a hung collective?)\n{_stacks(outdir, missing)}"
                    )
                time.sleep(0.05)
        finally:
            for p in procs:
                p.join(timeout=5 if len(results) == world_size else 0.1)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [results[r]["result"] for r in range(world_size)]
