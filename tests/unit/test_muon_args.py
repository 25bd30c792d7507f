"""``--muon-*`` flags generated from ``MuonConfig``'s field docstrings
(``megatron_muon.megatron_lm.muon_args``), on a bare argparse parser."""

from __future__ import annotations

import argparse


def test_help_renders_every_generated_flag():
    # argparse %-formats each help string: a docstring with a literal "%" (the split-NS
    # link prices say "at 80 %") made ``--help`` raise ValueError for the whole parser.
    from megatron_muon.config import MuonConfig, field_docstrings
    from megatron_muon.megatron_lm.muon_args import add_muon_arguments, muon_fields

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_muon_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert "at 80 %)" in text
    docs = field_docstrings(MuonConfig)
    assert any("%" in docs.get(f.name, "") for f in muon_fields())  # the case stays covered
