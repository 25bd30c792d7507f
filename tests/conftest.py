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

import json
import os
import tempfile
from pathlib import Path
from typing import Dict, Optional

import pytest

E2E = Path(__file__).resolve().parent / "e2e"


GROUPS = "MEGATRON_MUON_TEST_GROUPS"
"""Environment variable: the file where an xdist worker writes which tests share fixtures."""
PATH_FIXTURES = frozenset({"cache", "out"})
"""Module-scoped fixtures that only name a directory: cheap, and shared by whole modules."""


def shared_fixture_groups(items) -> Dict[str, str]:
    """nodeid -> group, for tests that share a module-scoped fixture (a training run, a
    reference), transitively: one group per connected set within a module."""
    parent: Dict[tuple, tuple] = {}

    def find(x: tuple) -> tuple:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    first = {}
    for item in items:
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        names = sorted(n for n, d in defs.items() if d and d[-1].scope == "module" and n not in PATH_FIXTURES)
        keys = [(item.module.__name__, n) for n in names] if names and hasattr(item, "module") else []
        for key in keys[1:]:
            parent[find(key)] = find(keys[0])
        if keys:
            first[item.nodeid] = keys[0]
    return {nodeid: "::".join(find(key)) for nodeid, key in first.items()}


INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"


def inductor_cache_for_these_kernels() -> str:
    """A torch.compile cache directory of its own per ATen CPU capability: inductor's cache
    (``/tmp/torchinductor_<user>`` by default) does not key its compiled CPU kernels by
    ``ATEN_CPU_CAPABILITY``, and on an AVX-512 machine a run with ``=avx2`` loaded the
    native run's kernels and crashed (segfault in test_compiled_matches_eager, torch 2.11;
    a fresh cache passes)."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "native")
    return os.path.join(tempfile.gettempdir(), f"megatron-muon-inductor-{os.getuid()}-{capability}")


def pytest_configure(config: pytest.Config) -> None:
    if INDUCTOR_CACHE not in os.environ:  # set before anything compiles; ranks inherit it
        os.environ[INDUCTOR_CACHE] = inductor_cache_for_these_kernels()
    if not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None):
        fd, path = tempfile.mkstemp(prefix="megatron-muon-test-groups-", suffix=".json")
        os.close(fd)
        os.environ[GROUPS] = path  # the workers start after this and inherit it


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput") and os.environ.get(GROUPS):
        Path(os.environ.pop(GROUPS)).unlink(missing_ok=True)


LONGEST_FIRST = ("tests/e2e/test_pretrain.py", "tests/e2e/", "tests/dist/", "tests/unit/")
"""The order tests are handed to the workers: the tiers with the longest tests first, so that
the many short ones fill both workers at the end instead of one worker finishing a long
job alone."""


def _tier(item) -> int:
    return next((i for i, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)), len(LONGEST_FIRST))


def pytest_collection_modifyitems(config: pytest.Config, items) -> None:
    for item in items:
        if E2E in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.slow)
    items.sort(key=_tier)  # stable: the order within a tier is the collection's
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None and workerinput.get("workerid") == "gw0" and os.environ.get(GROUPS):
        path = Path(os.environ[GROUPS])
        path.with_suffix(".tmp").write_text(json.dumps(shared_fixture_groups(items)))
        path.with_suffix(".tmp").replace(path)


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Tests that share a module-scoped fixture go to one worker, so the fixture (a training
    run, a reference) runs once, not once per worker that runs one of them. (xdist's own
    ``--dist loadgroup`` does not group under pytest 9: it renames ``item._nodeid``, which
    pytest 9's ``nodeid`` no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):
        groups: Optional[Dict[str, str]] = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # written by gw0 during its collection, before it reported it
                text = Path(os.environ[GROUPS]).read_text() if os.environ.get(GROUPS) else ""
                self.groups = json.loads(text) if text else {}
            return self.groups.get(nodeid, nodeid)

    return SharedFixtureScheduling(config, log)
