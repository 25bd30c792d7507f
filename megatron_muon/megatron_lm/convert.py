"""The converter's commands (``tools/convert_checkpoint.py``): Megatron AdamW <-> Muon,
torch_dist <-> fsdp_dtensor, expert layouts, and a readable summary.

Works on whole checkpoints in one process: every tensor is read at its full
global shape, transformed by key, and written back with Megatron's own
``dist_checkpointing.save``, so the result loads into any parallel layout. An AdamW
source in Megatron-LM's default optimizer format (DDP buckets, not parameters) is first
re-saved fully reshardable by Megatron-LM itself, with the run's own arguments
(:mod:`.resave`). Each checkpoint format reads into and writes from the same in-memory
form (``checkpoint.formats``; fsdp_dtensor's with the model layout Megatron-LM builds,
:mod:`.converter_support`), so ``adam-to-muon`` / ``muon-to-adam`` take any format and
write it back in the same one, and ``to-torch-dist`` / ``to-fsdp-dtensor`` move a Muon
run between them.

Megatron-LM's layout on both sides: the source is a checkpoint directory (``--save`` of
``tools/pretrain_gpt.py``, whose ``latest_checkpointed_iteration.txt`` names the iteration)
or one ``iter_XXXXXXX`` directory; the destination is a checkpoint directory that receives
``iter_XXXXXXX`` (same iteration) and the tracker file, so ``--load DST`` resumes from it.
The common state (arguments, iteration, scheduler, RNG, rerun state) is kept; only the
optimizer's part and ``args.optimizer`` change.

Reading and writing are ``checkpoint_dirs``': the source is verified against its manifest
before anything of it is unpickled, and unpickled through the restricted unpickler; the
destination is taken under its lock (a directory a live job writes into is refused), its
iteration published (staged, manifest, swapped in, tracker). Nothing it did not create is
deleted or overwritten: an existing destination iteration, or a later one, is refused
unless ``--overwrite``; the source can never be the destination, inside it or its parent;
a conversion killed at any point leaves every earlier checkpoint loadable, and what it
left behind is removed by the next writer of that directory.

Key conventions (both Megatron's ``fully_reshardable`` distributed optimizer and ours):
model tensors under their model key; optimizer state under
``optimizer.state.<state>.<model key>`` with ``<state>`` in ``param`` (fp32 master),
``exp_avg`` / ``exp_avg_sq`` (AdamW) and ``momentum_buffer`` (Muon), plus ``second_moment``
(Muon with variance reduction: the factored second moment expanded to the parameter's
shape). Converting to Muon writes no second moments: a Muon run with variance reduction
that loads such a checkpoint starts them at zero, as a fresh run does.
"""

from __future__ import annotations

import copy
import os
import re
import sys
import tempfile
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from megatron_muon import state as registry
from megatron_muon.checkpoint import formats
from megatron_muon.checkpoint.errors import CheckpointError
from megatron_muon.checkpoint.format import CheckpointFormat
from megatron_muon.checkpoint.optimizer_state import (
    STATE_PREFIX,
    common_state,
    megatron_parts,
    optimizer_kind,
    require_ours,
)
from megatron_muon.checkpoint.optimizer_state import state_key as _state_key
from megatron_muon.checkpoint.reading import read_dcp_metadata
from megatron_muon.checkpoint.unpickling import torch_load
from megatron_muon.matrices import is_muon_matrix
from megatron_muon.state import ADAM_STATES, MASTER, MOMENTUM

from .checkpoint_dirs import (
    RESAVE,
    Checkpoint,
    check_destination,
    check_paths,
    check_source,
    checkpoint_iteration,
    format_of,
    iteration_dir_name,
    owned,
    publish_iteration,
    read_checkpoint,
    read_common,
    resolve_source,
)
from .converter_support import SUPPORT

MOVES: Dict[str, CheckpointFormat] = {f.convert_command: f for f in formats.FORMATS.values()}
"""The converter's commands that move a Muon run into a format (``to-torch-dist``...)."""


def _write(fmt: CheckpointFormat, ckpt: Checkpoint) -> Callable[[str], None]:
    """What writes ``ckpt`` into a staging directory in the format ``fmt``."""
    return lambda staging: fmt.write(staging, ckpt, SUPPORT)


def _retarget_args(ckpt: Checkpoint, optimizer: str) -> None:
    """Megatron-LM's saved arguments say which optimizer wrote the state: the converted one."""
    args = ckpt.common.get("args")
    if args is not None and hasattr(args, "optimizer"):
        args = copy.copy(args)
        args.optimizer = optimizer
        ckpt.common["args"] = args


def model_keys(ckpt: Checkpoint) -> List[str]:
    """Model tensor keys that have an fp32 master in the optimizer state."""
    prefix = _state_key(MASTER, "")
    return sorted(k[len(prefix) :] for k in ckpt.tensors if k.startswith(prefix))


_LINEAR_WEIGHT = re.compile(r"(^|\.)(linear_\w+\.weight\d*|weight[12]|router\.weight)$")
"""Keys of the weight matrices of Megatron's GPT layers (linear layers, grouped and legacy
fused experts, the router). A checkpoint stacks layers and experts into extra dims, so a
key's tensor rank does not say whether each parameter is a matrix; its name does."""


def is_muon_key(key: str, exclude: Iterable[str] = (), router: bool = False) -> bool:
    """Which model tensors Muon optimizes, from their checkpoint key (no model at hand):
    ``matrices.is_muon_matrix`` with the rank and role read off Megatron's GPT names."""
    role = (
        "embedding"
        if "embedding" in key or key.startswith("output_layer")
        else "router"
        if key.endswith("router.weight")
        else "weight"
    )
    return is_muon_matrix(key, 2 if _LINEAR_WEIGHT.search(key) else 1, role, tuple(exclude), router)


CHAIN = ("dense", "expert")
"""Our optimizers' names in the order of Megatron's chain (``factory``: dense, then expert)."""


def adam_to_muon(
    src: str,
    dst: str,
    momentum: str = "zeros",
    exclude: Iterable[str] = (),
    router: bool = False,
    overwrite: bool = False,
    unverified_source: bool = False,
) -> Dict[str, int]:
    """Megatron DistributedOptimizer (AdamW) -> Muon checkpoint. Megatron-LM's default
    format (DDP buckets) is first re-saved fully reshardable by Megatron-LM (:mod:`.resave`).

    Weights and fp32 masters are kept; Muon matrices get a ``momentum_buffer`` (zeros, or
    ``exp_avg`` with ``momentum='exp_avg'``) instead of their AdamW moments (the registry's
    optional states start at zero); the scalar parameters keep their AdamW state."""
    check_paths(src, dst)
    source = resolve_source(src)
    verified = check_source(source, unverified_source)
    fmt = format_of(source)
    common = read_common(source)
    iteration = checkpoint_iteration(common)
    opt_common = common.get("optimizer", {})
    if optimizer_kind(opt_common) == "megatron_muon":
        raise CheckpointError(f"{source} already holds Muon optimizer state (muon-to-adam converts it to AdamW).")
    if optimizer_kind(opt_common) != "megatron":
        raise CheckpointError(f"{source} holds no Megatron distributed-optimizer state (saved with --no-save-optim?)")
    with owned(dst, "tools/convert_checkpoint.py adam-to-muon") as (into, lock):
        check_destination(into, iteration, overwrite)
        if fmt.adam_needs_resave(opt_common):  # Megatron-LM re-saves it parameter by parameter
            ckpt = _read_resaved(source, iteration, common, into)
        else:
            ckpt = fmt.read(source, SUPPORT, adam=True)
        # One optimizer, or with expert parallelism Megatron's chain of the dense and the expert one.
        parts = megatron_parts(ckpt.common.get("optimizer", {}))
        part_groups = [part.get("optimizer", {}).get("param_groups", []) for part in parts]
        step = int(max((g.get("step", 0) for groups in part_groups for g in groups), default=0))
        if iteration and step > iteration:
            # At most one optimizer step per iteration. torch's AdamW under Megatron-core 0.19.2
            # (no TE / Apex) counted a step once per parameter after a resume (fixed in our CPU
            # patches); such a checkpoint's step is not the number of updates.
            print(f"warning: the checkpoint's AdamW step {step} exceeds its iteration {iteration}; using {iteration}")
            step = iteration
        converted = 0
        for key in model_keys(ckpt):
            if not is_muon_key(key, exclude, router):
                continue
            exp_avg, _ = (ckpt.tensors.pop(_state_key(name, key)) for name in ADAM_STATES)
            ckpt.tensors[_state_key(MOMENTUM, key)] = (
                exp_avg.clone() if momentum == "exp_avg" else torch.zeros_like(exp_avg)
            )
            converted += 1
        optimizers = {
            name: {"grad_scaler": part.get("grad_scaler"), "param_groups": groups}
            for name, part, groups in zip(CHAIN, parts, part_groups)
        }
        ckpt.common["optimizer"] = dict(common_state(step, optimizers, {}), converted_from="megatron_adam")
        _retarget_args(ckpt, "muon")
        publish_iteration(into, iteration, _write(fmt, ckpt), lock, verified)
    written = os.path.join(dst, iteration_dir_name(iteration))
    return {"muon_matrices": converted, "scalar": len(model_keys(ckpt)) - converted, "step": step, "wrote": written}


def _read_resaved(source: str, iteration: int, common: Dict[str, Any], dst: str) -> Checkpoint:
    """``source`` (Megatron-LM's default distributed-optimizer format, at ``iteration``) re-saved fully
    reshardable by Megatron-LM (:mod:`.resave`) into a scratch directory inside ``dst`` (whose
    lock this process holds) that is removed afterwards, and read; its common state stays the
    source's."""
    from megatron_muon.checkpoint import save_lock, staging

    from . import resave

    if not hasattr(common.get("args"), "world_size"):
        raise CheckpointError(
            f"{source} does not hold its run's arguments, which the re-save needs (saved by Megatron-LM?)"
        )
    made = not os.path.lexists(dst)
    os.makedirs(dst, exist_ok=True)
    lock = save_lock.held(dst)  # the converter's, on its destination: leftovers there are its own to clear
    identity = lock.identity if lock is not None else staging.this_process()
    scratch = staging.make(
        os.path.join(dst, iteration_dir_name(iteration) + RESAVE), identity, locked=lock is not None, fixed=True
    )
    try:
        resaved = resave.resave_fully_reshardable(
            os.path.dirname(source), iteration, common["args"], staging.inner(scratch, "save")
        )
        check_source(resaved)
        ckpt = read_checkpoint(resaved)
    finally:
        staging.remove(scratch, [identity["token"]])
        if made and not os.listdir(dst):
            os.rmdir(dst)
    ckpt.common = dict(common, optimizer=ckpt.common["optimizer"])
    return ckpt


def muon_to_adam(
    src: str,
    dst: str,
    exp_avg: str = "zeros",
    beta1: float = 0.9,
    overwrite: bool = False,
    unverified_source: bool = False,
) -> Dict[str, int]:
    """Muon checkpoint -> Megatron DistributedOptimizer (AdamW, ``fully_reshardable``).

    ``exp_avg`` of former Muon matrices is zero, or ``(1 - beta1) * momentum`` with
    ``exp_avg='momentum'`` (Muon's momentum is a plain sum, AdamW's an average);
    ``exp_avg_sq`` is zero (printed as a warning: AdamW's first steps then take
    sign-like updates of size lr). Every other state of the registry is dropped."""
    check_paths(src, dst)
    source = resolve_source(src)
    verified = check_source(source, unverified_source)
    fmt = format_of(source)
    common = read_common(source)
    iteration = checkpoint_iteration(common)
    if optimizer_kind(common.get("optimizer")) == "megatron":
        raise CheckpointError(
            f"{source} holds Megatron's own optimizer state already (AdamW): adam-to-muon converts it to Muon."
        )
    require_ours(common.get("optimizer"), source)
    with owned(dst, "tools/convert_checkpoint.py muon-to-adam") as (into, lock):
        check_destination(into, iteration, overwrite)
        ckpt = fmt.read(source, SUPPORT)
        opt_common = ckpt.common.get("optimizer", {})
        converted = 0
        for key in model_keys(ckpt):
            states = {s.name: ckpt.tensors.pop(_state_key(s.name, key), None) for s in registry.MUON_STATES}
            m = states[MOMENTUM]
            if m is None:
                continue
            ckpt.tensors[_state_key(ADAM_STATES[0], key)] = (
                (1 - beta1) * m if exp_avg == "momentum" else torch.zeros_like(m)
            )
            ckpt.tensors[_state_key(ADAM_STATES[1], key)] = torch.zeros_like(m)
            converted += 1
        print(
            f"warning: exp_avg_sq of {converted} former Muon matrices is zero; AdamW's first updates "
            "of those parameters will be about lr in size per element."
        )
        step = int(opt_common.get("step", 0))
        optimizers = opt_common.get("optimizers", {})

        def megatron_part(names: Iterable[str]) -> Dict[str, Any]:
            """Megatron's common state of one distributed optimizer holding ``names``' groups."""
            groups = []
            for name in names:
                for group in optimizers[name].get("param_groups", []):
                    group = {k: v for k, v in group.items() if k not in ("params", "muon")}
                    group["step"] = float(step)
                    if group not in groups:
                        groups.append(group)
            part = {"optimizer": {"param_groups": groups}, "param_state_sharding_type": "fully_reshardable"}
            scaler = optimizers[next(iter(names))].get("grad_scaler")
            if scaler is not None:
                part["grad_scaler"] = scaler
            return part

        if "expert" in optimizers:  # expert parallelism: Megatron's chain, dense then expert
            ckpt.common["optimizer"] = {i: megatron_part([name]) for i, name in enumerate(CHAIN)}
        else:
            ckpt.common["optimizer"] = megatron_part(list(optimizers))
        if isinstance(ckpt.common.get("content_metadata"), dict):  # Megatron-LM loads by this label
            ckpt.common["content_metadata"] = dict(
                ckpt.common["content_metadata"], distrib_optim_sharding_type="fully_reshardable"
            )
        _retarget_args(ckpt, "adam")
        publish_iteration(into, iteration, _write(fmt, ckpt), lock, verified)
    written = os.path.join(dst, iteration_dir_name(iteration))
    return {"converted": converted, "step": step, "wrote": written}


def inspect(path: str) -> str:
    """A readable summary of a checkpoint (verified first when it has a manifest; read
    through the restricted unpickler either way)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = resolve_source(path)
    verified = check_source(path, unverified=True)
    metadata = read_dcp_metadata(path)
    fmt = format_of(path)
    common = read_common(path)
    opt = common.get("optimizer", {}) if isinstance(common.get("optimizer"), dict) else {}
    kinds = {"megatron_muon": "muon", "megatron": f"megatron {opt.get('param_state_sharding_type', 'chained')}"}
    kind = kinds.get(optimizer_kind(opt), "model only")
    lines = [
        f"checkpoint: {path}",
        f"format: {fmt.name}, " + ("verified against its manifest" if verified else "UNVERIFIED (no manifest)"),
        f"optimizer: {kind}",
    ]
    if "iteration" in common:
        lines.append(f"iteration: {common['iteration']}")
    extra = common.get("extra", {})
    for key in ("iteration", "layout", "args"):
        if key in extra:
            lines.append(f"{key}: {extra[key]}")
    if kind == "muon":
        lines.append(f"optimizer steps: {opt.get('step')}")
        cfg = opt.get("muon_config", {})
        if cfg:
            lines.append("muon settings: " + ", ".join(f"{k}={v}" for k, v in sorted(cfg.items())))
    tensors = {k: md for k, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
    by_state: Dict[str, int] = {}
    total = 0
    for key, md in tensors.items():
        if key.startswith("rng_state"):
            continue  # an fsdp_dtensor checkpoint's generator states (objects in torch_dist)
        numel = 1
        for s in md.size:
            numel *= s
        total += numel * md.properties.dtype.itemsize
        group = "model"
        if key.startswith(STATE_PREFIX):
            group = fmt.state_of_key(key)
        by_state[group] = by_state.get(group, 0) + numel
    lines.append(f"tensors: {len(tensors)}, {total / 2**20:.1f} MiB")
    for group, numel in sorted(by_state.items()):
        lines.append(f"  {group:16s} {numel:>14,d} elements")
    model = [k for k in tensors if not k.startswith((STATE_PREFIX, "rng_state"))]
    for key in sorted(model)[:200]:
        lines.append(f"  {key}  {tuple(tensors[key].size)}  {tensors[key].properties.dtype}")
    return "\n".join(lines)


def change_format(src: str, dst: str, to: str, overwrite: bool = False, unverified_source: bool = False) -> Dict:
    """``to-fsdp-dtensor`` / ``to-torch-dist``: the Muon checkpoint ``src`` in the format
    named ``to`` (read by its own format, written by that one), published as ``dst``'s iteration."""
    check_paths(src, dst)
    source = resolve_source(src)
    verified = check_source(source, unverified_source)
    held, target = format_of(source), formats.named(to)
    if held is target:
        raise CheckpointError(f"{source} is an {to} checkpoint already")
    common = read_common(source)
    if optimizer_kind(common.get("optimizer")) != "megatron_muon":
        raise CheckpointError(f"{source} holds no Muon optimizer state of megatron_muon: adam-to-muon first")
    iteration = checkpoint_iteration(common)
    with owned(dst, f"tools/convert_checkpoint.py {target.convert_command}") as (into, lock):
        check_destination(into, iteration, overwrite)
        ckpt = held.read(source, SUPPORT)
        publish_iteration(into, iteration, _write(target, ckpt), lock, verified)
    written = os.path.join(dst, iteration_dir_name(iteration))
    return {"tensors": len(ckpt.tensors), "iteration": iteration, "wrote": written}


_FUSED = re.compile(r"^(?P<prefix>.*\.experts)\.weight(?P<which>[12])$")
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.local_experts\.(?P<e>\d+)\.linear_fc(?P<which>[12])\.weight$")


def experts_state_dict(
    state: Dict[str, torch.Tensor], to: str, num_experts: Optional[int] = None
) -> Dict[str, torch.Tensor]:
    """Convert a (single-rank) torch state dict between the legacy fused ``GroupedMLP``
    (``experts.weight1`` ``[hidden, E*ffn(*2)]``, ``experts.weight2`` ``[E*ffn, hidden]``,
    read as per-expert ``view(E, hidden, -1)`` / ``view(E, -1, hidden)``) and per-expert
    ``SequentialMLP`` names (``experts.local_experts.<e>.linear_fc1/2.weight``, nn.Linear
    (out, in) orientation). GLU gate/up halves keep their order ([gate | up] columns of a
    fused expert are [gate; up] rows of its fc1). Distributed (torch_dist) checkpoints
    need no conversion: they store experts per expert, in model coordinates, already."""
    out: Dict[str, torch.Tensor] = {}
    if to == "sequential":
        if num_experts is None:
            raise CheckpointError("converting fused expert weights needs the number of local experts (--num-experts)")
        for name, t in state.items():
            m = _FUSED.match(name)
            if m is None:
                out[name] = t
                continue
            if m["which"] == "1":
                view = t.reshape(num_experts, t.shape[0], -1)  # (E, hidden, ffn[*2]): (in, out)
                fc = "linear_fc1"
            else:
                view = t.reshape(num_experts, -1, t.shape[1])  # (E, ffn, hidden): (in, out)
                fc = "linear_fc2"
            for e in range(num_experts):
                out[f"{m['prefix']}.local_experts.{e}.{fc}.weight"] = view[e].t().contiguous()
        return out
    if to == "legacy_grouped":
        groups: Dict[Tuple[str, str], Dict[int, torch.Tensor]] = {}
        for name, t in state.items():
            m = _PER_EXPERT.match(name)
            if m is None:
                out[name] = t
                continue
            groups.setdefault((m["prefix"], m["which"]), {})[int(m["e"])] = t
        for (prefix, which), experts in groups.items():
            views = torch.stack([experts[e].t() for e in sorted(experts)])  # (E, in, out)
            if which == "1":
                # Memory is expert-major: E blocks of (hidden, ffn) read back by view(E, hidden, -1).
                out[f"{prefix}.weight1"] = views.contiguous().view(views.shape[1], -1)
            else:
                out[f"{prefix}.weight2"] = views.contiguous().view(-1, views.shape[2])
        return out
    raise ValueError(f"experts conversion target must be 'sequential' or 'legacy_grouped', not {to!r}")


def convert_experts_file(src: str, dst: str, to: str, num_experts: Optional[int], overwrite: bool = False) -> None:
    """``experts`` on one torch file: a state dict of tensors, or Megatron-LM's legacy
    ``--ckpt-format torch`` file (``mp_rank_XX/model_optim_rng.pt``: ``model`` or ``model0``,
    ``model1``... per virtual stage). torch_dist checkpoints need no conversion."""
    if os.path.isdir(src):
        raise CheckpointError(
            f"{src} is a directory. torch_dist checkpoints (what tools/pretrain_gpt.py writes by default) "
            "store experts per expert in model coordinates and load into any expert layout: nothing to convert. "
            "`experts` converts one torch file: a state dict, or Megatron-LM's --ckpt-format torch "
            "mp_rank_XX/model_optim_rng.pt."
        )
    check_paths(src, dst)
    if os.path.exists(dst) and not overwrite:
        raise CheckpointError(f"{dst} already exists; pass --overwrite to replace it, or choose another name")
    state = torch_load(src, src)
    keys = [k for k in ("model", *(f"model{i}" for i in range(len(state)))) if isinstance(state, dict) and k in state]
    models = {k: state[k] for k in keys} if keys else {None: state}
    for key, model in models.items():
        if not isinstance(model, dict):
            raise CheckpointError(
                f"{src}{'' if key is None else f'[{key!r}]'} is a {type(model).__name__}, not a state dict "
                "(name -> tensor); `experts` reads a torch state dict or Megatron-LM's model_optim_rng.pt."
            )
        converted = experts_state_dict(model, to, num_experts)
        state = converted if key is None else dict(state, **{key: converted})
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(dst) + ".tmp-", dir=os.path.dirname(os.path.abspath(dst)))
    os.close(fd)
    try:
        torch.save(state, tmp)
        os.replace(tmp, dst)
    except BaseException:
        os.unlink(tmp)
        raise


def _print_to_pipe(text: str) -> None:
    """Print; a reader that stops early (``| head``) ends the output quietly, as in Unix tools."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Python would report the broken pipe again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


UNVERIFIED_HELP = (
    "convert a source that has no integrity manifest (saved without megatron_muon); the result is labelled "
    "as converted from an unverified source"
)


def main(argv: Optional[List[str]] = None) -> None:
    """Command line of ``tools/convert_checkpoint.py``."""
    import argparse

    parser = argparse.ArgumentParser(prog="convert_checkpoint.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    a2m = sub.add_parser("adam-to-muon", help="Megatron AdamW distributed-optimizer checkpoint -> Muon")
    a2m.add_argument("src")
    a2m.add_argument("dst")
    a2m.add_argument("--momentum", choices=("zeros", "exp_avg"), default="zeros")
    a2m.add_argument("--muon-exclude-patterns", nargs="*", default=[])
    a2m.add_argument("--muon-router", action="store_true", help="the router weight is a Muon matrix")
    a2m.add_argument("--overwrite", action="store_true", help="replace DST's iteration if it exists")
    a2m.add_argument("--unverified-source", action="store_true", help=UNVERIFIED_HELP)
    m2a = sub.add_parser("muon-to-adam", help="Muon checkpoint -> Megatron AdamW distributed optimizer")
    m2a.add_argument("src")
    m2a.add_argument("dst")
    m2a.add_argument("--exp-avg", choices=("zeros", "momentum"), default="zeros")
    m2a.add_argument("--beta1", type=float, default=0.9, help="AdamW beta1 (scales momentum into exp_avg)")
    m2a.add_argument("--overwrite", action="store_true", help="replace DST's iteration if it exists")
    m2a.add_argument("--unverified-source", action="store_true", help=UNVERIFIED_HELP)
    exp = sub.add_parser("experts", help="legacy fused GroupedMLP <-> per-expert weights of a torch state dict")
    exp.add_argument("src")
    exp.add_argument("dst")
    exp.add_argument("--to", choices=("sequential", "legacy_grouped"), required=True)
    exp.add_argument("--num-experts", type=int, default=None, help="local experts per fused tensor")
    exp.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    for name, target in MOVES.items():
        fmt = sub.add_parser(
            name, help=f"a Muon checkpoint, into {target.name} (DistributedOptimizer <-> Megatron-FSDP)"
        )
        fmt.add_argument("src")
        fmt.add_argument("dst")
        fmt.add_argument("--overwrite", action="store_true", help="replace DST's iteration if it exists")
        fmt.add_argument("--unverified-source", action="store_true", help=UNVERIFIED_HELP)
    ins = sub.add_parser("inspect", help="print what a checkpoint holds")
    ins.add_argument("path")
    args = parser.parse_args(argv)
    try:
        if args.command == "adam-to-muon":
            print(
                adam_to_muon(
                    args.src,
                    args.dst,
                    args.momentum,
                    args.muon_exclude_patterns,
                    args.muon_router,
                    args.overwrite,
                    args.unverified_source,
                )
            )
        elif args.command == "muon-to-adam":
            print(muon_to_adam(args.src, args.dst, args.exp_avg, args.beta1, args.overwrite, args.unverified_source))
        elif args.command in MOVES:
            print(change_format(args.src, args.dst, MOVES[args.command].name, args.overwrite, args.unverified_source))
        elif args.command == "experts":
            convert_experts_file(args.src, args.dst, args.to, args.num_experts, args.overwrite)
            print(f"wrote {args.dst}")
        else:
            _print_to_pipe(inspect(args.path))
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from e
    except OSError as e:  # an unwritable destination, a full disk: what and where, in one line
        print(f"error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        raise SystemExit(2) from e
