"""Nothing outlives its launcher: every process of a job ends when the one that started it does.

A process killed with SIGKILL cannot stop its children, and on Linux they go on as orphans:

* torchrun starts every rank in its own process session, so killing torchrun (its PID or
  its process group, as ``kill -9`` from a terminal or the OOM killer does) leaves the ranks
  training and saving into ``--save``: each rank ties itself to its launcher at start-up
  (:func:`tie_to_launcher`);
* Megatron-core's torch_dist save starts helper processes that outlive a killed rank: a
  multiprocessing manager (spawned, one per rank, holding the queue the writers report to)
  and, for asynchronous saves and Megatron-LM's background deletion of old checkpoints,
  forked processes (:func:`tie_forked_children_to_this_process`,
  :func:`writer_process_patches`);
* the converter starts the same writers, and a whole training job (torchrun) to re-save an
  AdamW checkpoint (:func:`tie_children_to_this_process`, :func:`die_with_this_process`).

Each such process asks the kernel to kill it when its parent dies (Linux
``PR_SET_PDEATHSIG``), then checks that its parent is still the one it expects, so a parent
that died before the request took effect is caught too.
"""

from __future__ import annotations

import ctypes
import functools
import multiprocessing
import os
import signal
import sys
import threading
from multiprocessing.managers import SyncManager
from typing import Any, Callable

_PR_SET_PDEATHSIG = 1
_fork_hook_installed = False
_forking_pid = 0
_forking_from_main_thread = False


def die_with_parent(parent_pid: int) -> None:
    """In a child process: be killed when ``parent_pid`` ends (end now if it has). A no-op
    outside Linux."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


def tie_to_launcher(launcher_pid: int) -> None:
    """In a rank started by a launcher (torchrun, or any that sets ``RANK``): be killed when
    the launcher ``launcher_pid`` ends (end now if it has). ``launcher_pid`` is the parent
    the rank saw when it started (``os.getppid()`` first thing in the script): a launcher
    that died since is caught by the check after the request."""
    die_with_parent(launcher_pid)


def die_with_this_process() -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess``: the child is killed when this process ends."""
    return functools.partial(die_with_parent, os.getpid())


def tie_children_to_this_process() -> None:
    """For a tool's process (the converter): processes it forks and Megatron-core's
    checkpoint writers' manager end with it."""
    from megatron_muon import patching

    from .patches import WRITER_QUEUE

    tie_forked_children_to_this_process()
    patching.install(WRITER_QUEUE)


def _before_fork() -> None:
    global _forking_pid, _forking_from_main_thread
    _forking_pid = os.getpid()
    _forking_from_main_thread = threading.current_thread() is threading.main_thread()


def _after_fork_in_child() -> None:
    # The kernel's "parent" is the forking thread: a child forked from a short-lived thread
    # would die with that thread, so only children of the main thread are tied to it.
    if _forking_from_main_thread:
        die_with_parent(_forking_pid)


def tie_forked_children_to_this_process() -> None:
    """Every process forked from this process's main thread from now on dies with it. For the
    main job only (process-wide, and ``os.register_at_fork`` cannot be undone)."""
    global _fork_hook_installed
    if not _fork_hook_installed:
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _fork_hook_installed = True


def _write_results_queue_dying_with_this_rank(original: Any, context: Any = None):
    """Megatron-core's ``get_write_results_queue``, whose manager process dies with the rank.
    On Linux the manager is forked whatever ``mp_mode`` asks: spawned, it imports the training
    script again (seconds and hundreds of MB per rank) only to serve one queue; it touches
    no GPU, so forking it is safe. (Restates Megatron-core's function, its module-level cache
    included: ``patches.WRITER_QUEUE`` holds the source fingerprint it was written against.)"""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def get_write_results_queue(mp_mode: str = "spawn"):
        if filesystem_async._results_queue is None:
            mode = "fork" if sys.platform.startswith("linux") else mp_mode
            manager = SyncManager(ctx=multiprocessing.get_context(mode))
            manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
            filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager alive
        return filesystem_async._results_queue

    get_write_results_queue.__wrapped__ = original  # type: ignore[attr-defined]
    return get_write_results_queue
