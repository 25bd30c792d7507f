"""``--muon-step-overlap forward`` in Megatron-LM's own loop (``tools/pretrain_gpt.py``, two
CPU ranks, DP2 with ``--overlap-param-gather``, bf16 with fp32 masters): the same losses and
grad norms as ``--muon-step-overlap none`` over 12 iterations with QK-Clip clipping,
``--clip-grad`` acting on some steps, an evaluation every 4 iterations and a save at 6; a
resume from that save repeats iterations 7-12; Megatron-LM's profiler trace shows
Newton–Schulz inside the forward. (fp32, and the DP2xTP2, EP2xDP2 and PP2-with-virtual-stages
layouts: tests/dist/test_step_overlap.py.)
"""

from __future__ import annotations

import gzip
import json
import re
from typing import Dict

import pytest

from tests.helpers.jobs import TWO_RANKS, losses, run

VALID = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)")
NORM = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| grad norm: ([0-9.E+-]+) \|")
PARAMS_NORM = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| params norm: ([0-9.E+-]+) \|")
CLIP_GRAD = "2.0"
"""Between tiny_gqa's grad norms over these 12 iterations: clipping acts on some of them."""
FLAGS = (
    "--recipe tiny_gqa --bf16 --train-iters 12 --lr-warmup-iters 0 --eval-interval 4 --eval-iters 1 "
    "--muon-ns-dtype fp32 --qk-clip --qk-clip-threshold 0.01 --overlap-grad-reduce --overlap-param-gather "
    f"--clip-grad {CLIP_GRAD} --save-interval 6"
).split()


def _numbers(stdout: str) -> Dict[str, Dict[int, float]]:
    return {
        "loss": losses(stdout),
        "norm": {int(m.group(1)): float(m.group(2)) for m in NORM.finditer(stdout)},
        "validation": {int(m.group(1)): float(m.group(2)) for m in VALID.finditer(stdout)},
        "params": {int(m.group(1)): float(m.group(2)) for m in PARAMS_NORM.finditer(stdout)},
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each mode once, TensorBoard logging at every iteration, then the forward run resumed
    from its iteration-6 save with ``--log-params-norm`` (as the 'none' run: Megatron-LM
    reads every parameter right after the step). The forward run is profiled at iteration
    10, whose forward finishes the step of 9 (at 9, the evaluation after 8 has already
    finished the step before the forward)."""
    out = {}
    cache = tmp_path_factory.mktemp("cache")
    for mode in ("forward", "none"):
        work = tmp_path_factory.mktemp(mode)
        flags = [*FLAGS, "--muon-step-overlap", mode, "--data-cache-path", str(cache), "--save", str(work / "ckpt")]
        # TensorBoard at every iteration: measuring the update RMS must not finish the step early.
        flags += ["--tensorboard-dir", str(work / "tb"), "--tensorboard-log-interval", "1", "--log-interval", "1"]
        if mode == "none":
            flags += ["--log-params-norm"]
        if mode == "forward":
            flags += ["--profile", "--use-pytorch-profiler", "--profile-step-start", "10", "--profile-step-end", "11"]
        out[mode] = dict(numbers=_numbers(run(TWO_RANKS + flags, timeout=400)), work=work)
    work = out["forward"]["work"]
    resume = [*FLAGS, "--muon-step-overlap", "forward", "--data-cache-path", str(cache), "--load", str(work / "ckpt")]
    resume += ["--ckpt-step", "6", "--log-params-norm"]
    out["resumed"] = dict(numbers=_numbers(run(TWO_RANKS + resume, timeout=400)))
    return out


@pytest.mark.slow
def test_forward_logs_the_losses_and_grad_norms_of_none(runs):
    forward, none = runs["forward"]["numbers"], runs["none"]["numbers"]
    assert sorted(none["loss"]) == list(range(1, 13)) and sorted(none["validation"]) == [4, 8, 12]
    assert sorted(none["params"]) == list(range(1, 13))
    assert {k: v for k, v in forward.items() if k != "params"} == {k: v for k, v in none.items() if k != "params"}
    norms = list(none["norm"].values())
    assert min(norms) < float(CLIP_GRAD) < max(norms), norms


@pytest.mark.slow
def test_forward_resumes_from_its_save(runs):
    """Iterations 7-12 again from the save at 6, each logging the loss of the uninterrupted
    run, and ``--log-params-norm`` reads the parameters after the pending step finished: the
    norms of 'none'."""
    full, resumed = runs["forward"]["numbers"], runs["resumed"]["numbers"]
    assert sorted(resumed["loss"]) == list(range(7, 13))
    for i in range(7, 13):
        assert resumed["loss"][i] == full["loss"][i], (i, resumed["loss"][i], full["loss"][i])
    assert resumed["validation"] == {i: full["validation"][i] for i in (8, 12)}
    none = runs["none"]["numbers"]["params"]
    assert resumed["params"] == {i: none[i] for i in range(7, 13)}


@pytest.mark.slow
def test_forward_reports_the_update_rms_of_the_step_its_forward_finished(runs):
    """With the step finished in the next forward, iteration i's TensorBoard log reports the
    update RMS of step i-1 (finished by iteration i's forward) where 'none' reports step i's;
    the same numbers, one iteration later."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def update_rms(mode: str) -> Dict[int, float]:
        (events,) = list((runs[mode]["work"] / "tb").glob("events.out.tfevents.*"))
        acc = EventAccumulator(str(events))
        acc.Reload()
        return {e.step: e.value for e in acc.Scalars("muon/update-rms")}

    forward, none = update_rms("forward"), update_rms("none")
    assert sorted(none) == list(range(1, 13)), none
    assert forward == {i: none[i - 1] for i in range(2, 13)}, (forward, none)


@pytest.mark.slow
def test_profiler_trace_shows_newton_schulz_inside_the_forward(runs):
    """The profiled iteration: every ``muon/newton_schulz`` range starts inside the iteration
    and before its first backward operation (with 'none' they start after its last backward:
    ``test_pretrain.test_profiler_trace_shows_the_muon_step``). Not necessarily after the
    forward's first operation: the bucket groups' all-gathers are prefetched in forward order
    (``buffer_layout.prefetch_param_gathers_in_forward_order``), so the first Muon group's
    gather, and with it the pending Newton-Schulz of its matrices, starts from the forward
    pre-hook of the first module, before the embedding runs."""
    trace_file = runs["forward"]["work"] / "torch_profile" / "rank-0.json.gz"
    events = [e for e in json.loads(gzip.decompress(trace_file.read_bytes()))["traceEvents"] if e.get("ph") == "X"]
    (step,) = [e for e in events if e["name"].startswith("ProfilerStep#")]
    inside = [e for e in events if step["ts"] <= e["ts"] <= step["ts"] + step["dur"]]
    newton_schulz = [e["ts"] for e in inside if e["name"] == "muon/newton_schulz"]
    backward = min(e["ts"] for e in inside if e["name"].startswith("autograd::engine::evaluate_function"))
    assert newton_schulz and all(step["ts"] <= t < backward for t in newton_schulz), (
        step["ts"],
        backward,
        newton_schulz,
    )
