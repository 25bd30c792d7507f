#!/usr/bin/env python
"""An optimizer study on one recipe and layout: peers x learning rates x seeds, the same
tokens for every peer at a seed.

Each cell (peer, learning rate, seed) is one run of ``tools/pretrain_gpt.py``
(Megatron-LM's training loop) with the recipe, the peer's flags (:data:`PEERS`),
``--lr``, ``--seed`` and the flags after ``--`` (the layout: ``-- --tensor-model-parallel-size
2 --bf16``); the tool reads Megatron-LM's own log lines (``iteration N/ M | ... | lm loss:``
and ``validation loss at iteration N | lm loss value:``). ``--seed`` sets the model's
initialization and the data order, so every peer sees the same tokens at a seed; every
learning rate decays to the recipe's fraction of itself (:func:`decayed_to`). What the
runs say (``tools/study_report.py``): per peer its best learning rate (lowest mean final
validation loss over the seeds), that loss's mean and spread, and the tokens it needs to
reach a target (default: the reference peer's, AdamW's, best) under the pass rule. Writes
into ``--out``:

* ``study.md`` (also printed) and ``study.json``: the tables, the exact commands, device;
* ``curves.png``: each peer at its best learning rate, against tokens, with the seeds'
  spread; ``lr_sweep.png``: final validation loss against learning rate per peer
  (``--replot`` draws both again from ``study.json``);
* ``cells/<peer>/lr<LR>_seed<S>.json``: each finished run's curves and command. A study
  started again into the same ``--out`` reads finished cells back and runs only the others
  (an interrupted study resumes); a finished cell whose command differs is refused;
* ``runs/``: the runs' logs, removed at the end unless ``--keep-runs`` (only the logs the
  study names, and the folders they leave empty: anything else there stays).

The studies in docs/study.md (docs/images/compare_tiny_gqa, study_tp2_gqa256, ...) each
record the command that made them, in their ``study.md``.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

if __package__ in (None, ""):  # run as a script: the repository's root on the path, for tools.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools import study_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tools" / "pretrain_gpt.py"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


@dataclass(frozen=True)
class Peer:
    """One optimizer of a study: how it is called in the tables, its colour, its driver flags."""

    label: str
    color: str
    flags: Tuple[str, ...]


PEERS: Dict[str, Peer] = {
    "adamw": Peer("AdamW", "#4c72b0", ("--optimizer", "adam")),
    "muon": Peer("Muon, exact (ours)", "#c44e52", ("--optimizer", "muon")),
    "muon_blockwise": Peer("Muon, blockwise (ours)", "#dd8452", ("--optimizer", "muon", "--muon-tp-mode", "blockwise")),
    "megatron_muon": Peer(
        "Megatron-core Muon, blockwise", "#937860",
        ("--optimizer", "muon", "--muon-impl", "megatron", "--muon-tp-mode", "blockwise"),
    ),
    "megatron_muon_duplicated": Peer(
        "Megatron-core Muon, duplicated", "#8c613c",
        ("--optimizer", "muon", "--muon-impl", "megatron", "--muon-tp-mode", "duplicated"),
    ),
    "megatron_muon_distributed": Peer(
        "Megatron-core Muon, distributed", "#da8bc3",
        ("--optimizer", "muon", "--muon-impl", "megatron", "--muon-tp-mode", "distributed"),
    ),
    "muon_vr": Peer("Muon + variance reduction", "#55a868", ("--optimizer", "muon", "--muon-variance-reduction", "0.95")),
    "muon_cautious": Peer("Muon + cautious WD", "#8172b2", ("--optimizer", "muon", "--muon-cautious-weight-decay")),
    "muon_gram": Peer("Muon, Gram NS on every matrix", "#4c9a8c", ("--optimizer", "muon", "--muon-ns-method", "gram")),
    "muon_hyperball": Peer("Muon-Hyperball (ours)", "#2ca02c", ("--optimizer", "muon", "--muon-hyperball")),
    "muon_gram_auto": Peer("Muon, Gram NS by aspect ratio", "#64b5cd", ("--optimizer", "muon", "--muon-ns-method", "auto")),
    "muon_split_glu": Peer("Muon, gate and up apart", "#ccb974", ("--optimizer", "muon", "--muon-split-glu")),
    "muon_gram_auto_split_glu": Peer(
        "Muon, Gram NS by aspect ratio, gate and up apart", "#8c8c8c",
        ("--optimizer", "muon", "--muon-ns-method", "auto", "--muon-split-glu"),
    ),
}  # fmt: skip
"""The peers a study can hold. Megatron-core's Muon runs only in bf16 (give ``-- --bf16``)."""
LABELS = {name: p.label for name, p in PEERS.items()}
COLORS = {name: p.color for name, p in PEERS.items()}
LOSS_KEY = "lm loss"
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)$", re.M)
VALID = re.compile(r"validation loss at iteration (\d+)(?: on validation set)? \| lm loss value: ([0-9.E+-]+|nan|inf)")
SEQ_LENGTH = re.compile(r"^\s+seq_length \.+ (\d+)$", re.M)


@dataclass(frozen=True)
class Cell:
    """One run of the study."""

    peer: str
    lr: float
    seed: int

    @property
    def name(self) -> str:
        return f"{self.peer}/lr{self.lr:g}_seed{self.seed}"


def driver_command(
    cell: Cell,
    recipe: str,
    nproc: int = 1,
    train_iters: Optional[int] = None,
    eval_interval: Optional[int] = None,
    eval_iters: Optional[int] = None,
    data_cache_path: Optional[str] = None,
    extra: Sequence[str] = (),
    master_port: Optional[int] = None,
) -> List[str]:
    """The ``pretrain_gpt.py`` command line of one cell (under ``torchrun`` if nproc > 1: on
    ``master_port`` of this machine, else ``--standalone``, which picks a free one)."""
    rendezvous = (
        ["--standalone"] if master_port is None else ["--master-addr", "127.0.0.1", "--master-port", str(master_port)]
    )
    cmd = [TORCHRUN, *rendezvous, "--nproc-per-node", str(nproc)] if nproc > 1 else [sys.executable]
    cmd += [str(DRIVER), "--recipe", recipe, *PEERS[cell.peer].flags, "--log-interval", "1"]
    if not any(t.startswith("--min-lr") for t in extra):
        min_lr = decayed_to(cell.lr, _recipe_value(recipe, "lr"), _recipe_value(recipe, "min-lr"))
        if min_lr is not None:
            cmd += ["--min-lr", f"{min_lr:g}"]
    cmd += ["--lr", f"{cell.lr:g}", "--seed", str(cell.seed)]
    for flag, value in (
        ("--train-iters", train_iters),
        ("--eval-interval", eval_interval),
        ("--eval-iters", eval_iters),
        ("--data-cache-path", data_cache_path),
    ):
        if value is not None:
            cmd += [flag, str(value)]
    return cmd + list(extra)


def decayed_to(lr: float, recipe_lr: Optional[float], recipe_min_lr: Optional[float]) -> Optional[float]:
    """The ``--min-lr`` of a cell at ``lr``, None where the recipe's own applies: every
    learning rate decays to the fraction of itself the recipe's does (its min-lr / lr), so
    the peers' schedules have one shape whatever their peak. (A fixed min-lr would hold a low
    learning rate nearly constant while a high one decays tenfold: the peers would be
    compared on differently shaped schedules.) Without a recipe lr, only a min-lr above
    ``lr`` is lowered to it."""
    if recipe_min_lr is None:
        return None
    wanted = lr * recipe_min_lr / recipe_lr if recipe_lr else min(lr, recipe_min_lr)
    return None if f"{wanted:g}" == f"{recipe_min_lr:g}" else wanted


@functools.lru_cache(maxsize=None)
def _recipe_value(recipe: str, key: str) -> Optional[float]:
    """The recipe's ``lr`` or ``min-lr`` (None when it sets none); read once per study."""
    with warnings.catch_warnings():  # megatron.core's import-time notices
        warnings.simplefilter("ignore")
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
        from megatron_muon.megatron_lm.recipes import load_recipe, recipe_value
    value = recipe_value(load_recipe(recipe), key)
    return None if value is None else float(value)


def shown(cmd: Sequence[str]) -> str:
    """A command as a user types it: ``python``/``torchrun`` and paths relative to the repository."""

    def short(token: str) -> str:
        if token in (sys.executable, TORCHRUN):
            return "python" if token == sys.executable else "torchrun"
        path = Path(token)
        if path.is_absolute() and path.resolve().is_relative_to(ROOT):
            return str(path.resolve().relative_to(ROOT))
        return token

    return shlex.join(short(t) for t in cmd)


INTERRUPTED = threading.Event()
"""Set by the tool's Ctrl-C handler (:func:`_interrupt`), so that a Ctrl-C is never lost."""


def _interrupt(signum, frame) -> None:
    """SIGINT: remembered, then raised as usual. Python swallows an exception raised where
    it cannot propagate (in the at-fork handlers a new run's fork calls, "Exception
    ignored in ..."); :func:`run_driver` then sees the flag."""
    INTERRUPTED.set()
    raise KeyboardInterrupt


def _lost_interrupt(unraisable) -> None:
    """``sys.unraisablehook``: a Ctrl-C's KeyboardInterrupt that Python could not raise is
    not printed as an error (:func:`run_driver` raises it again); anything else is."""
    if not (issubclass(unraisable.exc_type, KeyboardInterrupt) and INTERRUPTED.is_set()):
        sys.__unraisablehook__(unraisable)


def catch_every_interrupt() -> None:
    """The tool's Ctrl-C handling (:func:`_interrupt`, :func:`_lost_interrupt`), unless Ctrl-C
    is ignored in this process (started in the background)."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt)
        sys.unraisablehook = _lost_interrupt


def run_driver(cmd: Sequence[str], log: Path) -> str:
    """Run one training, which ends with this process (killed, the study leaves no run
    behind: torchrun's ranks end with torchrun) or with a Ctrl-C of the tool, even one
    Python swallowed (:data:`INTERRUPTED`); its output goes to ``log`` and is returned."""
    from megatron_muon.megatron_lm.process_lifetime import die_with_this_process

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(list(cmd), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=die_with_this_process())  # fmt: skip
    try:
        while True:
            if INTERRUPTED.is_set():
                raise KeyboardInterrupt
            try:
                stdout, _ = proc.communicate(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                continue
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    log.write_text(stdout)
    if INTERRUPTED.is_set():
        raise KeyboardInterrupt
    if proc.returncode != 0:
        raise RuntimeError(f"{shown(cmd)} exited {proc.returncode}; last output:\n{stdout[-3000:]}")
    return stdout


def log_field(line: str, name: str) -> Optional[float]:
    """The number after ``| name:`` in one of Megatron-LM's iteration lines (None without it)."""
    m = re.search(rf"\| {re.escape(name)}: +([0-9.E+-]+|nan|inf) ", line + " ")
    return float(m.group(1)) if m else None


def read_log(text: str) -> Dict:
    """One run's numbers from Megatron-LM's log: ``train`` and ``valid`` as (iteration, loss)
    of every finite, not skipped training step and of every evaluation (the end-of-training
    one only if it adds an iteration), ``peak_lr``, ``tokens_per_s`` (median of global batch
    x sequence length / elapsed time) and ``tokens_per_iteration``."""
    seq = SEQ_LENGTH.search(text)
    train, valid, lrs, speed, batch = [], {}, [], [], None
    for m in ITERATION.finditer(text):
        line = m.group(2)
        loss, skipped = log_field(line, LOSS_KEY), log_field(line, "number of skipped iterations")
        if loss is None or skipped or not math.isfinite(loss):
            continue
        train.append((int(m.group(1)), loss))
        lrs.append(log_field(line, "learning rate") or 0.0)
        ms, batch = log_field(line, "elapsed time per iteration (ms)"), log_field(line, "global batch size")
        if seq and ms and batch:
            speed.append(batch * int(seq.group(1)) / (ms / 1000.0))
    for m in VALID.finditer(text):
        valid.setdefault(int(m.group(1)), float(m.group(2)))
    return {
        "train": train,
        "valid": sorted(valid.items()),
        "peak_lr": max(lrs, default=None),
        "tokens_per_s": statistics.median(speed) if speed else None,
        "tokens_per_iteration": int(batch * int(seq.group(1))) if seq and batch else 0,
    }


def describe_device(nproc: int) -> str:
    import torch

    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (gloo)"
    return f"{nproc} process(es), {where}"


def plan(peers: Sequence[str], lrs: Dict[str, List[float]], seeds: Sequence[int]) -> List[Cell]:
    """Every cell, seeds outermost and peers innermost: each peer's first run comes early (a
    peer whose flags fail, fails first), and a study stopped midway has whole seeds done."""
    depth = max(len(lrs[p]) for p in peers)
    return [
        Cell(peer, lrs[peer][i], seed) for seed in seeds for i in range(depth) for peer in peers if i < len(lrs[peer])
    ]


def read_back(path: Path, command: str) -> Optional[Dict]:
    """A finished cell's result, or None if it has not run; a result of another command is
    refused (a study's settings changed between runs into the same --out)."""
    if not path.is_file():
        return None
    result = json.loads(path.read_text())
    if result["command"] != command:
        raise SystemExit(
            f"compare_optimizers.py: error: {path} holds a run of another command:\n  {result['command']}\n"
            f"this study runs\n  {command}\nuse another --out, or remove that file to run the cell again"
        )
    return result


def run_cell(cell: Cell, cmd: List[str], out: Path) -> Dict:
    """Run one cell and write its result (``cells/...json``, whole or not at all)."""
    started = time.monotonic()
    result = read_log(run_driver(cmd, out / "runs" / f"{cell.name}.log"))
    result.update(peer=cell.peer, lr=cell.lr, seed=cell.seed, command=shown(cmd),
                  seconds=round(time.monotonic() - started, 1))  # fmt: skip
    path = out / "cells" / f"{cell.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.tmp")
    partial.write_text(json.dumps(result) + "\n")
    os.replace(partial, path)
    return result


def remove_logs(out: Path, cells: Sequence[Cell]) -> None:
    """The cells' logs (``runs/PEER/lrLR_seedS.log``) and the folders they leave empty; a
    file the study did not name stays, with its folders."""
    runs = out / "runs"
    for cell in cells:
        (runs / f"{cell.name}.log").unlink(missing_ok=True)
    for folder in sorted({(runs / cell.name).parent for cell in cells}) + [runs]:
        try:
            folder.rmdir()
        except OSError:  # absent, or holding what the study did not write
            pass


def lr_grid(specs: Sequence[str], peers: Sequence[str], recipe_lr: Optional[float]) -> Dict[str, List[float]]:
    """``--lr PEER=A,B,C`` (or ``--lr A,B`` for every peer) as each peer's learning rates;
    a peer not named runs at the recipe's."""
    grid: Dict[str, List[float]] = {}
    for spec in specs:
        names, _, values = spec.rpartition("=")
        for name in names.split(",") if names else peers:
            if name not in peers:
                raise SystemExit(f"compare_optimizers.py: error: --lr {spec}: {name!r} is not one of --peers")
            grid[name] = [float(v) for v in values.split(",") if v]
    for name in peers:
        if name not in grid:
            if recipe_lr is None:
                raise SystemExit(f"compare_optimizers.py: error: give --lr {name}=... (the recipe sets no lr)")
            grid[name] = [recipe_lr]
    return grid


def heading(recipe: str, peers: Sequence[str], seeds: int) -> str:
    names = ", ".join(LABELS[p] for p in peers)
    return f"{Path(recipe).stem}: {names}; best learning rate each, {seeds} seed(s)"


def write_outputs(out: Path, data: Dict) -> str:
    """``study.json``, ``study.md`` and the two plots from the study's data; the markdown."""
    study = data["study"]
    title = data["title"]
    study_report.plot_curves(study, LABELS, COLORS, out / "curves.png", title)
    study_report.plot_lr_sweep(study, LABELS, COLORS, out / "lr_sweep.png", title)
    body = study_report.tables(study, LABELS)
    md = (
        f"# {title}\n\n![loss curves](curves.png)\n\n{body}\n![final loss against learning rate](lr_sweep.png)\n\n"
        f"Device: {data['device']}. Produced by\n\n```\n{data['command']}\n```\n\nwhich ran (one line per run)\n\n```\n"
        + "\n".join(data["commands"])
        + "\n```\n"
    )
    (out / "study.md").write_text(md)
    (out / "study.json").write_text(json.dumps(data, indent=1) + "\n")
    return body


def _json_keys(study: Dict) -> Dict:
    """JSON turns the grid's float keys into strings: back to floats."""
    for s in study["peers"].values():
        s["grid"] = {float(k): v for k, v in s["grid"].items()}
    return study


def parse_args(argv: Optional[Sequence[str]] = None) -> Tuple[argparse.Namespace, List[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        usage="%(prog)s --out DIR [options] [-- pretrain_gpt.py flags for every run]",
    )
    p.add_argument("--recipe", default="tiny_gqa", help="recipe name or YAML file (default tiny_gqa)")
    p.add_argument("--out", required=True, type=Path, help="folder for the study (a study there resumes)")
    p.add_argument("--peers", nargs="+", default=["adamw", "muon"], choices=sorted(PEERS), metavar="PEER",
                   help="the optimizers: " + "; ".join(f"{k}: {v.label}" for k, v in PEERS.items()))  # fmt: skip
    p.add_argument("--lr", action="append", default=[], metavar="[PEER[,PEER]=]LR[,LR...]",
                   help="learning rates to try (repeatable; without PEER= for every peer; default: the recipe's)")  # fmt: skip
    p.add_argument("--seeds", nargs="+", type=int, default=[1234], help="seeds (default: Megatron-LM's 1234)")
    p.add_argument("--reference", default="adamw", help="the peer whose best final loss is the target")
    p.add_argument("--target", type=float, default=None, help="validation loss to reach (default: the reference's)")
    p.add_argument("--pass-margin", type=float, default=study_report.PASS_MARGIN,
                   help="the pass rule's margin: (target - mean) * sqrt(seeds) >= it")  # fmt: skip
    for name in ("--train-iters", "--eval-interval", "--eval-iters"):
        p.add_argument(name, type=int, default=None, help="default: the recipe's")
    p.add_argument("--nproc", type=int, default=1, help="ranks; > 1 runs under torchrun")
    p.add_argument("--master-port", type=int, default=None,
                   help="torchrun's rendezvous port with --nproc > 1 (default: --standalone, a free port)")  # fmt: skip
    p.add_argument("--data-cache-path", default=None, help="shared by every run (default: the driver's)")
    p.add_argument("--keep-runs", action="store_true", help="keep OUT/runs/ (the runs' logs)")
    p.add_argument("--replot", action="store_true", help="only draw the plots again from OUT/study.json")
    args = p.parse_args(argv)
    if len(set(args.peers)) != len(args.peers):
        p.error("--peers: a peer named twice")
    return args, extra


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, extra = parse_args(argv)
    out = args.out.resolve()
    if args.replot:
        data = json.loads((out / "study.json").read_text())
        data["study"] = _json_keys(data["study"])
        write_outputs(out, data)
        print(f"[study] drew {out / 'curves.png'} and {out / 'lr_sweep.png'} from {out / 'study.json'}")
        return 0
    grid = lr_grid(args.lr, args.peers, _recipe_value(args.recipe, "lr"))
    cells = plan(args.peers, grid, args.seeds)
    commands = {
        cell: driver_command(cell, args.recipe, args.nproc, args.train_iters, args.eval_interval, args.eval_iters,
                             args.data_cache_path, extra, args.master_port)
        for cell in cells
    }  # fmt: skip
    results, spent = {}, []
    for cell in cells:
        results[cell] = read_back(out / "cells" / f"{cell.name}.json", shown(commands[cell]))
    done = sum(r is not None for r in results.values())
    if done:
        print(f"[study] {done} of {len(cells)} runs read back from {out / 'cells'}", flush=True)
    for cell in cells:
        if results[cell] is not None:
            continue
        print(f"[study] {shown(commands[cell])}", flush=True)
        results[cell] = run_cell(cell, commands[cell], out)
        spent.append(results[cell]["seconds"])
        done += 1
        left = (len(cells) - done) * statistics.fmean(spent)
        print(f"[study] {done}/{len(cells)} done ({cell.name}, {spent[-1]:.0f} s); about {left / 60:.1f} min left",
              flush=True)  # fmt: skip
    study = study_report.summarize(list(results.values()), args.reference, args.target, args.pass_margin)
    tool = shown([sys.executable, str(Path(__file__).resolve()), *(argv if argv is not None else sys.argv[1:])])
    data = {
        "recipe": args.recipe,
        "title": heading(args.recipe, args.peers, len(args.seeds)),
        "device": describe_device(args.nproc),
        "command": tool,
        "commands": [shown(commands[c]) for c in cells],
        "study": study,
    }
    body = write_outputs(out, data)
    if not args.keep_runs:
        remove_logs(out, cells)
    print(body, end="")
    return 0


if __name__ == "__main__":
    catch_every_interrupt()
    try:
        sys.exit(main())
    except RuntimeError as exc:  # a training run failed: its command and last output
        sys.exit(f"compare_optimizers.py: {exc}")
    except KeyboardInterrupt:  # Ctrl-C: the run in progress ends with the tool (tied to it)
        print("compare_optimizers.py: interrupted; the finished runs stay in OUT/cells, and the same command "
              "runs only the others", file=sys.stderr)  # fmt: skip
        sys.exit(130)
