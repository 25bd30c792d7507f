"""A recipe's flags that the run cannot use are dropped from its expansion with one line."""

from __future__ import annotations

import pytest

from megatron_muon.layer_specs import transformer_engine_available
from megatron_muon.megatron_lm.launch import expand_recipe, install_argument_layers


@pytest.mark.skipif(transformer_engine_available(), reason="transformer-engine installed: the recipe's flag stays")
def test_grouped_gemm_of_a_recipe_is_dropped_on_the_local_implementation(capsys):
    """Megatron-core 0.19's local spec builds one MLP per expert whatever --moe-grouped-gemm
    says (only transformer-engine's TEGroupedMLP groups them), so the recipe's flag goes, said
    once; asked for transformer-engine's implementation, the recipe keeps it (and the run is
    refused for the missing package instead)."""
    install_argument_layers()  # the recipe's --muon-* flags
    argv = expand_recipe(["--recipe", "deepseek_v3"])
    assert "--moe-grouped-gemm" not in argv and "--num-experts" in argv
    said = capsys.readouterr().out.strip().splitlines()
    assert len(said) == 1 and "--moe-grouped-gemm is off" in said[0], said
    kept = expand_recipe(["--recipe", "deepseek_v3", "--transformer-impl", "transformer_engine"])
    assert "--moe-grouped-gemm" in kept
    assert capsys.readouterr().out == ""
