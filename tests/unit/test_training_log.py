"""Megatron-LM's log line of a job's first iteration (``integration._wrap_training_log``), no
model: Megatron-LM logs it without resetting its loss sums (so that a log interval's average
holds every iteration of the interval); when the first iteration is itself a logged one
(every iteration at ``--log-interval 1``, the iteration after a resume at a save on the
interval), the next line averaged two iterations, and a resumed run's second loss was not
the uninterrupted run's. There it is logged as any logged iteration is."""

from __future__ import annotations

import argparse
import types

import pytest


@pytest.mark.parametrize(
    "log_interval, iteration, first, reset",
    [(1, 4, True, True), (10, 10, True, True), (10, 4, True, False), (1, 5, False, True)],
)
def test_the_first_log_line_at_a_logged_iteration_resets_the_loss_sums(log_interval, iteration, first, reset):
    from megatron_muon.megatron_lm.integration import _Installation, _wrap_training_log

    seen = []

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, *rest, is_first_iteration=False):
        seen.append(is_first_iteration)

    args = argparse.Namespace(log_interval=log_interval, tensorboard_dir=None)
    module = types.SimpleNamespace(get_args=lambda: args)
    wrapper = _wrap_training_log(training_log, _Installation(arguments=None, training=module))
    wrapper({}, {}, 0.1, iteration, 1.0, False, 0, None, None, None, None, is_first_iteration=first)
    assert seen == [first and not reset]
