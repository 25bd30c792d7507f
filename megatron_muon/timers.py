"""Megatron's optimizer timers (``optimizer-inner-step``, ``params-all-gather``...), which
Megatron-LM logs, around the parts of the Muon optimizer's step that Megatron's own
optimizer times under the same names."""

from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def megatron_timer(config, name: str) -> Iterator[None]:
    """Megatron's optimizer timer of that name, when ``config.timers`` is set."""
    timers = config.timers
    if timers is None:
        yield
        return
    timers(name, log_level=1).start(barrier=config.barrier_with_L1_time)
    try:
        yield
    finally:
        timers(name).stop()
