"""The documentation, read without running it: every page exists, every not-tested shell
block says why, python blocks compile, relative links point at files that exist, and the
MuonConfig table of docs/usage.md is current; a not-tested shell block is valid bash and a
GPU-cluster launch line passes Megatron-LM's validation. (The runnable shell blocks run in
``tests/e2e/test_docs.py``.)
"""

from __future__ import annotations

import math
import re
import shlex
import subprocess
from typing import List, Tuple

import pytest

from tests.helpers import REPO
from tests.helpers.docs import ALL, DOCS, SHELL, SHELLS, Block


def test_the_docs_exist():
    for name in ("index", "usage", "design", "recipes", "checkpoints", "benchmarks", "api"):
        assert (DOCS / f"{name}.md").is_file(), name
    assert SHELL, "no runnable shell blocks found"


@pytest.mark.parametrize("block", [b for b in ALL if b.skip], ids=lambda b: b.id)
def test_untested_blocks_say_why(block):
    assert len(block.skip) > 3 and block.lang in SHELLS, f"{block.id}: not-tested needs a reason, on a shell block"


@pytest.mark.parametrize("block", [b for b in ALL if b.lang == "python"], ids=lambda b: b.id)
def test_python_block_compiles(block):
    compile(block.text, block.id, "exec")


@pytest.mark.parametrize("block", [b for b in SHELL if "torchrun" in b.text], ids=lambda b: b.id)
def test_runnable_torchrun_lines_pick_a_free_port(block):
    """A block the suite runs must not take torchrun's default port 29500: two such blocks on
    the two pytest workers at once failed with EADDRINUSE (a fresh-clone CI run)."""
    for line in block.text.splitlines():
        if line.lstrip().startswith("torchrun"):
            assert any(f in line for f in ("--standalone", "--rdzv-endpoint", "--master-port")), f"{block.id}: {line}"


LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")


@pytest.mark.parametrize("path", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_relative_links_resolve(path):
    for target, _ in LINK.findall(path.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (path.parent / target).exists(), f"{path.name} links to missing {target}"


def test_config_table_is_current():
    """Every MuonConfig field is in docs/usage.md, with its current default and docstring."""
    from tools import config_reference

    text = config_reference.USAGE.read_text()
    assert config_reference.render(text) == text, "run: python tools/config_reference.py"


def test_config_table_lists_every_field():
    from megatron_muon.config import MuonConfig
    from tools import config_reference

    table = config_reference.table()
    for name in MuonConfig.__dict__["__annotations__"]:
        assert f"`{name}`" in table, name


@pytest.mark.parametrize("block", [b for b in ALL if b.skip], ids=lambda b: b.id)
def test_untested_blocks_are_valid_shell(block):
    """What cannot run here (a SLURM script, a multi-node launch) is at least valid bash."""
    proc = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, f"{block.id}: {proc.stderr}"


VARIABLE = re.compile(r"\$\{?(\w+)\}?")


def cluster_launches(block: Block) -> List[Tuple[int, List[str]]]:
    """``(world size, arguments of tools/pretrain_gpt.py)`` of each launch in a not-tested
    GPU-cluster block, its shell variables given stand-in values (``$SLURM_NNODES`` from the
    script's ``#SBATCH --nodes``)."""
    nodes = re.search(r"#SBATCH .*--nodes[= ](\d+)", block.text)
    values = {"SLURM_NNODES": nodes.group(1) if nodes else "1"}
    out = []
    for line in block.text.replace("\\\n", " ").splitlines():
        if "tools/pretrain_gpt.py" not in line:
            continue
        words = shlex.split(VARIABLE.sub(lambda m: values.get(m.group(1), "x"), line))
        at = words.index("tools/pretrain_gpt.py")
        launcher = dict(zip(words[:at], words[1 : at + 1]))
        world = int(launcher.get("--nnodes", 1)) * int(launcher.get("--nproc-per-node", 1))
        out.append((world, words[at + 1 :]))
    return out


@pytest.mark.parametrize(
    "block", [b for b in ALL if b.skip.startswith("gpu-cluster") and "pretrain_gpt.py" in b.text], ids=lambda b: b.id
)
def test_cluster_launch_lines_are_valid_arguments(block):
    """Every launch the docs show for a GPU cluster passes Megatron-LM's validation with our
    flags, at its world size (nothing is built)."""
    from megatron_muon.megatron_lm.launch import validated_args

    launches = cluster_launches(block)
    assert launches, block.id
    for world, argv in launches:
        validated_args(argv, world_size=world)


# ---------------------------------------------------------------------------------------
# The GPU check's figures quoted in README and docs/clusters.md, against its committed JSON
# ---------------------------------------------------------------------------------------


def _span(values) -> str:
    values = list(values)
    low, high = min(values), max(values)
    return f"{low:.2f}-{high:.2f}"


def _gpu_check_figures() -> List[Tuple[str, str, str]]:
    """``(page, sentence with one {} for the figure, figure from docs/bench/gpu_check.json)``."""
    import json

    check = json.loads((DOCS / "bench" / "gpu_check.json").read_text())
    parts = check["parts"]
    peers = parts["optimizer_step"]["peers"]
    main = parts["main_job"]
    runs = {r["name"]: r for r in main["runs"]}
    lrs = sorted(main["muon_over_adamw"])
    gap = [runs[f"adam, lr {lr}"]["last_loss"] - runs[f"muon, lr {lr}"]["last_loss"] for lr in lrs]
    ns = parts["newton_schulz"]
    eager = [r["of_peak"] for r in ns["rows"] if r["impl"] == "megatron_muon"]
    gram = [g for g in ns["gram"] if g["aspect"] >= 2.25]  # where Gram pays: the span README quotes
    minutes = math.ceil(check["plan_s"] / 60)
    in_words = {7: "seven", 8: "eight", 9: "nine", 10: "ten"}[minutes]
    ms = lambda peer: f"{peers[peer]['step_ms']:.1f}"  # noqa: E731
    over_whole = max(main["over_step_whole"].values())
    return [
        ("README.md", "the plan sums to under {} minutes", in_words),
        ("docs/clusters.md", "under {} minutes by its time boxes", in_words),
        ("docs/clusters.md", "(it ran in {} s on one H200)", f"{check['wall_s']:.0f}"),
        ("README.md", "our optimizer step takes {} ms against", ms("ours_exact")),
        ("README.md", "against Megatron-core's Muon's {} ms", ms("megatron_muon_blockwise")),
        ("README.md", "and AdamW's {} ms", ms("megatron_adamw")),
        ("README.md", "Muon ends 35 iterations {} below AdamW in loss", _span(gap)),
        ("README.md", "its iteration at {}x AdamW's", _span(main["muon_over_adamw"].values())),
        ("docs/clusters.md", "Muon's iteration cost {}x AdamW's", _span(main["muon_over_adamw"].values())),
        ("README.md", "runs at {} of the bf16 GEMM rate", _span(eager)),
        ("README.md", "Gram Newton–Schulz takes {} of standard's time", _span(g["time_ratio"] for g in gram)),
        (
            "README.md",
            "of standard's time at aspect ratios {}",
            f"{min(g['aspect'] for g in gram):.1f}-{max(g['aspect'] for g in gram):g}",
        ),  # fmt: skip
        ("README.md", "0.92-{} of the whole step's iteration time", f"{over_whole:.2f}"),
    ]


@pytest.mark.parametrize("page, sentence, figure", _gpu_check_figures(), ids=lambda v: str(v)[:40])
def test_quoted_gpu_figures_are_the_committed_benchmarks(page, sentence, figure):
    """A figure README or clusters.md quotes from the GPU check is the one its committed
    docs/bench/gpu_check.json gives (rounded as quoted): a new check run, or an edit of the
    page, cannot leave them apart. A sentence reworded: change it here too."""
    text = " ".join((REPO / page).read_text().split())
    found = re.search(
        re.escape(sentence).replace(r"\{\}", r"([0-9]+(?:[.,][0-9]+)*(?:-[0-9]+(?:\.[0-9]+)?)?|[a-z]+)"), text
    )
    assert found, f"{page} no longer says {sentence!r}"
    assert found.group(1) == figure, f"{page} says {sentence.format(found.group(1))!r}; gpu_check.json: {figure}"
