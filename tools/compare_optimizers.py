#!/usr/bin/env python
"""AdamW against Muon on one recipe: same model, data, seed and schedule; two loss curves.

Runs ``tools/pretrain_gpt.py`` (Megatron-LM's training loop) twice, ``--optimizer adam``
(Megatron-core's AdamW) then ``--optimizer muon``, with the same recipe, flags, seed and
data cache, and reads Megatron-LM's own log lines (``iteration N/ M | ... | lm loss: ...``,
``validation loss at iteration N | lm loss value: ...``). Both learning rates are the recipe's ``lr`` unless ``--adam-lr`` /
``--muon-lr`` say otherwise (Muon's default 'moonlight' update scale matches AdamW's update
RMS, so an AdamW learning rate carries over); the schedule keeps the recipe's ``min-lr``
(lowered to the learning rate when it is larger). Writes into ``--out``:

* ``loss_curves.png``: training loss per iteration (faint: raw; solid: moving average)
  and the validation losses, both optimizers: the whole run, and beside it the curves
  after their first tenth (``--replot`` draws it again from ``compare.json``);
* ``compare.md``: peak lr, final train loss (mean of the last 10 iterations), final and
  best validation loss, median tokens/s, and the iterations each run needs to reach
  AdamW's final validation loss (linearly interpolated between evaluations, so good to
  about ``--eval-interval``; "not reached" when it never does), then the exact commands;
* ``compare.json``: the same, the commands, and both curves;
* ``runs/``: each run's output (``adam.log``, ``muon.log``), removed at the end unless
  ``--keep-runs``.

The table is also printed. Flags after ``--`` go to every run (``-- --seed 7``).
``--variants vr cautious`` adds Muon runs with nanochat's variance reduction
(``--muon-variance-reduction 0.95``) and/or cautious weight decay, at Muon's learning
rate, to the same plot and table. The picture in docs/images/compare_tiny_gqa::

    python tools/compare_optimizers.py --recipe tiny_gqa --out docs/images/compare_tiny_gqa \\
        --train-iters 300 --eval-interval 25 --eval-iters 8 --adam-lr 0.002
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tools" / "pretrain_gpt.py"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
OPTIMIZERS = ("adam", "muon")
LABELS = {"adam": "AdamW", "muon": "Muon"}
COLORS = {"adam": "#4c72b0", "muon": "#c44e52"}
VARIANTS: Dict[str, Tuple[str, str, List[str]]] = {
    # name: (label, color, the Muon run's extra driver flags: generated MuonConfig flags)
    "vr": ("Muon + variance reduction", "#55a868", ["--muon-variance-reduction", "0.95"]),
    "cautious": ("Muon + cautious WD", "#8172b2", ["--muon-cautious-weight-decay"]),
}
for _name, (_label, _color, _) in VARIANTS.items():
    LABELS[f"muon_{_name}"], COLORS[f"muon_{_name}"] = _label, _color
LOSS_KEY = "lm loss"
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)$", re.M)
VALID = re.compile(r"validation loss at iteration (\d+)(?: on validation set)? \| lm loss value: ([0-9.E+-]+|nan|inf)")
SEQ_LENGTH = re.compile(r"^\s+seq_length \.+ (\d+)$", re.M)
Points = List[Tuple[int, float]]


def driver_command(
    optimizer: str,
    out: Path,
    recipe: str,
    nproc: int = 1,
    lr: Optional[float] = None,
    train_iters: Optional[int] = None,
    eval_interval: Optional[int] = None,
    eval_iters: Optional[int] = None,
    data_cache_path: Optional[str] = None,
    extra: Sequence[str] = (),
    master_port: Optional[int] = None,
) -> List[str]:
    """The ``pretrain_gpt.py`` command line of one run (under ``torchrun`` if nproc > 1: on
    ``master_port`` of this machine, else ``--standalone``, which picks a free one)."""
    rendezvous = (
        ["--standalone"] if master_port is None else ["--master-addr", "127.0.0.1", "--master-port", str(master_port)]
    )
    cmd = [TORCHRUN, *rendezvous, "--nproc-per-node", str(nproc)] if nproc > 1 else [sys.executable]
    cmd += [str(DRIVER), "--recipe", recipe, "--optimizer", optimizer, "--log-interval", "1"]
    if lr is not None and not any(t.startswith("--min-lr") for t in extra):
        min_lr = _recipe_min_lr(recipe)
        if min_lr is not None and min_lr > lr:
            cmd += ["--min-lr", str(lr)]  # the scheduler needs lr >= min-lr
    for flag, value in (
        ("--lr", lr),
        ("--train-iters", train_iters),
        ("--eval-interval", eval_interval),
        ("--eval-iters", eval_iters),
        ("--data-cache-path", data_cache_path),
    ):
        if value is not None:
            cmd += [flag, str(value)]
    return cmd + list(extra)


def _recipe_min_lr(recipe: str) -> Optional[float]:
    with warnings.catch_warnings():  # megatron.core's import-time notices
        warnings.simplefilter("ignore")
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
        from megatron_muon.megatron_lm.recipes import load_recipe
    value = {str(k).replace("_", "-"): v for k, v in load_recipe(recipe).items()}.get("min-lr")
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


def run_driver(cmd: Sequence[str], log: Path) -> str:
    """Run one training; its output goes to ``log`` and is returned."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(list(cmd), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log.write_text(proc.stdout)
    if proc.returncode != 0:
        raise RuntimeError(f"{shown(cmd)} exited {proc.returncode}; last output:\n{proc.stdout[-3000:]}")
    return proc.stdout


def log_field(line: str, name: str) -> Optional[float]:
    """The number after ``| name:`` in one of Megatron-LM's iteration lines (None without it)."""
    m = re.search(rf"\| {re.escape(name)}: +([0-9.E+-]+|nan|inf) ", line + " ")
    return float(m.group(1)) if m else None


def read_log(text: str) -> Tuple[Points, Points, Optional[float], List[float]]:
    """``(train, valid, peak_lr, tokens_per_s)`` from Megatron-LM's log: (iteration, loss) of
    every finite, not skipped training step and of every evaluation (the end-of-training one
    only if it adds an iteration), and each step's tokens per second (global batch x
    sequence length / elapsed time)."""
    seq = SEQ_LENGTH.search(text)
    train, valid, lrs, speed = [], {}, [], []
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
    return train, sorted(valid.items()), max(lrs, default=None), speed


def describe_device(nproc: int) -> str:
    import torch

    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (gloo)"
    return f"{nproc} process(es), {where}"


def iterations_to_reach(valid: Points, target: float) -> Optional[float]:
    """First iteration at which the validation loss reaches ``target``, linearly interpolated
    between the two evaluations around the crossing; ``None`` if it never does."""
    prev = None
    for it, loss in valid:
        if loss <= target:
            if prev is None or prev[1] == loss:
                return float(it)
            (i0, l0) = prev
            return i0 + (l0 - target) / (l0 - loss) * (it - i0)
        prev = (it, loss)
    return None


def moving_average(values: Sequence[float], window: int) -> List[float]:
    """Trailing mean over up to ``window`` values."""
    sums = [0.0]
    for v in values:
        sums.append(sums[-1] + v)
    return [(sums[i + 1] - sums[max(0, i + 1 - window)]) / min(i + 1, window) for i in range(len(values))]


def summarize(
    train: Points, valid: Points, throughput: Sequence[float], target: Optional[float], peak_lr: Optional[float] = None
) -> Dict:
    """One run's row of the table (``target``: the validation loss to reach, AdamW's final)."""
    last = [loss for _, loss in train[-10:]]
    return {
        "peak_lr": peak_lr,
        "iterations": train[-1][0] if train else 0,
        "final_train_loss": statistics.fmean(last) if last else None,
        "final_valid_loss": valid[-1][1] if valid else None,
        "best_valid_loss": min(loss for _, loss in valid) if valid else None,
        "tokens_per_s": statistics.median(throughput) if throughput else None,
        "iters_to_adam_final_valid": iterations_to_reach(valid, target) if target is not None else None,
    }


def _fmt(value: Optional[float], spec: str = ".4f") -> str:
    return "n/a" if value is None else format(value, spec)


def table(summaries: Dict[str, Dict], eval_interval: Optional[int]) -> str:
    rows = [
        "| optimizer | peak lr | final train loss (mean of last 10) | final valid loss | best valid loss "
        "| tokens/s (median) | iterations to reach AdamW's final valid loss |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for opt, s in summaries.items():
        reach = s["iters_to_adam_final_valid"]
        reach = "not reached" if reach is None else f"{reach:.0f} of {s['iterations']}"
        cells = [
            LABELS[opt],
            _fmt(s["peak_lr"], "g"),
            _fmt(s["final_train_loss"]),
            _fmt(s["final_valid_loss"]),
            _fmt(s["best_valid_loss"]),
            _fmt(s["tokens_per_s"], ".0f"),
            reach,
        ]
        rows.append("| " + " | ".join(cells) + " |")
    note = f"Validation every {eval_interval} iterations" if eval_interval else "Validation at the recipe's interval"
    return "\n".join(rows) + f"\n\n{note}; the crossing is linearly interpolated between evaluations.\n"


def plot(
    curves: Dict[str, Dict[str, Points]],
    path: Path,
    title: str,
    target: Optional[float] = None,
    reach: Optional[float] = None,
) -> Path:
    """Training (raw, faint; moving average, solid) and validation losses of every run: the
    whole run on the left, the curves after their first steep tenth on the right (where
    they separate)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (whole, zoom) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw=dict(width_ratios=[1, 2]))
    tops, lows = [], []
    for opt, c in curves.items():
        name = LABELS[opt] + (f" (lr {c['peak_lr']:g})" if c.get("peak_lr") else "")
        its, losses = zip(*c["train"]) if c["train"] else ((), ())
        window = max(1, len(losses) // 30)
        smooth = moving_average(losses, window)
        for ax in (whole, zoom):
            ax.plot(its, losses, color=COLORS[opt], alpha=0.2, lw=0.8)
            ax.plot(its, smooth, color=COLORS[opt], lw=1.8, label=f"{name} train, mean of {window}")
            if c["valid"]:
                ax.plot(*zip(*c["valid"]), "o--", color=COLORS[opt], ms=4, lw=1, label=f"{name} validation")
        tops += smooth[len(smooth) // 10 : len(smooth) // 10 + 1]
        lows += smooth + [loss for _, loss in c["valid"]]
    for ax in (whole, zoom):
        if target is not None:
            ax.axhline(target, color="gray", ls=":", lw=1, label="AdamW final validation loss")
        if reach is not None:
            ax.axvline(reach, color=COLORS["muon"], ls=":", lw=1, label=f"Muon reaches it at ~{reach:.0f}")
        ax.set(xlabel="iteration", ylabel=LOSS_KEY)
        ax.grid(alpha=0.3)
    whole.set_title("every iteration", fontsize=10)
    if tops and lows:
        zoom.set_ylim(min(lows) - 0.1 * (max(tops) - min(lows)), max(tops) + 0.1 * (max(tops) - min(lows)))
    zoom.set_title("after the first tenth", fontsize=10)
    zoom.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def replot(out: Path) -> Path:
    """``loss_curves.png`` drawn again from ``out/compare.json`` (no run)."""
    data = json.loads((out / "compare.json").read_text())
    curves = {name: {k: (v if k == "peak_lr" else [tuple(p) for p in v]) for k, v in c.items()}
              for name, c in data["curves"].items()}  # fmt: skip
    reach = data["summary"].get("muon", {}).get("iters_to_adam_final_valid")
    return plot(curves, out / "loss_curves.png", title(data["recipe"], len(curves) > len(OPTIMIZERS)),
                data.get("target_valid_loss"), reach)  # fmt: skip


def title(recipe: str, variants: bool) -> str:
    return f"{Path(recipe).stem}: AdamW vs Muon{' (+ variants)' if variants else ''}, same data and seed"


def parse_args(argv: Optional[Sequence[str]] = None) -> Tuple[argparse.Namespace, List[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        usage="%(prog)s --out DIR [options] [-- pretrain_gpt.py flags for both runs]",
    )
    p.add_argument("--recipe", default="tiny_gqa", help="recipe name or YAML file (default tiny_gqa)")
    p.add_argument("--out", required=True, type=Path, help="folder for the PNG, markdown, JSON and logs")
    for name in ("--train-iters", "--eval-interval", "--eval-iters"):
        p.add_argument(name, type=int, default=None, help="default: the recipe's")
    p.add_argument("--nproc", type=int, default=1, help="ranks; > 1 runs under torchrun")
    p.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="torchrun's rendezvous port with --nproc > 1 (default: --standalone, a free port)",
    )
    p.add_argument("--adam-lr", type=float, default=None, help="AdamW's --lr (default: the recipe's)")
    p.add_argument("--muon-lr", type=float, default=None, help="Muon's --lr (default: the recipe's)")
    p.add_argument("--data-cache-path", default=None, help="shared by both runs (default: the driver's)")
    p.add_argument("--keep-runs", action="store_true", help="keep OUT/runs/ (the runs' logs)")
    p.add_argument("--replot", action="store_true", help="only draw OUT/loss_curves.png again from OUT/compare.json")
    p.add_argument(
        "--variants",
        nargs="*",
        default=[],
        choices=sorted(VARIANTS),
        help="also run Muon with these variants: "
        + "; ".join(f"{k}: {v[0]} ({' '.join(v[2])})" for k, v in VARIANTS.items()),
    )
    return p.parse_args(argv), extra


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, extra = parse_args(argv)
    out = args.out.resolve()
    if args.replot:
        print(f"[compare] drew {replot(out)} from {out / 'compare.json'}")
        return 0
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    commands, curves, throughput, device = {}, {}, {}, ""
    plan = [(opt, opt, []) for opt in OPTIMIZERS]
    plan += [(f"muon_{v}", "muon", VARIANTS[v][2]) for v in dict.fromkeys(args.variants)]
    for name, opt, flags in plan:
        cmd = driver_command(
            opt,
            out,
            args.recipe,
            args.nproc,
            args.adam_lr if opt == "adam" else args.muon_lr,
            args.train_iters,
            args.eval_interval,
            args.eval_iters,
            args.data_cache_path,
            [*extra, *flags],
            args.master_port,
        )
        commands[name] = shown(cmd)
        print(f"[compare] {commands[name]}", flush=True)
        train, valid, peak_lr, throughput[name] = read_log(run_driver(cmd, runs / f"{name}.log"))
        curves[name] = {"train": train, "valid": valid, "peak_lr": peak_lr}
    device = describe_device(args.nproc)
    adam_valid = curves["adam"]["valid"]
    target = adam_valid[-1][1] if adam_valid else None
    summaries = {o: summarize(c["train"], c["valid"], throughput[o], target, c["peak_lr"]) for o, c in curves.items()}
    reach = summaries["muon"]["iters_to_adam_final_valid"]
    heading = title(args.recipe, bool(args.variants))
    plot(curves, out / "loss_curves.png", heading, target, reach)
    tool = shown([sys.executable, str(Path(__file__).resolve()), *(argv if argv is not None else sys.argv[1:])])
    body = table(summaries, args.eval_interval)
    md = (
        f"# {heading}\n\n![loss curves](loss_curves.png)\n\n{body}\nDevice: {device or 'unknown'}. "
        f"Produced by\n\n```\n{tool}\n```\n\nwhich ran\n\n```\n" + "\n".join(commands.values()) + "\n```\n"
    )
    (out / "compare.md").write_text(md)
    (out / "compare.json").write_text(
        json.dumps(
            {
                "recipe": args.recipe,
                "device": device,
                "command": tool,
                "commands": commands,
                "target_valid_loss": target,
                "summary": summaries,
                "curves": curves,
            },
            indent=1,
        )
        + "\n"
    )
    if not args.keep_runs:
        shutil.rmtree(runs)
    print(body, end="")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError as exc:  # a training run failed: its command and last output
        sys.exit(f"compare_optimizers.py: {exc}")
