"""Shared by the tests that run Megatron-LM's own ``megatron.training``: a tiny command line
and its parse + validation, as ``pretrain_gpt.py`` does them."""

from __future__ import annotations

import contextlib
import io
import sys

ARGV = [
    "pretrain_gpt.py",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--ffn-hidden-size",
    "128",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--max-position-embeddings",
    "16",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "4",
    "--train-iters",
    "10",
    "--lr",
    "0.02",
    "--weight-decay",
    "0.01",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "128",
    "--optimizer",
    "muon",
    "--use-distributed-optimizer",
    "--muon-ns-dtype",
    "fp32",
    "--muon-comm-dtype",
    "fp32",
]


def parse_and_validate(arguments, argv):
    """Megatron-LM's ``parse_args`` and ``validate_args`` on ``argv`` (its listing kept off stdout)."""
    saved, sys.argv = sys.argv, list(argv)
    try:
        args = arguments.parse_args()
        with contextlib.redirect_stdout(io.StringIO()):
            arguments.validate_args(args, {})
        return args
    finally:
        sys.argv = saved


@contextlib.contextmanager
def megatron_functions_of_its_own():
    """Inside the block Megatron's functions are its own: layers of ours in force (an earlier
    test in this worker may have installed the argument layers for the process, as
    ``validated_args`` does) are set aside, whatever the block leaves installed is removed at
    its end, and the set-aside layers are put back."""
    from megatron_muon import patching

    with patching._lock:
        aside = list(patching._layers.values())
        for layer in aside:
            layer._remove()
    try:
        yield
    finally:
        with patching._lock:
            for layer in list(patching._layers.values()):
                layer._remove()
            for layer in aside:
                layer._add()
