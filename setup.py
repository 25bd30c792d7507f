"""megatron-muon: exact, distributed Muon / MuonClip for Megatron-core."""

import glob

from setuptools import find_packages, setup

setup(
    name="megatron-muon",
    version="0.1.0",
    description="Muon and MuonClip as a drop-in replacement for Megatron-core's DistributedOptimizer",
    packages=find_packages(include=["megatron_muon", "megatron_muon.*"]),
    python_requires=">=3.12",
    install_requires=[
        # torch before 2.10 has CVE-2026-24747 (its weights_only unpickler can be driven into
        # heap corruption); the suite runs on 2.11; from 2.15 megatron-core 0.19.2 cannot load its
        # checkpoints, and the main job refuses it (megatron_lm/launch.check_torch_version).
        "torch>=2.10",
        "megatron-core>=0.19,<0.20",
        "einops",
        # Megatron dist_checkpointing's async filesystem writer imports psutil.
        "psutil",
        "pyyaml",
        # Megatron-LM's --tensorboard-dir writer (with Muon's scalars: megatron_lm.integration).
        "tensorboard",
    ],
    entry_points={
        "console_scripts": [
            "megatron-muon-pretrain = megatron_muon.megatron_lm.launch:console_main",
        ]
    },
    data_files=[
        ("share/megatron_muon/recipes", sorted(glob.glob("recipes/*.yaml"))),
        # Megatron-LM-style scripts live in tools/; the console script runs this one.
        ("share/megatron_muon/tools", ["tools/pretrain_gpt.py"]),
    ],
    extras_require={
        # matplotlib: the suite also renders the benchmark plots (tools/bench/plots.py);
        # ruff: the formatter and linter .ci/run applies (pinned: its output is checked);
        # pytest-xdist: README's test command runs two workers (most tests wait on one
        # process's imports while the other core idles).
        # wandb: the suite checks that Muon's scalars reach W&B (offline).
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "matplotlib", "ruff==0.17.6", "wandb"],
        "bench": ["matplotlib", "emerging-optimizers==0.3.0"],
        # Megatron-core's own Muon (used only by comparison tests and benchmarks).
        "peer": ["emerging-optimizers==0.3.0"],
        # What Megatron-LM users plug in, imported only once a job runs: W&B (--wandb-project)
        # and the tokenizers' libraries (launch.TOKENIZER_PACKAGES).
        "ecosystem": ["wandb", "transformers", "sentencepiece", "tiktoken"],
        # A CUDA machine: transformer-engine as Megatron-core pins it (its own "te" extra).
        "gpu": ["megatron-core[te]>=0.19,<0.20"],
    },
)
