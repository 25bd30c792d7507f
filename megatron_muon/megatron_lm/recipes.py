"""Recipes: YAML files of Megatron-LM flags (``num-layers: 2`` or ``num_layers: 2``).

A recipe is turned into command-line tokens placed *before* the real command line, so
every value goes through the same argparse types and checks as a flag would, and a flag
given on the command line overrides the recipe (argparse keeps the last occurrence).

Boolean keys follow the flag they name: ``swiglu: true`` adds ``--swiglu``,
``disable-bias-linear: true`` adds ``--disable-bias-linear``, ``muon-nesterov: false``
adds ``--no-muon-nesterov``. A key may also be an argument's destination name
(``add_bias_linear: false``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import yaml

from .muon_args import BoolFlag


class RecipeError(ValueError):
    """A recipe is missing, malformed, or names an unknown flag."""


def recipe_dirs() -> List[Path]:
    """Where recipe names are looked up: ``$MEGATRON_MUON_RECIPES`` (``os.pathsep``-
    separated), the repository's ``recipes/``, then ``<prefix>/share/megatron_muon/recipes``."""
    dirs = [Path(p) for p in os.environ.get("MEGATRON_MUON_RECIPES", "").split(os.pathsep) if p]
    dirs.append(Path(__file__).resolve().parents[2] / "recipes")  # a source checkout
    dirs.append(Path(sys.prefix) / "share" / "megatron_muon" / "recipes")  # installed as data files
    return dirs


def available_recipes() -> List[str]:
    return sorted({p.stem for d in recipe_dirs() if d.is_dir() for p in d.glob("*.yaml")})


def find_recipe(name_or_path: str) -> Path:
    """A recipe file from a path or a name (``tiny_gqa`` -> ``recipes/tiny_gqa.yaml``)."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    for d in recipe_dirs():
        for candidate in (d / name_or_path, d / f"{name_or_path}.yaml", d / f"{name_or_path}.yml"):
            if candidate.is_file():
                return candidate
    raise RecipeError(
        f"unknown recipe {name_or_path!r}: not a file, and not a name in {[str(d) for d in recipe_dirs()]}; "
        f"available recipes: {', '.join(available_recipes()) or '(none)'}"
    )


def load_recipe(name_or_path: str) -> Dict[str, Any]:
    """The recipe's mapping of flag names to values."""
    path = find_recipe(name_or_path)
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {path} must be a mapping of flag names to values, got {type(data).__name__}")
    return data


def flag_key(raw_key: Any) -> str:
    """A recipe key as the flag it names, without the dashes: ``lr_warmup_iters``,
    ``lr-warmup-iters`` and ``--lr-warmup-iters`` are all ``lr-warmup-iters``."""
    return str(raw_key).strip().lstrip("-").replace("_", "-")


def recipe_value(recipe: Dict[str, Any], key: str, default: Any = None) -> Any:
    """The value the recipe gives flag ``key`` (as :func:`flag_key` spells it), or ``default``."""
    raw = {flag_key(k): k for k in recipe}.get(key)
    return default if raw is None else recipe[raw]


def _actions(parser: argparse.ArgumentParser) -> Dict[str, argparse.Action]:
    by_key: Dict[str, argparse.Action] = {}
    for action in parser._actions:  # noqa: SLF001 - argparse offers no public listing
        for opt in action.option_strings:
            by_key[opt.lstrip("-")] = action
    for action in parser._actions:  # noqa: SLF001
        by_key.setdefault(action.dest.replace("_", "-"), action)
    return by_key


def _bool_tokens(key: str, action: argparse.Action, value: bool) -> List[str]:
    flag = "--" + key
    if isinstance(action, BoolFlag):
        negative = flag in action.negatives
        positive = next(o for o in action.option_strings if o not in action.negatives)
        want = value != negative  # the value of the destination
        return [positive] if want else [action.negatives[0]]
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):  # noqa: SLF001
        if flag in action.option_strings:  # keyed by the flag: true gives it
            return [flag] if value else []
        return [action.option_strings[0]] if value == action.const else []  # keyed by the destination
    raise RecipeError(f"recipe key {key!r} is a value flag; give it a value, not {value!r}")


def recipe_to_argv(recipe: Dict[str, Any], parser: argparse.ArgumentParser) -> List[str]:
    """Command-line tokens equivalent to ``recipe`` (raises ``RecipeError`` on unknown keys)."""
    actions = _actions(parser)
    argv: List[str] = []
    for raw_key, value in recipe.items():
        key = flag_key(raw_key)
        if key == "recipe":
            raise RecipeError("a recipe cannot include another recipe")
        action: Optional[argparse.Action] = actions.get(key)
        if action is None or not action.option_strings:
            raise RecipeError(f"recipe key {raw_key!r} is not a known flag (--{key})")
        flag = "--" + key if "--" + key in action.option_strings else action.option_strings[0]
        if action.nargs == 0:
            if not isinstance(value, bool):
                raise RecipeError(f"recipe key {raw_key!r} is a switch; use true or false, not {value!r}")
            argv.extend(_bool_tokens(key, action, value))
        elif value is None:
            continue
        elif action.nargs in ("*", "+"):
            values = value if isinstance(value, (list, tuple)) else [value]
            argv.append(flag)
            argv.extend(_token(v) for v in values)
        else:
            if isinstance(value, (list, tuple, dict)):
                raise RecipeError(f"recipe key {raw_key!r} takes one value, got {value!r}")
            argv.extend([flag, _token(value)])
    return argv


def _token(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


# ---------------------------------------------------------------------------------------
# A recipe fitted to the command line it runs with
# ---------------------------------------------------------------------------------------


def fitted_to(recipe: Dict[str, Any], rest: Sequence[str], say: Callable[[str], None]) -> Dict[str, Any]:
    """``recipe`` as the command line ``rest`` (everything but ``--recipe``) can run it:
    without its QK-Clip for another optimizer, without grouped experts on the local
    implementation, counted in samples under ``--train-samples``; ``say`` tells the user
    what was dropped, in one line each."""
    recipe = without_grouped_gemm_on_local(without_muon_only_settings(recipe, rest, say), rest, say)
    if given(rest, "--train-samples") is not None:
        recipe = sample_based(recipe, given(rest, "--global-batch-size"))
    return recipe


def given(argv: Sequence[str], flag: str) -> Optional[str]:
    """The value of ``flag`` on a command line, or None."""
    for i, token in enumerate(argv):
        if token == flag and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith(flag + "="):
            return token.split("=", 1)[1]
    return None


def without_muon_only_settings(
    recipe: Dict[str, Any], rest: Sequence[str], say: Callable[[str], None]
) -> Dict[str, Any]:
    """The recipe without its QK-Clip when the command line trains it with another optimizer
    (``--optimizer adam``, or Megatron-core's Muon): a recipe's QK-Clip is for megatron_muon,
    which clips the fp32 masters; Megatron-core's clips the model weights, which its
    distributed optimizer's masters overwrite at the next step."""
    optimizer = given(rest, "--optimizer") or recipe_value(recipe, "optimizer", "adam")
    impl = given(rest, "--muon-impl") or "megatron_muon"
    if not recipe_value(recipe, "qk-clip") or (optimizer in ("muon", "dist_muon") and impl == "megatron_muon"):
        return recipe
    say(
        f"megatron_muon: the recipe's QK-Clip (--qk-clip) is megatron_muon's; off with --optimizer {optimizer}"
        + (f" --muon-impl {impl}" if optimizer == "muon" else "")
    )
    return {k: v for k, v in recipe.items() if flag_key(k) != "qk-clip"}


def without_grouped_gemm_on_local(
    recipe: Dict[str, Any], rest: Sequence[str], say: Callable[[str], None]
) -> Dict[str, Any]:
    """The recipe without its ``--moe-grouped-gemm`` when the run uses the local implementation
    (no transformer-engine, or ``--transformer-impl local``): Megatron-core 0.19 builds grouped
    experts only with transformer-engine (``TEGroupedMLP``), and the flag has no negative form
    a command line could give (given on the command line, it is refused:
    ``launch.check_runnable_here``)."""
    from megatron_muon.layer_specs import transformer_engine_available

    if not recipe_value(recipe, "moe-grouped-gemm"):
        return recipe
    default = "transformer_engine" if transformer_engine_available() else "local"
    impl = given(rest, "--transformer-impl") or recipe_value(recipe, "transformer-impl", default)
    if impl == "transformer_engine":
        return recipe
    say(
        "megatron_muon: the recipe's --moe-grouped-gemm is off with --transformer-impl local (grouped experts "
        "are transformer-engine's TEGroupedMLP; the local implementation runs one MLP per expert)"
    )
    return {k: v for k, v in recipe.items() if flag_key(k) != "moe-grouped-gemm"}


ITERATION_SCHEDULE = {
    "lr-warmup-iters": "lr-warmup-samples",
    "lr-decay-iters": "lr-decay-samples",
    "lr-wsd-decay-iters": "lr-wsd-decay-samples",
}
"""A recipe's iteration-based schedule keys and their sample-based counterparts."""


def sample_based(recipe: Dict[str, Any], global_batch_size: Optional[str]) -> Dict[str, Any]:
    """A recipe for a run that counts samples (``--train-samples`` on the command line):
    its ``train-iters`` dropped, its iteration-based schedule given in samples (iterations x
    the global batch size). Megatron-LM takes one or the other, never both."""
    out = {}
    for raw_key, value in recipe.items():
        key = flag_key(raw_key)
        if key == "train-iters":
            continue
        if key in ITERATION_SCHEDULE and value:
            batch = global_batch_size or recipe_value(recipe, "global-batch-size")
            if batch is None:
                raise RecipeError(
                    f"the recipe sets {key}, which counts iterations; with --train-samples give "
                    f"--{ITERATION_SCHEDULE[key]} or --global-batch-size"
                )
            out[ITERATION_SCHEDULE[key]] = int(value) * int(batch)
            continue
        out[raw_key] = value
    return out
