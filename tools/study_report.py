"""What an optimizer study's finished runs say: per peer, the best learning rate, the final
validation loss over seeds at it, and the tokens it needs to reach a target loss under a pass
rule; the tables and the two plots (``tools/compare_optimizers.py`` runs the study).

A run is one cell (peer, learning rate, seed): its training and validation curves, as
Megatron-LM logged them. Everything here works on those numbers alone, so ``--replot`` and
the tests need no training.

The pass rule (modded-nanogpt's): a peer reaches the target at the first evaluation where the
mean of its n seeds' validation losses ``m`` satisfies ``(target - m) * sqrt(n) >= margin``
(0.004 by default), linearly interpolated between evaluations.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

Points = List[Tuple[int, float]]
PASS_MARGIN = 0.004


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


def final_loss(run: Dict) -> float:
    """A run's last validation loss; ``inf`` for a run that diverged or never evaluated (it
    loses every comparison instead of being left out)."""
    valid = run["valid"]
    return valid[-1][1] if valid and math.isfinite(valid[-1][1]) else math.inf


def per_iteration(runs: Sequence[Dict], key: str) -> List[Tuple[int, List[float]]]:
    """Each run's value of a curve (``train`` or ``valid``) at the iterations all of them have."""
    by_run = [dict(map(tuple, run[key])) for run in runs]
    common = sorted(set.intersection(*(set(d) for d in by_run))) if by_run else []
    return [(it, [d[it] for d in by_run]) for it in common]


def spread(values: Sequence[float]) -> float:
    """Sample standard deviation (0 for one value)."""
    return statistics.stdev(values) if len(values) > 1 else 0.0


def summarize_peer(runs: Sequence[Dict]) -> Dict:
    """One peer's runs: each learning rate's final validation losses (per seed, mean, spread)
    and the best learning rate (lowest mean); at it, the seeds' mean curves and the band of
    their validation losses."""
    by_lr: Dict[float, List[Dict]] = {}
    for run in sorted(runs, key=lambda r: r["seed"]):
        by_lr.setdefault(run["lr"], []).append(run)
    grid = {}
    for lr, cell in sorted(by_lr.items()):
        finals = [final_loss(r) for r in cell]
        grid[lr] = {"seeds": [r["seed"] for r in cell], "final_valid": finals, "mean": statistics.fmean(finals),
                    "spread": spread(finals) if all(map(math.isfinite, finals)) else math.inf}  # fmt: skip
    best = min(grid, key=lambda lr: grid[lr]["mean"])
    at_best = by_lr[best]
    speeds = [r["tokens_per_s"] for r in at_best if r.get("tokens_per_s")]
    valid = per_iteration(at_best, "valid")
    return {
        "grid": grid,
        "best_lr": best,
        "best_at_edge": len(grid) > 1 and best in (min(grid), max(grid)),  # the grid may not hold the optimum
        "final_valid_mean": grid[best]["mean"],
        "final_valid_spread": grid[best]["spread"],
        "seeds": len(at_best),
        "tokens_per_iteration": at_best[0]["tokens_per_iteration"],
        "iterations": max(it for r in at_best for it, _ in r["train"]) if at_best[0]["train"] else 0,
        "tokens_per_s": statistics.median(speeds) if speeds else None,
        "valid": [(it, statistics.fmean(v)) for it, v in valid],
        "train": [(it, statistics.fmean(v)) for it, v in per_iteration(at_best, "train")],
        "valid_low": [(it, min(v)) for it, v in valid],
        "valid_high": [(it, max(v)) for it, v in valid],
    }


def tokens_to_target(peer: Dict, target: float, margin: float = PASS_MARGIN) -> Optional[float]:
    """Tokens the peer (at its best learning rate) needs for its seeds' mean validation loss
    to pass the rule ``(target - mean) * sqrt(n) >= margin``; ``None`` if it never does."""
    level = target - margin / math.sqrt(peer["seeds"])
    its = iterations_to_reach(peer["valid"], level)
    return None if its is None else its * peer["tokens_per_iteration"]


def summarize(runs: Sequence[Dict], reference: str, target: Optional[float], margin: float = PASS_MARGIN) -> Dict:
    """The study's numbers: per peer (:func:`summarize_peer`) plus its tokens to the target
    (default: the ``reference`` peer's best mean final validation loss) under the pass rule."""
    peers: Dict[str, Dict] = {}
    for run in runs:
        peers.setdefault(run["peer"], []).append(run)
    out = {name: summarize_peer(cell) for name, cell in peers.items()}
    if target is None and reference in out:
        target = out[reference]["final_valid_mean"]
    for s in out.values():
        s["tokens_to_target"] = tokens_to_target(s, target, margin) if target is not None else None
    return {"target": target, "reference": reference, "margin": margin, "peers": out}


def _fmt(value: Optional[float], spec: str = ".4f") -> str:
    return "n/a" if value is None or not math.isfinite(value) else format(value, spec)


def _tokens(value: Optional[float]) -> str:
    if value is None:
        return "not reached"
    return f"{value / 1e6:.2f} M" if value >= 1e6 else f"{value:,.0f}"


def tables(study: Dict, labels: Dict[str, str]) -> str:
    """The study's markdown: the headline table (each peer at its best learning rate) and the
    learning-rate grid (mean final validation loss, spread over seeds)."""
    peers, target, reference = study["peers"], study["target"], study["reference"]
    total = peers[reference]["iterations"] * peers[reference]["tokens_per_iteration"] if reference in peers else None
    rows = [
        f"| peer | best lr | final valid loss (mean ± spread, seeds) | tokens to reach {_fmt(target)} "
        f"(pass rule) | of {labels.get(reference, reference)}'s tokens | tokens/s (median) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, s in peers.items():
        reach = s["tokens_to_target"]
        share = "n/a" if reach is None or not total else f"{reach / total:.2f}"
        rows.append(
            f"| {labels.get(name, name)} | {s['best_lr']:g}{' (grid edge)' if s.get('best_at_edge') else ''} | "
            f"{_fmt(s['final_valid_mean'])} ± "
            f"{_fmt(s['final_valid_spread'])} ({s['seeds']}) | {_tokens(reach)} | {share} | "
            f"{_fmt(s['tokens_per_s'], '.0f')} |"
        )
    lrs = sorted({lr for s in peers.values() for lr in s["grid"]})
    grid = ["| peer | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |", "|---|" + "---:|" * len(lrs)]
    for name, s in peers.items():
        cells = []
        for lr in lrs:
            g = s["grid"].get(lr)
            text = "" if g is None else f"{_fmt(g['mean'])} ± {_fmt(g['spread'])}"
            cells.append(f"**{text}**" if g is not None and lr == s["best_lr"] else text)
        grid.append(f"| {labels.get(name, name)} | " + " | ".join(cells) + " |")
    rule = (
        "A best learning rate at the edge of its grid may not be the peer's best: widen the grid. "
        f"A peer reaches the target at the first evaluation where its seeds' mean validation loss m "
        f"has (target - m) * sqrt(n) >= {study['margin']:g}, interpolated between evaluations; the "
        f"target is {labels.get(reference, reference)}'s best mean final validation loss unless given."
    )
    return "\n".join(rows) + f"\n\n{rule}\n\nFinal validation loss per learning rate (mean ± spread over seeds; " \
        "bold: the best):\n\n" + "\n".join(grid) + "\n"  # fmt: skip


def plot_curves(study: Dict, labels: Dict[str, str], colors: Dict[str, str], path: Path, title: str) -> Path:
    """Each peer at its best learning rate against tokens: the seeds' mean validation loss
    (markers) within their min-max band, and the mean training loss (moving average, faint);
    the whole run on the left, after the first tenth on the right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (whole, zoom) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw=dict(width_ratios=[1, 2]))
    lows, tops = [], []
    most = max((s["iterations"] * s["tokens_per_iteration"] for s in study["peers"].values()), default=0)
    unit, unit_name = (1e6, "millions") if most >= 1e6 else (1e3, "thousands")
    for name, s in study["peers"].items():
        per = s["tokens_per_iteration"] / unit
        label, color = f"{labels.get(name, name)} (lr {s['best_lr']:g})", colors.get(name)
        train = s["train"]
        smooth = moving_average([loss for _, loss in train], max(1, len(train) // 30))
        for ax in (whole, zoom):
            ax.plot([it * per for it, _ in train], smooth, color=color, lw=1, alpha=0.35)
            if s["valid"]:
                ax.plot(*zip(*[(it * per, loss) for it, loss in s["valid"]]), "o-", color=color, ms=3.5, lw=1.5,
                        label=f"{label}, validation ({s['seeds']} seeds)")  # fmt: skip
                ax.fill_between([it * per for it, _ in s["valid_low"]], [v for _, v in s["valid_low"]],
                                [v for _, v in s["valid_high"]], color=color, alpha=0.18, lw=0)  # fmt: skip
        tops += smooth[len(smooth) // 10 : len(smooth) // 10 + 1]
        lows += [loss for _, loss in s["valid_low"]] + smooth
    for ax in (whole, zoom):
        if study["target"] is not None:
            ax.axhline(study["target"], color="gray", ls=":", lw=1, label="target")
        ax.set(xlabel=f"tokens ({unit_name})", ylabel="lm loss")
        ax.grid(alpha=0.3)
    if tops and lows:
        low, top = min(lows), max(tops)
        zoom.set_ylim(low - 0.1 * (top - low), top + 0.1 * (top - low))
    whole.set_title("the whole run", fontsize=10)
    zoom.set_title("after the first tenth (band: min to max over seeds)", fontsize=10)
    zoom.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_lr_sweep(study: Dict, labels: Dict[str, str], colors: Dict[str, str], path: Path, title: str) -> Path:
    """Final validation loss against learning rate, per peer: the seeds' mean with their
    spread as error bars, the best learning rate circled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.8))
    for name, s in study["peers"].items():
        points = [(lr, g["mean"], g["spread"]) for lr, g in s["grid"].items() if math.isfinite(g["mean"])]
        if not points:
            continue
        lrs, means, errs = zip(*points)
        errs = [e if math.isfinite(e) else 0.0 for e in errs]
        color = colors.get(name)
        ax.errorbar(lrs, means, yerr=errs, fmt="o-", color=color, capsize=3, label=labels.get(name, name))
        ax.plot([s["best_lr"]], [s["final_valid_mean"]], "o", ms=12, mfc="none", color=color)
    ax.set_xscale("log")
    ax.set(xlabel="peak learning rate", ylabel="final validation loss")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
