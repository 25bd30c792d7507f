"""tools/bench/exposed_step.py: the delay of an iteration by the optimizer step on a 1F1B
pipeline, against numbers worked out by hand."""

import pytest

from tools.bench.exposed_step import exposed_ms, exposure, microbatch_forward_ms, ready_ms


def test_two_stages_by_hand():
    """f = 10 ms. Stage 0: step 30, own kernels 20; stage 1: step 50, own 45.
    none: e0 = 30 + 10 = 40, e1 = max(40, 50) + 10 = 60, delay 60 - 2 x 10 = 40.
    forward, NS not concurrent: R0 = max(20, 30 - 10) = 20, e0 = 30; R1 = max(45, 40) = 45,
    e1 = 55, delay 35. forward, half of each forward idle: R0 = max(15, 20) = 20, e0 = 30;
    R1 = max(40, 40) = 40, e1 = 50, delay 30."""
    stages = [dict(step_ms=30.0, own_ms=20.0), dict(step_ms=50.0, own_ms=45.0)]
    assert exposed_ms(stages, 10.0, "none") == 40.0
    assert exposed_ms(stages, 10.0, "forward") == 35.0
    assert exposed_ms(stages, 10.0, "forward", idle_share=0.5) == 30.0


def test_one_stage_hides_only_communication_and_idle_time():
    """No pipeline: "none" waits for the whole step; "forward" for the stage's own kernels or
    the step less one forward; a step the forward's idle share covers costs nothing."""
    assert ready_ms(26.8, 26.0, 166.0, "none") == 26.8
    assert exposed_ms([dict(step_ms=26.8, own_ms=26.0)], 166.0, "forward") == pytest.approx(26.0)
    assert exposed_ms([dict(step_ms=26.8, own_ms=26.0)], 166.0, "forward", idle_share=0.2) == 0.0
    with pytest.raises(ValueError, match="muon_step_overlap"):
        ready_ms(1.0, 1.0, 1.0, "backward")


def test_forward_time_and_idle_share():
    """A train step of 3 f (m + P - 1): 16 micro-batches, PP1, 480 ms -> f = 10 ms; at MFU 0.4
    against Newton-Schulz's 0.5 of the peak a fifth of the forward leaves the GPU's matrix
    units idle."""
    assert microbatch_forward_ms(480.0, 16, 1) == 10.0 and microbatch_forward_ms(570.0, 16, 4) == 10.0
    e = exposure([dict(step_ms=5.0, own_ms=4.0)], 480.0, 16, mfu=0.4, ns_efficiency=0.5)
    assert e["idle_share"] == pytest.approx(0.2) and e["none_ms"] == 5.0 and e["forward_ms"] == 4.0
    assert e["forward_concurrent_ms"] == pytest.approx(2.0) and e["none_share_of_train"] == pytest.approx(5.0 / 480)
