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


def test_megatron_lm_help_formats_every_flag():
    # megatron-core 0.19.2's help for --moe-paged-stash-buffer-size-factor-cuda has a bare
    # "%": Megatron-LM's --help failed with "unsupported format character" before any flag
    # was shown. Our arguments layer escapes what does not format.
    from megatron.training.arguments import add_megatron_arguments

    from megatron_muon.megatron_lm.integration import add_muon_arguments

    parser = add_muon_arguments(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    for action in parser._actions:
        if isinstance(action.help, str):
            action.help % dict(vars(action), prog=parser.prog)  # raises if one does not format
    text = parser.format_help()
    assert "--moe-paged-stash-buffer-size-factor-cuda" in text and "--muon-impl" in text
    assert "megatron_muon:" in text  # our flags are grouped
