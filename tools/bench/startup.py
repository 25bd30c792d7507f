#!/usr/bin/env python
"""One rank's start-up at cluster scale: what the optimizer builds before its first step,
for a real model on thousands of ranks, on one CPU, with the package's own code.

For one global rank of a cluster layout (``scale_model.Cluster``; Megatron's rank order,
from its own ``RankGenerator``) and a model's real shapes (``model_shapes``), the rank's
pipeline stage is laid out on meta tensors and, per optimizer (dense, then expert), the
steps of ``get_muon_optimizer`` run one after the other, each timed and measured:

* ``layout``: our owner-aligned DDP layout of the stage (``buffer_layout``'s
  ``tag_muon_params`` + ``compute_full_param_layout``, as ``owner_aligned_param_layout``
  calls them; the logical matrices built by ``matrices.logical_matrices`` from the same
  ``ParamContext`` that ``collect_muon_params`` builds from a module tree);
* ``shard map``: each DP rank's range of every parameter of the optimizer's buffers
  (``DistributedOptimizerStorage.build_shard_map`` on the layout, no masters);
* ``process groups``: the orthogonalization group and its (tp, dp) coordinates
  (``process_groups.build_ortho_group``), with ``torch.distributed`` answered by
  :class:`SimulatedWorld`: every collective returns what each rank of the world would send,
  pickled and unpickled as ``all_gather_object`` does, and ``new_group`` a stand-in;
* ``plan``: ``planner.plan_for_config`` and its fingerprint exchange over the group;
* ``messages``: this rank's messages of the plan (``planner.rank_messages``);
* ``subgroups``: the multi-rank Newton–Schulz groups this rank is in (``process_groups.subgroup``).

Time is wall-clock of a pass without tracing; memory is ``tracemalloc``'s (Python
allocations: all of this is Python objects) in a second pass: the peak above the step's
start and what the step leaves behind. Not built, since they need tensors or a live
group: the fp32 masters, optimizer states and DDP's buffers (training memory, 1/DP of
the stage, not bookkeeping), Megatron's own ``DistributedOptimizer`` range maps and
``parallel_state`` groups (Megatron's start-up, not ours), the step's send / receive
buffers. ``--sweep`` repeats a scenario at larger data-parallel sizes to show which step
grows with the number of ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import pickle
import sys
import time
import tracemalloc
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple
from unittest import mock

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.bench import common
from tools.bench import model_shapes as S
from tools.bench.scale_model import Cluster, logical_param, owner_aligned_layout

ORDER = "tp-cp-ep-dp-pp"
"""Megatron-core's default rank order (``initialize_model_parallel(order=...)``)."""

SCENARIOS: Dict[str, Tuple[Callable[[Cluster], S.ModelShape], Cluster, str]] = {
    "deepseek_v3": (
        lambda c: S.from_recipe("deepseek_v3", c.gpus, c.tp, c.pp, c.ep, c.etp),
        Cluster(gpus=2048, tp=1, pp=16, ep=64),
        "the recipe's Muon settings; PP16 x EP64, DP128 / expert DP2",
    ),
    "llama3_70b": (
        lambda c: S.llama3_70b(c.tp),
        Cluster(gpus=1024, tp=8, pp=8),
        "TP8 x PP8 x DP16, MuonConfig's defaults",
    ),
}
SWEEP = (1, 2, 4, 8)
"""``--sweep``: the scenario's data-parallel size times these (the same model and TP / PP / EP)."""


class SimulatedGroup:
    """A process group of the simulated world, as seen from rank ``me`` of it."""

    def __init__(self, ranks: Sequence[int], me: int) -> None:
        self.ranks = list(ranks)
        self._index = {r: i for i, r in enumerate(self.ranks)}
        self._me = me

    def size(self) -> int:
        return len(self.ranks)

    def rank(self) -> int:
        return self._index.get(self._me, -1)


NON_MEMBER = object()
"""What ``new_group`` gives a rank outside the group (torch's ``GroupMember.NON_GROUP_MEMBER``)."""


class SimulatedWorld:
    """``torch.distributed`` as ``process_groups`` calls it, answered for rank ``me`` of a
    world laid out by Megatron's ``RankGenerator``. ``all_gather_object`` hands back what
    each member would pass in the same call (its TP group's ranks, over the world its
    orthogonalization group's lowest rank and size, or the object itself: a plan
    fingerprint is the same on every rank), each unpickled from bytes prepared beforehand,
    as torch unpickles what arrives."""

    def __init__(self, c: Cluster, me: int) -> None:
        from megatron.core.parallel_state import RankGenerator

        self.size, self.me = c.gpus, me
        generators = {
            "dense": RankGenerator(tp=c.tp, ep=1, dp=c.dp, pp=c.pp, cp=1, order=ORDER),
            "expert": RankGenerator(tp=c.etp, ep=c.ep, dp=c.edp, pp=c.pp, cp=1, order=ORDER),
        }
        self.tp: Dict[str, Dict[int, List[int]]] = {}
        self.dp: Dict[str, Dict[int, List[int]]] = {}
        self._sent: Dict[Tuple[str, str], List[bytes]] = {}
        for kind, gen in generators.items():
            self.tp[kind] = {r: g for g in gen.get_ranks("tp") for r in g}
            self.dp[kind] = {r: g for g in gen.get_ranks("dp") for r in g}
            ortho = {}
            for dp_group in gen.get_ranks("dp"):
                members = tuple(sorted(r for d in dp_group for r in self.tp[kind][d]))
                ortho.update({r: members for r in members})
            self._sent[(kind, "tp")] = [pickle.dumps(self.tp[kind][r]) for r in range(self.size)]
            self._sent[(kind, "ortho")] = [pickle.dumps((ortho[r][0], len(ortho[r]))) for r in range(self.size)]
        self.kind = "dense"
        self.gathered = 0
        """Objects this rank has received from all_gather_object."""

    def group(self, kind: str, which: str) -> SimulatedGroup:
        return SimulatedGroup((self.tp if which == "tp" else self.dp)[kind][self.me], self.me)

    # The torch.distributed functions process_groups.py calls.
    def get_world_size(self, group=None) -> int:
        return self.size

    def get_process_group_ranks(self, group: SimulatedGroup) -> List[int]:
        return list(group.ranks)

    def get_group_rank(self, group: SimulatedGroup, global_rank: int) -> int:
        return group._index[global_rank]

    def new_group(self, ranks, **kwargs):
        return SimulatedGroup(ranks, self.me) if self.me in ranks else NON_MEMBER

    def all_gather_object(self, out: list, obj: Any, group: Optional[SimulatedGroup] = None) -> None:
        ranks = group.ranks if group is not None else range(self.size)
        if group is None:  # over the world: the orthogonalization groups
            sent = self._sent[(self.kind, "ortho")]
        elif obj == self.tp[self.kind][self.me]:
            sent = self._sent[(self.kind, "tp")]
        else:
            sent = [pickle.dumps(obj)] * self.size
        for i, r in enumerate(ranks):
            out[i] = pickle.loads(sent[r])
        self.gathered += len(out)

    @contextlib.contextmanager
    def installed(self, kind: str, gpus_per_node: int):
        """``process_groups`` talks to this world (its group cache empty, as in a fresh process)."""
        from megatron_muon import process_groups

        self.kind = kind
        with (
            mock.patch.object(process_groups, "dist", self),
            mock.patch.dict(process_groups._GROUPS, clear=True),
            mock.patch.dict(os.environ, {"LOCAL_WORLD_SIZE": str(gpus_per_node)}),
        ):
            yield


class Steps:
    """Runs named steps in order; records each one's wall time, or its tracemalloc peak above
    its start and what it leaves behind."""

    def __init__(self, trace: bool) -> None:
        self.trace = trace
        self.rows: List[Dict[str, Any]] = []
        self.base = tracemalloc.get_traced_memory()[0] if trace else 0

    def __call__(self, name: str, fn: Callable[[], Any]) -> Any:
        if self.trace:
            gc.collect()  # the previous step's garbage is not this step's
            start = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
        t0 = time.perf_counter()
        result = fn()
        row: Dict[str, Any] = dict(step=name, ms=(time.perf_counter() - t0) * 1e3)
        if self.trace:
            current, peak = tracemalloc.get_traced_memory()
            row.update(peak_bytes=peak - start, kept_bytes=current - start, held_before=start - self.base)
        self.rows.append(row)
        return result


def _shard_map(layouts, expert: bool, group: SimulatedGroup):
    """The optimizer's shard map, by the DistributedOptimizer storage's own
    ``build_shard_map``, over the layout's buffers of one kind, standing in for the Megatron
    ``DistributedOptimizer`` the storage holds (``engine``; no masters: no tensors)."""
    from megatron_muon.storage.distributed_optimizer import DistributedOptimizerStorage

    buffers = [
        SimpleNamespace(
            data_parallel_group=group, param_index_map=lay.param_index_map, bucket_indices=lay.bucket_indices
        )
        for key, lay in layouts.layouts.items()
        if key.is_expert_parallel == expert
    ]
    engine = SimpleNamespace(
        buffers=buffers, model_float16_groups=[], shard_fp32_from_float16_groups=[], model_fp32_groups=[],
        shard_fp32_groups=[],
    )  # fmt: skip
    return DistributedOptimizerStorage.build_shard_map(SimpleNamespace(engine=engine))


def one_rank(m: S.ModelShape, c: Cluster, rank: int, trace: bool, world: Optional[SimulatedWorld] = None) -> Dict:
    """Every start-up step of global ``rank``, timed (``trace``: measured by tracemalloc)."""
    from megatron_muon.newton_schulz import method_for_device
    from megatron_muon.planner import plan_for_config, rank_messages
    from megatron_muon.process_groups import build_ortho_group, subgroup

    world = world or SimulatedWorld(c, rank)
    stage = rank // (c.gpus // c.pp)
    cfg = c.muon_config(m)
    ns_method = method_for_device(cfg.muon_ns_method, "cuda")
    steps = Steps(trace)
    params = steps("stage parameters (meta; the model)", lambda: S.stage_params(m, stage, c.pp, c.tp, c.ep, c.etp))
    layouts = steps("layout", lambda: owner_aligned_layout(params, m, c, c.bucket_size(stage)))
    counts: Dict[str, Any] = dict(stage=stage, params=len(params))
    held: List[tuple] = []
    for expert in (False, True):
        kind = "expert" if expert else "dense"
        chosen = [sp for sp in params if sp.is_matrix and sp.expert == expert and not sp.router]
        if not chosen:
            continue
        size = c.etp if expert else c.tp
        with world.installed(kind, c.gpus_per_node):
            tp_group, dp_group = world.group(kind, "tp"), world.group(kind, "dp")
            muon = steps(f"{kind}: logical matrices", lambda: [logical_param(sp, m, cfg, size) for sp in chosen])
            shard_map = steps(f"{kind}: shard map", lambda: _shard_map(layouts, expert, dp_group))
            group = steps(f"{kind}: process groups", lambda: build_ortho_group(tp_group, dp_group))

            def plan():
                ranges = {i: shard_map[mp.param].dp_ranges for i, mp in enumerate(muon)}
                built = plan_for_config(cfg, muon, ranges, group, True, ns_method)
                world.all_gather_object([None] * group.size, built.fingerprint(), group=group.group)
                return built

            built = steps(f"{kind}: plan", plan)
            shards = [shard_map[mp.param] for mp in muon]
            messages = steps(
                f"{kind}: messages",
                lambda: rank_messages(built, [s.start for s in shards], [s.end - s.start or None for s in shards]),
            )
            steps(
                f"{kind}: subgroups",
                lambda: {j.ns_ranks: subgroup(built.group, j.ns_ranks) for j in built.jobs if group.rank in j.ns_ranks},
            )
        counts[kind] = dict(
            group_size=group.size,
            matrices=len(built.jobs),
            chunks=len(built.chunks),
            segments=sum(len(j.sources) + len(j.dests) for j in built.jobs),
            shard_map_ranges=sum(len(s.dp_ranges) for s in shard_map),
            message_lists=sum(len(msg.gather_send_splits) for msg in messages),
        )
        held.append((muon, shard_map, group, built, messages))  # the optimizer keeps them
    counts["gathered_objects"] = world.gathered
    return dict(rows=steps.rows, counts=counts)


def measure(m: S.ModelShape, c: Cluster, rank: int) -> Dict[str, Any]:
    """Time (a pass without tracing) and memory (a traced pass) of every step of ``rank``."""
    world = SimulatedWorld(c, rank)
    timed = one_rank(m, c, rank, trace=False, world=world)
    world.gathered = 0
    gc.freeze()  # what is alive now (torch, Megatron) is not scanned by each step's collection
    tracemalloc.start()
    try:
        traced = one_rank(m, c, rank, trace=True, world=world)
    finally:
        tracemalloc.stop()
        gc.unfreeze()
    rows = [dict(r, ms=t["ms"]) for t, r in zip(timed["rows"], traced["rows"])]
    model, startup = rows[0], rows[1:]
    return dict(
        rank=rank,
        layout=c.describe(m),
        rows=rows,
        counts=timed["counts"],
        total_ms=sum(r["ms"] for r in startup),
        # Above the model's parameters: what start-up holds at its highest, and at its end.
        peak_bytes=max(r["held_before"] + r["peak_bytes"] for r in startup) - model["kept_bytes"],
        kept_bytes=startup[-1]["held_before"] + startup[-1]["kept_bytes"] - model["kept_bytes"],
    )


def _note(note: str, factor: int) -> str:
    return note if factor == 1 else f"that layout with {factor}x the data-parallel ranks"


def run(names: Sequence[str], sweep: bool, rank: Optional[int]) -> Dict[str, Any]:
    results: Dict[str, Any] = {}
    for name in names:
        shape_of, base, note = SCENARIOS[name]
        factors = SWEEP if sweep else (1,)
        for f in factors:
            c = replace(base, gpus=base.gpus * f)
            m = shape_of(c)
            # The default rank: the first of the middle stage (holds experts where there are any).
            r = rank if rank is not None else (c.pp // 2) * (c.gpus // c.pp)
            started = time.perf_counter()
            results[f"{name}@{c.gpus}"] = dict(measure(m, c, r), model=name, gpus=c.gpus, note=_note(note, f))
            print(f"{name} on {c.gpus} ranks (rank {r}): {time.perf_counter() - started:.1f} s", flush=True)
    return dict(env=common.environment("cpu"), results=results)


def markdown(data: Dict[str, Any]) -> str:
    kib = 1024
    parts = [common.provenance(data["env"]), ""]
    for r in data["results"].values():
        parts.append(
            f"**{r['model']}** on {r['layout']} ({r['note']}), global rank {r['rank']} (stage "
            f"{r['counts']['stage']}, {r['counts']['params']} parameters): start-up {r['total_ms']:.0f} ms, "
            f"peak {r['peak_bytes'] / 2**20:.1f} MiB of Python objects, {r['kept_bytes'] / 2**20:.1f} MiB kept.\n"
        )
        rows = [[x["step"], x["ms"], x["peak_bytes"] / kib, x["kept_bytes"] / kib] for x in r["rows"]]
        parts.append(common.md_table(["step", "ms", "peak KiB above its start", "KiB kept"], rows))
        parts.append("")
        sizes = [
            [
                kind,
                v["group_size"],
                v["matrices"],
                v["chunks"],
                v["segments"],
                v["shard_map_ranges"],
                v["message_lists"],
            ]
            for kind, v in r["counts"].items()
            if isinstance(v, dict)
        ]
        parts.append(
            common.md_table(
                [
                    "optimizer",
                    "group ranks",
                    "matrices",
                    "chunks",
                    "plan segments",
                    "shard-map ranges",
                    "split entries",
                ],
                sizes,
            )
        )
        parts.append(f"\nObjects received from all_gather_object: {r['counts']['gathered_objects']}.\n")
    return "\n".join(parts) + "\n"


def main(argv=None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", action="append", choices=sorted(SCENARIOS), help="default: all of them")
    p.add_argument("--sweep", action="store_true", help=f"also at {', '.join(f'{f}x' for f in SWEEP[1:])} the DP size")
    p.add_argument("--rank", type=int, help="the global rank to build (default: the first of the middle stage)")
    p.add_argument("--out", type=Path, default=common.DEFAULT_OUT)
    args = p.parse_args(argv)
    data = run(args.scenario or list(SCENARIOS), args.sweep, args.rank)
    text = markdown(data)
    print(text)
    paths = common.write_outputs(args.out, "startup", data, text)
    print(f"wrote {paths['json']} and {paths['markdown']}")
    return data


if __name__ == "__main__":
    from tools.bench.startup import main as _main

    _main()
