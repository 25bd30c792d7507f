"""Run the main job's start-up (``launch.prepare``, what ``tools/pretrain_gpt.py`` runs
before building anything) on many command lines in one interpreter: each case's exit code
and what it printed on stderr and stdout. Megatron-LM's global state is unset after each case
(a check of a resume runs on the validated, global arguments), so the cases do not see each
other; one process instead of one per case saves an import of Megatron-LM per case.

``python -m tests.helpers.bad_input`` reads a JSON list of argv lists on stdin and writes a
JSON list of ``[exit code, stderr, stdout]`` on stdout. The optional packages (:data:`HIDDEN`)
are hidden."""

from __future__ import annotations

import contextlib
import io
import json
import sys

HIDDEN = ("wandb", "transformers", "sentencepiece", "tiktoken")
"""The optional packages a refusal names (launch.missing_package), hidden here as on a machine
without them, whether or not this environment has them."""


def main() -> None:
    cases = json.load(sys.stdin)
    for package in HIDDEN:
        sys.modules[package] = None  # find_spec answers None, an import fails
    sys.argv = ["pretrain_gpt.py"]
    from megatron.training.global_vars import unset_global_variables

    from megatron_muon.megatron_lm.launch import prepare

    results = []
    for argv in cases:
        err, out = io.StringIO(), io.StringIO()
        code = 0
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                prepare(argv)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException as exc:  # noqa: BLE001 - a traceback is what the test reports
                code, err = 1, io.StringIO(f"Traceback: {exc!r}")
        unset_global_variables()
        results.append([code, err.getvalue(), out.getvalue()])
    json.dump(results, sys.__stdout__)


if __name__ == "__main__":
    main()
