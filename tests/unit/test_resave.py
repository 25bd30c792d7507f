"""The flags that rebuild a saved run (``megatron_lm.resave.run_flags``): Megatron-LM's
validation of them gives back the run's arguments, for recipes with the features that
validation derives values from (GQA, MoE, MLA, pipeline and expert parallelism, bf16)."""

from __future__ import annotations

import pytest

from megatron_muon.megatron_lm.launch import validated_args
from megatron_muon.megatron_lm.resave import NOT_CARRIED, RESAVE_FLAGS, run_flags

RUNS = {
    "tiny_moe_mla, EP2, bf16": (["--recipe", "tiny_moe_mla", "--expert-model-parallel-size", "2", "--bf16"], 2),
    "tiny_gqa, TP2, explicit ffn and no fusion": (
        [
            "--recipe",
            "tiny_gqa",
            "--tensor-model-parallel-size",
            "2",
            "--ffn-hidden-size",
            "96",
            "--no-masked-softmax-fusion",
            "--optimizer",
            "adam",
        ],
        4,
    ),  # fmt: skip
    "deepseek_v3 on 1024 ranks": (["--recipe", "deepseek_v3"], 1024),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_run_flags_rebuild_the_saved_arguments(name):
    argv, world = RUNS[name]
    saved = validated_args(argv + ["--optimizer", "adam"] if "--optimizer" not in argv else argv, world)
    flags = run_flags(saved)
    again = validated_args(flags + RESAVE_FLAGS, world)
    differ = {
        d: (v, getattr(again, d, None))
        for d, v in vars(saved).items()
        if d not in NOT_CARRIED and not d.startswith("_") and getattr(again, d, None) != v
    }
    assert not differ, differ
    assert "--encoder-num-layers" not in flags  # derived by validation from --num-layers
