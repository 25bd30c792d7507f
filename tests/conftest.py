"""The test tiers, and the ``slow`` marker.

* ``tests/unit``: no process launch; seconds.
* ``tests/dist``: gloo ranks started by ``megatron_muon.testing.run_distributed``.
* ``tests/e2e``: the main job (``tools/pretrain_gpt.py`` under Megatron-LM's loop, torchrun),
  the other tools as subprocesses, the docs' shell blocks. Every test here is ``slow``.

``pytest tests -q`` runs all tiers; ``pytest tests -m "not slow"`` is the fast loop.
Shared helpers live in ``tests/helpers`` (test modules never import each other). The
``slow`` marker is registered in ``pytest.ini`` (which also lets pytest collect
``tests/dist``: it skips directories named ``dist`` by default).
"""

from __future__ import annotations

from pathlib import Path

import pytest

E2E = Path(__file__).resolve().parent / "e2e"


def pytest_collection_modifyitems(config: pytest.Config, items) -> None:
    for item in items:
        if E2E in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.slow)
